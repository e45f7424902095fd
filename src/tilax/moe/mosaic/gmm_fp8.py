"""FP8 grouped matmul kernels for the MoE experts: Pallas, Mosaic GPU backend (Hopper, sm90+).

The two products of ``tilax.moe.quantize`` on ``float8_e4m3fn`` tensor cores, with the same
numbers (DeepSeek-V3's fine-grained scaling and promotion, ``quantize.py``'s module docstring):

- :func:`grouped_matmul_fp8`: ``out[r] = x[r] @ w[e(r)]`` for rows sorted by expert
  (``quantize.grouped_matmul``): the forward and the input gradients.
- :func:`grouped_matmul_t_fp8`: ``out[e] = lhs[rows of e].T @ rhs[rows of e]`` on the token
  tiles of ``quantize.token_tiles`` (``quantize.grouped_matmul_t``): the weight gradients.

**Operands are K-major.** ``wgmma`` transposes only 16-bit operands
(``jax/experimental/mosaic/gpu/wgmma.py``), so both e4m3 tiles must hold the contraction as
their minor dimension in shared memory: the ``x`` rows ``[block_m, 128]`` as they are, the
weights as ``[E, N, K]`` (the transposed layout; the kernel hands ``wgmma`` the transposed view
of a ``[block_n, 128]`` tile, as ``gmm.gmm`` does with ``transpose_rhs``). For the weight
gradients the contraction is the 128 tokens of a tile, so both operands are made token-major
first, by an XLA transpose of the e4m3 tiles (``[J, 128, K]`` to ``[J, K, 128]``): one more pass
over them (read and write ``J * 128 * K`` bytes each; at the E8 d512 h1024 layer's 131,072
tokens about 0.27 GB for ``x`` and twice that for ``a``, some 0.1 ms each on the H200 if XLA
does not fuse it into the quantisation, which writes those tiles anyway). A 128-byte swizzle
row holds 128 e4m3 values: one ``wgmma`` K group, one scale tile.

**One K step is one promotion interval.** Each step of 128 runs ``wgmma`` into a zeroed float32
accumulator, waits for it, and adds ``partial * scale`` to a second float32 accumulator held in
registers: ``s_x[rows, step] * s_w[e, step, n_block]`` for :func:`grouped_matmul_fp8` (the
row scales arrive by TMA with the operand tiles, the weight block's scale is one scalar),
``s_lhs[j, rows] * s_rhs[j, columns]`` for :func:`grouped_matmul_t_fp8`. The sums are the
reference's (every partial is exact: products of e4m3 values summed in float32), added in the
same order, so the outputs differ from ``quantize.py`` only by the order of the float32
additions inside one 128-step (``wgmma``'s against XLA's). Two float32 ``[block_m, block_n]``
accumulators live in one warpgroup's registers, so ``block_n`` is capped at 64 for
``block_m = 128`` (``common.capped_block_n``); the planned structure (docs/performance/moe.md,
"FP8: the plan": two consumer warpgroups of 64 rows each, one promoting while the other's
``wgmma`` runs) is not built yet: here the promotion waits for each step's ``wgmma``, while the
TMA pipeline keeps the next steps' copies landing.

Shapes: contractions ``K`` (the forward's) and token tiles of 128 (the weight gradient's);
``K`` and ``N`` multiples of 128 and 64 (``ValueError`` otherwise: the layer with
``quantize="fp8"`` and ``impl="mosaic"`` needs ``d_model`` and ``d_hidden`` multiples of 128).
Rows of :func:`grouped_matmul_fp8` follow the ``dispatch.GmmSchedule`` items of the bfloat16
kernels (``mosaic/gmm.py``): row tiles respect expert boundaries, each row stored by exactly
one item. Mosaic GPU APIs relied on: those of ``mosaic/gmm.py``, with ``float8_e4m3fn``
operands to ``plgpu.wgmma`` (an ``f32`` accumulator; jax 0.10.2 and 0.11.2 alike).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.moe import dispatch, quantize
from tilax.moe.mosaic import common
from tilax.moe.mosaic.common import Config, plgpu

__all__ = [
    "STEP",
    "default_tiles",
    "grouped_matmul_fp8",
    "grouped_matmul_t_fp8",
    "tile_offsets",
    "tiles_for",
    "token_major",
]

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
#: Contraction step: one 128-byte swizzle row of e4m3 values and one scale tile.
STEP = quantize.TILE
# Two float32 tiles live: the step's partial product and the promoted sum.
LIVE_TILES = 2


def tiles_for(config) -> Config:
    """The tiles for an ``MoEConfig`` (``common.tiles_for``: ``block_m``, ``num_stages``; the
    kernels fix ``block_k`` and cap ``block_n``)."""
    return common.tiles_for(config)


def default_tiles() -> Config:
    """The bfloat16 kernels' default tiles (``common.default_config``): ``block_m`` 128,
    up to 4 stages; ``block_k`` is always :data:`STEP` here and ``block_n`` is capped so that
    the two accumulators fit the registers."""
    return common.default_config(jnp.bfloat16)


def _check_operand(name: str, array: jax.Array, dtype, ndim: int) -> None:
    if jnp.dtype(array.dtype) != jnp.dtype(dtype) or array.ndim != ndim:
        raise ValueError(
            f"{name} must be a {ndim}-D {jnp.dtype(dtype).name} array, got "
            f"{jnp.dtype(array.dtype).name} of shape {array.shape}"
        )


def _check_dims(k_dim: int, n_dim: int) -> None:
    if k_dim % STEP:
        raise ValueError(
            f"the FP8 Mosaic GPU kernels need the contraction to be a multiple of "
            f"{STEP} (one scale tile a wgmma step), got {k_dim}"
        )
    if n_dim % common.FEATURE_MULTIPLE:
        raise ValueError(
            f"the FP8 Mosaic GPU kernels need output widths that are multiples of "
            f"{common.FEATURE_MULTIPLE}, got {n_dim}"
        )


def _pipeline(step, num_steps, operands, scales, stages: int) -> None:
    """A TMA pipeline (``common.pipeline``'s) whose steps bring e4m3 ``operands`` (swizzled
    ``[rows, 128]`` tiles, ``wgmma``'s layout) and float32 ``scales`` vectors (plain SMEM);
    ``step(indices, *operand_smems, *scale_smems)``."""
    specs = [
        plgpu.BlockSpec(
            shape, index_map, delay_release=1, transforms=common.mma_transforms(shape[1], FP8)
        )
        for _, shape, index_map in operands
    ] + [plgpu.BlockSpec(shape, index_map, delay_release=1) for _, shape, index_map in scales]
    refs = [ref for ref, _, _ in operands] + [ref for ref, _, _ in scales]
    plgpu.emit_pipeline(step, grid=(num_steps,), in_specs=specs, max_concurrent_steps=stages)(*refs)


def _promote(partial_ref, total_ref, a_smem, b_smem, scale) -> None:
    """One promotion step: ``partial = a @ b.T`` (both K-major) from zero, then
    ``total += partial * scale()`` in float32 registers."""
    partial_ref[...] = jnp.zeros(partial_ref.shape, F32)
    plgpu.wgmma(partial_ref, a_smem, _pallas.transposed_ref(b_smem))
    partial = partial_ref[...]  # waits for the wgmma
    total_ref[...] = total_ref[...] + partial * scale(partial.shape)


def _fit(tiles: Config, block_m: int, n_dim: int, scaled_rows: bool) -> tuple[int, int]:
    """``(block_n, stages)`` for ``block_m`` rows: ``block_n`` within the registers of two
    accumulators, the stages within shared memory (each holds a ``[block_m + block_n, 128]``
    e4m3 slab and float32 scale vectors of ``block_m`` and, unless ``scaled_rows``, of
    ``block_n``)."""
    if block_m % common.WGMMA_ROWS:
        raise ValueError(
            f"the FP8 Mosaic GPU kernels need row tiles that are multiples of "
            f"{common.WGMMA_ROWS}, got {block_m}"
        )
    block_n = common.capped_block_n(dataclasses.replace(tiles, block_m=block_m), n_dim, LIVE_TILES)
    scale_bytes = 4 * (block_m + (0 if scaled_rows else block_n))
    row_bytes = block_m + block_n + -(-scale_bytes // STEP)
    _, stages = common.fit_pipeline(tiles, STEP, row_bytes, min_block_k=STEP)
    return block_n, stages


# ----------------------------------------------------------------------------------------------
# grouped_matmul_fp8: out[r] = x[r] @ w[e(r)], promoted every 128 of the contraction


def grouped_matmul_fp8(
    lhs: jax.Array,
    lhs_scales: jax.Array,
    rhs_t: jax.Array,
    rhs_scales: jax.Array,
    group_sizes: jax.Array,
    *,
    tiles: Config | None = None,
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """``out[r] = x[r] @ w[e(r)]`` for rows sorted by expert, from e4m3 operands, with
    ``quantize.grouped_matmul``'s numbers (its float32 sums in another order within each
    128-step, see the module docstring).

    Args:
        lhs: ``[R, K]`` e4m3 rows (``quantize.quantize_rows``); ``R`` a multiple of the row
            tile ``tiles.block_m`` (the layer's ``row_multiple``).
        lhs_scales: ``[R, K / 128]`` float32.
        rhs_t: ``[E, N, K]`` e4m3 weights, K-major: the transpose of
            ``quantize.quantize_blocks(w)[0]`` for ``w: [E, K, N]``.
        rhs_scales: ``[E, K / 128, ceil(N / 128)]`` float32 block scales of ``w``
            (``quantize.quantize_blocks(w)[1]``: not transposed).
        group_sizes: ``[E]`` int32 rows per expert (expert ``e`` owns the rows after those
            of experts ``< e``).
        tiles: ``block_m``, ``num_stages`` and ``programs_per_sm`` (:func:`default_tiles`
            when ``None``); ``block_k`` is 128 and ``block_n`` at most 64 here.
        out_dtype: the output dtype (the float32 sum is rounded once).

    Returns:
        ``[R, N]`` in ``out_dtype``. Rows past every group are computed with the last expert's
        weights (every row is written by exactly one work item): zero where their ``lhs`` rows
        are, as the layer's padding rows are; ``quantize.grouped_matmul`` gives zeros there.

    Raises:
        ValueError: operands of other dtypes or ranks, ``K`` not a multiple of 128, ``N`` not
            a multiple of 64, ``R`` not a multiple of ``block_m``, or scale shapes that do not
            match.
    """
    tiles = tiles or default_tiles()
    _check_operand("lhs", lhs, FP8, 2)
    _check_operand("rhs_t", rhs_t, FP8, 3)
    num_rows, k_dim = lhs.shape
    num_experts, n_dim = rhs_t.shape[:2]
    if rhs_t.shape[2] != k_dim:
        raise ValueError(f"rhs_t must be [E, N, K] with K = {k_dim} (lhs's), got {rhs_t.shape}")
    _check_dims(k_dim, n_dim)
    k_steps = k_dim // STEP
    if lhs_scales.shape != (num_rows, k_steps):
        raise ValueError(
            f"lhs_scales must have shape {(num_rows, k_steps)}, got {lhs_scales.shape}"
        )
    w_blocks = (num_experts, k_steps, -(-n_dim // STEP))
    if rhs_scales.shape != w_blocks:
        raise ValueError(f"rhs_scales must have shape {w_blocks}, got {rhs_scales.shape}")
    if group_sizes.shape != (num_experts,):
        raise ValueError(f"group_sizes must have shape {(num_experts,)}, got {group_sizes.shape}")
    block_m = tiles.block_m
    block_n, stages = _fit(tiles, block_m, n_dim, scaled_rows=True)
    if num_rows % block_m:
        raise ValueError(f"lhs has {num_rows} rows: not a multiple of the row tile {block_m}")
    offsets = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes).astype(jnp.int32)]
    )
    schedule = dispatch.gmm_schedule(offsets, num_rows, block_m)
    row_tiles = num_rows // block_m
    # Step-major row scales, flat: step k's scales of row tile m are one [block_m] TMA box.
    scales_flat = jnp.swapaxes(lhs_scales.astype(F32), 0, 1).reshape(-1)
    out_dtype = jnp.dtype(out_dtype)

    def body(*refs):
        schedule_refs, (x_g, w_g, s_x_g, s_w_g), out_g = refs[:4], refs[4:8], refs[8]

        def item_fn(item, _):
            tile = item.row_start // block_m
            operands = [
                (x_g, (block_m, STEP), lambda k: (tile, k)),
                (w_g.at[item.expert], (block_n, STEP), lambda k: (item.n, k)),
            ]
            scales = [(s_x_g, (block_m,), lambda k: (k * row_tiles + tile,))]
            w_block = item.n * block_n // STEP

            def run(partial_ref, total_ref):
                def step(indices, x_smem, w_smem, s_smem):
                    (k,) = indices
                    w_scale = s_w_g[item.expert, k, w_block]
                    _promote(
                        partial_ref,
                        total_ref,
                        x_smem,
                        w_smem,
                        lambda shape: common.rows_to_tile(s_smem[...] * w_scale, shape),
                    )

                _pipeline(step, k_steps, operands, scales, stages)

            _, total = common.accumulate(2, block_m, block_n, run)

            def write(o_smem):
                o_smem[...] = total.astype(o_smem.dtype)

            common.stage_and_store([out_g], item, block_m, block_n, write)

        common.for_each_item(schedule_refs, n_dim // block_n, block_m, item_fn)

    out = jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype)
    kernel = common.launch(body, out, "moe_gmm_fp8_mosaic", tiles)
    return kernel(*schedule, lhs, rhs_t, scales_flat, rhs_scales.astype(F32))


# ----------------------------------------------------------------------------------------------
# grouped_matmul_t_fp8: out[e] = lhs[rows of e].T @ rhs[rows of e], one promotion per tile


def token_major(tiles: jax.Array) -> jax.Array:
    """``[J, 128, K]`` token tiles as ``[J * K, 128]``: each tile's values token-major (the
    contraction minor, as an e4m3 ``wgmma`` operand must be), by an XLA transpose."""
    num_tiles, tokens, width = tiles.shape
    return jnp.swapaxes(tiles, 1, 2).reshape(num_tiles * width, tokens)


def tile_offsets(token_tiles: quantize.TokenTiles, num_experts: int) -> jax.Array:
    """``[E + 1]`` int32: expert ``e``'s token tiles are ``[offsets[e], offsets[e + 1])``
    (``quantize.token_tiles`` puts each expert's tiles together, in expert order; a tile
    holds rows of its expert from its first slot on)."""
    counts = jax.ops.segment_sum(
        token_tiles.used[:, 0].astype(jnp.int32), token_tiles.expert, num_segments=num_experts
    )
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])


def grouped_matmul_t_fp8(
    lhs: jax.Array,
    lhs_scales: jax.Array,
    rhs: jax.Array,
    rhs_scales: jax.Array,
    token_tiles: quantize.TokenTiles,
    num_experts: int,
    *,
    tiles: Config | None = None,
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """Weight gradients ``out[e] = lhs[rows of e].T @ rhs[rows of e]`` from e4m3 token tiles,
    with ``quantize.grouped_matmul_t``'s numbers: each tile's 128-token partial from zero,
    scaled by ``lhs_scales[j, k] * rhs_scales[j, n]`` and added in tile order.

    Both operands are made token-major by :func:`token_major` (an XLA transpose of the e4m3
    tiles: the module docstring says what it costs). One work item per (expert, output tile);
    its pipeline runs over the expert's tiles.

    Args:
        lhs: ``[J, 128, K]`` e4m3 (``quantize.quantize_token_tiles``); ``K`` a multiple of
            128.
        lhs_scales: ``[J, K]`` float32.
        rhs: ``[J, 128, N]`` e4m3; ``N`` a multiple of 64.
        rhs_scales: ``[J, N]`` float32.
        token_tiles: the ``quantize.TokenTiles`` both were made with.
        num_experts: ``E``.
        tiles: ``block_m`` (output rows, along ``K``), ``num_stages``, ``programs_per_sm``
            (:func:`default_tiles` when ``None``).
        out_dtype: the output dtype.

    Returns:
        ``[E, K, N]`` in ``out_dtype`` (zero for experts without rows).

    Raises:
        ValueError: operands of other dtypes or shapes, ``K`` not a multiple of 128 or ``N``
            not a multiple of 64.
    """
    tiles = tiles or default_tiles()
    _check_operand("lhs", lhs, FP8, 3)
    _check_operand("rhs", rhs, FP8, 3)
    num_tiles, tokens, k_dim = lhs.shape
    n_dim = rhs.shape[2]
    if tokens != STEP or rhs.shape[:2] != (num_tiles, STEP):
        raise ValueError(
            f"lhs and rhs must be [J, {STEP}, ...] token tiles of the same J, got "
            f"{lhs.shape} and {rhs.shape}"
        )
    # K is the output's rows here, N its columns: K needs whole 128-row tiles (block_m).
    _check_dims(k_dim, n_dim)
    if lhs_scales.shape != (num_tiles, k_dim) or rhs_scales.shape != (num_tiles, n_dim):
        raise ValueError(
            f"lhs_scales and rhs_scales must have shapes {(num_tiles, k_dim)} and "
            f"{(num_tiles, n_dim)}, got {lhs_scales.shape} and {rhs_scales.shape}"
        )
    block_m = common.fit_block(tiles.block_m, k_dim)
    block_n, stages = _fit(tiles, block_m, n_dim, scaled_rows=False)
    m_tiles, n_tiles = k_dim // block_m, n_dim // block_n
    offsets = tile_offsets(token_tiles, num_experts)
    out_dtype = jnp.dtype(out_dtype)

    def body(offsets_g, a_g, b_g, s_a_g, s_b_g, out_g):
        @plgpu.nd_loop((num_experts, m_tiles, n_tiles), collective_axes="sm")
        def _loop(info):
            expert, m, n = info.index
            first, last = offsets_g[expert], offsets_g[expert + 1]
            operands = [
                (a_g, (block_m, STEP), lambda j: ((first + j) * m_tiles + m, 0)),
                (b_g, (block_n, STEP), lambda j: ((first + j) * n_tiles + n, 0)),
            ]
            scales = [
                (s_a_g, (block_m,), lambda j: ((first + j) * m_tiles + m,)),
                (s_b_g, (block_n,), lambda j: ((first + j) * n_tiles + n,)),
            ]

            def run(partial_ref, total_ref):
                def step(_, a_smem, b_smem, s_a_smem, s_b_smem):
                    def scale(shape):
                        rows = common.rows_to_tile(s_a_smem[...], shape)
                        return rows * lax.broadcast_in_dim(s_b_smem[...], shape, (1,))

                    _promote(partial_ref, total_ref, a_smem, b_smem, scale)

                pl.when(last > first)(
                    lambda: _pipeline(step, last - first, operands, scales, stages)
                )

            _, total = common.accumulate(2, block_m, block_n, run)
            out_tile = (expert, pl.ds(m * block_m, block_m), pl.ds(n * block_n, block_n))

            def store(o_smem):
                o_smem[...] = total.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, out_g.at[out_tile], commit_group=False)
                plgpu.commit_smem_to_gmem_group()
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.run_scoped(
                store,
                plgpu.SMEM(
                    (block_m, block_n),
                    out_dtype,
                    transforms=common.mma_transforms(block_n, out_dtype),
                ),
            )

    out = jax.ShapeDtypeStruct((num_experts, k_dim, n_dim), out_dtype)
    kernel = common.launch(body, out, "moe_tgmm_fp8_mosaic", tiles)
    return kernel(
        offsets,
        token_major(lhs),
        token_major(rhs),
        lhs_scales.astype(F32).reshape(-1),
        rhs_scales.astype(F32).reshape(-1),
    )
