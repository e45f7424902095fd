"""Grouped matmul kernels for the MoE experts: Pallas, Triton backend (interpret mode on CPU).

One backend of the Pallas expert path (``pallas.py``): this module is the kernel set of the
``base.GmmKernels`` contract, with its own tile configuration (:class:`Tiles`,
:func:`default_tiles`, :func:`tiles_for`).

The row space is the token copies sorted by expert (``dispatch.sort_by_expert``), padded to a
multiple of the row tile. Forward-type kernels run one program per ``[block_m, block_n]`` output
tile of one work item of a ``dispatch.GmmSchedule`` (a row tile and the expert whose rows it
keeps), with the K loop inside the kernel and bfloat16/float32 operands fed to ``tl.dot`` with a
float32 accumulator. A tile that straddles an expert boundary is computed once per expert and
each pass stores only its own rows (a masked store), so every row is written by exactly one
program: exact, deterministic, and with no padded per-expert copy of any activation.

Kernels (each wrapper below builds one ``pallas_call``):

- :func:`gmm`: ``out[r] = lhs[r] @ rhs[e(r)]`` with optional row gather through an index
  (``lhs[index[r]]``), transposed weights (``rhs[e].T``, for input gradients), a second summed
  product (``+ lhs2[r] @ rhs2[e(r)]``) and a per-row scale.
- :func:`gmm_activation`: gate and up projections and the activation (``MoEConfig.activation``,
  from ``tilax.moe.activations``; optionally scaled per row) in one pass over the rows; the up
  projection alone for the not-gated ``"gelu"``.
- :func:`gmm_activation_bwd`: the down projection's input gradient fused with the activation's
  backward.
- :func:`gmm_combine`: the down projection with the weighted combine in its epilogue, summed
  into the tokens' float32 outputs with atomic adds.
- :func:`copy_rows`: the sorted copy of ``x`` (XLA's gather; the sorted dispatch's).
- :func:`tgmm`: the "transposed" grouped matmul ``lhs[rows_e].T @ rhs[rows_e]`` for weight
  gradients (ragged contraction over each expert's rows), one program per output tile.

All feature dimensions must be multiples of 16 (the layer pads them); tiles are shrunk to the
largest power of two dividing each dimension.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from tilax import _pallas
from tilax.moe import activations
from tilax.moe.dispatch import GmmSchedule, RowLayout, take_rows


def gathers_in_training() -> bool:
    """The kernels gather rows through ``index`` themselves, in a train step too: only the
    sorted dispatch reads copies (``copy_rows``)."""
    return True

# tl.dot needs every block dimension >= 16.
MIN_BLOCK = _pallas.MIN_BLOCK
fit_block = _pallas.fit_block


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Kernel tiles and Triton launch parameters.

    ``block_m``: rows of the sorted token copies per tile (forward-type kernels) and the output
    tile's first dimension (``tgmm``); ``block_n``: output columns per tile; ``block_k``:
    contraction step (features for forward-type kernels, rows for ``tgmm``). Powers of two
    >= 16. ``num_warps``/``num_stages`` go to the Triton compiler (ignored in interpret mode).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    @property
    def row_multiple(self) -> int:
        """Row-space arrays must have a multiple of this many rows."""
        return max(self.block_m, self.block_k)

    @property
    def feature_multiple(self) -> int:
        """``d_model`` and ``d_hidden`` are zero-padded to a multiple of this (tl.dot's
        smallest block)."""
        return MIN_BLOCK


def default_tiles(dtype) -> Tiles:
    """Device-default kernel tiles for activations of ``dtype``.

    - CPU (interpret mode): 32 x 32 x 32 (the tiles only set the interpreter's loop counts).
    - GPU, float32 operands (IEEE float32 dots, no tensor-core path): 64 x 64 x 32,
      4 warps, 2 stages.
    - Hopper and newer (sm90+), 16-bit operands: 128 x 128 x 64, 8 warps, 3 stages.
    - Older GPUs (sm80-sm89), 16-bit operands: 64 x 128 x 32, 4 warps, 3 stages.
    """
    if _pallas.platform() != "gpu":
        return Tiles(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2)
    if jnp.dtype(dtype) == jnp.float32:
        return Tiles(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2)
    if _pallas.is_hopper_or_newer():
        return Tiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    return Tiles(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=3)


TILE_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")


def tiles_for(config) -> Tiles:
    """The tiles for an ``MoEConfig``: ``default_tiles`` overridden by the config's fields."""
    overrides = {
        name: getattr(config, name) for name in TILE_FIELDS if getattr(config, name) is not None
    }
    return dataclasses.replace(default_tiles(config.dtype), **overrides)


def copy_rows(x: jax.Array, layout: RowLayout) -> jax.Array:
    """``x[layout.row_token]``, ``[R_pad, d]``: XLA's gather."""
    return take_rows(x, layout.row_token)


def _capped_block_n(tiles: Tiles, per_thread: int) -> int:
    """``block_n`` shrunk so that one ``[block_m, block_n]`` float32 tile takes at most
    ``per_thread`` registers per thread. Kernels with two accumulators use 64, the activation's
    backward (three live tiles in its epilogue) 32; beyond that the registers spill."""
    return min(tiles.block_n, max(MIN_BLOCK, per_thread * 32 * tiles.num_warps // tiles.block_m))


def _call(kernel, *, tiles: Tiles, backend: str, **kwargs):
    return _pallas.pallas_call(
        kernel,
        backend=backend,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **kwargs,
    )


# ----------------------------------------------------------------------------------------------
# In-kernel helpers (traced inside the kernels).


def _iota(shape: tuple[int, ...], dim: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def _item_rows_mask(lo, hi, block_m: int) -> jax.Array:
    """``[block_m, 1]`` bool: tile-local rows ``[lo, hi)``."""
    local = _iota((block_m, 1), 0)
    return (local >= lo) & (local < hi)


def _load_rows(ref, row_start, src_rows, col_start, num_rows: int, num_cols: int, mask=None):
    """A ``[num_rows, num_cols]`` tile of a 2-D ref: contiguous rows, or gathered ``src_rows``."""
    if src_rows is None:
        view = ref.at[pl.ds(row_start, num_rows), pl.ds(col_start, num_cols)]
    else:
        view = ref.at[src_rows[:, None], col_start + _iota((1, num_cols), 1)]
    if mask is None:
        return plt.load(view)
    return plt.load(view, mask=mask, other=jnp.zeros((), ref.dtype))


def _weight_tile(w_ref, expert, k_start, n_start, block_k: int, block_n: int, transpose: bool):
    """Expert ``expert``'s ``[block_k, block_n]`` weight tile, or ``[block_n, block_k]`` of the
    ``[E, N, K]`` layout when ``transpose`` (the product then contracts its last dimension)."""
    if transpose:
        return w_ref[expert, pl.ds(n_start, block_n), pl.ds(k_start, block_k)]
    return w_ref[expert, pl.ds(k_start, block_k), pl.ds(n_start, block_n)]


def _dot(a, b, *, contract_a: int = 1, contract_b: int = 0) -> jax.Array:
    dims = (((contract_a,), (contract_b,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------
# gmm: out[r] = lhs[r | index[r]] @ rhs[e(r)] (+ lhs2[r] @ rhs2[e(r)]) (* scale[r])


def _gmm_kernel(
    expert_ref, tile_ref, lo_ref, hi_ref, *refs,
    block_m, block_n, block_k, num_k, gather, transpose_rhs, dual, scaled,
):
    refs = list(refs)
    index_ref = refs.pop(0) if gather else None
    lhs_ref, rhs_ref = refs.pop(0), refs.pop(0)
    lhs2_ref, rhs2_ref = (refs.pop(0), refs.pop(0)) if dual else (None, None)
    scale_ref = refs.pop(0) if scaled else None
    (out_ref,) = refs
    n_tile, item = pl.program_id(0), pl.program_id(1)
    lo, hi = lo_ref[item], hi_ref[item]

    @pl.when(lo < hi)
    def _compute():
        expert = expert_ref[item]
        row_start = pl.multiple_of(tile_ref[item] * block_m, block_m)
        n_start = pl.multiple_of(n_tile * block_n, block_n)
        src_rows = index_ref[pl.ds(row_start, block_m)] if gather else None
        contract_b = 1 if transpose_rhs else 0

        def k_loop(a_ref, b_ref, a_rows, acc):
            def body(k, acc):
                k_start = pl.multiple_of(k * block_k, block_k)
                a = _load_rows(a_ref, row_start, a_rows, k_start, block_m, block_k)
                b = _weight_tile(b_ref, expert, k_start, n_start, block_k, block_n, transpose_rhs)
                return acc + _dot(a, b, contract_b=contract_b)

            return lax.fori_loop(0, num_k, body, acc)

        acc = k_loop(lhs_ref, rhs_ref, src_rows, jnp.zeros((block_m, block_n), jnp.float32))
        if dual:
            # A second loop rather than two dots per step: Triton keeps the wgmma of a loop
            # with one dot asynchronous across iterations, not of a chain of two.
            acc = k_loop(lhs2_ref, rhs2_ref, None, acc)
        if scaled:
            acc = acc * scale_ref[pl.ds(row_start, block_m)][:, None]
        plt.store(
            out_ref.at[pl.ds(row_start, block_m), pl.ds(n_start, block_n)],
            acc.astype(out_ref.dtype),
            mask=_item_rows_mask(lo, hi, block_m),
        )


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    schedule: GmmSchedule,
    *,
    tiles: Tiles,
    backend: str,
    index: jax.Array | None = None,
    transpose_rhs: bool = False,
    lhs2: jax.Array | None = None,
    rhs2: jax.Array | None = None,
    row_scale: jax.Array | None = None,
    out_dtype=None,
) -> jax.Array:
    """Grouped matmul over the row space.

    Args:
        lhs: ``[R_pad, K]`` rows, or any ``[S, K]`` source gathered through ``index``.
        rhs: ``[E, K, N]`` expert weights, or ``[E, N, K]`` with ``transpose_rhs``.
        schedule: work items from ``dispatch.gmm_schedule(offsets, R_pad, tiles.block_m)``.
        tiles, backend: kernel tiles; ``"triton"`` or ``"interpret"``.
        index: ``[R_pad]`` int32 rows of ``lhs`` to read (the in-kernel gather).
        transpose_rhs: multiply by ``rhs[e].T`` (``rhs`` stored ``[E, N, K]``).
        lhs2, rhs2: a second product ``lhs2[r] @ rhs2[e(r)]`` added in the same K loop
            (``lhs2`` in row space, same shapes and transposition as ``lhs``/``rhs``).
        row_scale: ``[R_pad]`` float32 factors applied to the float32 result rows.
        out_dtype: result dtype (default ``lhs.dtype``).

    Returns:
        ``[R_pad, N]``.
    """
    num_rows = lhs.shape[0] if index is None else index.shape[0]
    k_dim = lhs.shape[1]
    n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    block_m = tiles.block_m
    block_n, block_k = fit_block(tiles.block_n, n_dim), fit_block(tiles.block_k, k_dim)
    if num_rows % block_m:
        raise ValueError(f"row count {num_rows} is not a multiple of block_m {block_m}")
    args = [*schedule]
    if index is not None:
        args.append(index)
    args += [lhs, rhs]
    if lhs2 is not None:
        args += [lhs2, rhs2]
    if row_scale is not None:
        args.append(row_scale)
    kernel = functools.partial(
        _gmm_kernel,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_k=k_dim // block_k,
        gather=index is not None,
        transpose_rhs=transpose_rhs,
        dual=lhs2 is not None,
        scaled=row_scale is not None,
    )
    return _call(
        kernel,
        tiles=tiles,
        backend=backend,
        grid=(n_dim // block_n, schedule.expert.shape[0]),
        out_shape=jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype or lhs.dtype),
        name="moe_gmm",
    )(*args)


# ----------------------------------------------------------------------------------------------
# gmm_activation: a = f(x_r @ w_gate[e]) * (x_r @ w_up[e]), or f(x_r @ w_up[e]) when not gated


def _activation_kernel(
    expert_ref, tile_ref, lo_ref, hi_ref, *refs,
    block_m, block_n, block_k, num_k, gather, gated, scaled, save_preactivations, activation,
):
    refs = list(refs)
    index_ref = refs.pop(0) if gather else None
    x_ref = refs.pop(0)
    w_refs = [refs.pop(0) for _ in range(1 + gated)]  # (w_gate, w_up) or (w_up,)
    scale_ref = refs.pop(0) if scaled else None
    a_ref, *preactivation_refs = refs
    n_tile, item = pl.program_id(0), pl.program_id(1)
    lo, hi = lo_ref[item], hi_ref[item]

    @pl.when(lo < hi)
    def _compute():
        expert = expert_ref[item]
        row_start = pl.multiple_of(tile_ref[item] * block_m, block_m)
        n_start = pl.multiple_of(n_tile * block_n, block_n)
        src_rows = index_ref[pl.ds(row_start, block_m)] if gather else None

        def body(k, accs):
            k_start = pl.multiple_of(k * block_k, block_k)
            a = _load_rows(x_ref, row_start, src_rows, k_start, block_m, block_k)
            ws = [_weight_tile(w_ref, expert, k_start, n_start, block_k, block_n, False)
                  for w_ref in w_refs]
            return tuple(acc + _dot(a, w) for acc, w in zip(accs, ws, strict=True))

        zeros = jnp.zeros((block_m, block_n), jnp.float32)
        preactivations = lax.fori_loop(0, num_k, body, (zeros,) * len(w_refs))
        gate, up = preactivations if gated else (None, *preactivations)
        mask = _item_rows_mask(lo, hi, block_m)
        tile = (pl.ds(row_start, block_m), pl.ds(n_start, block_n))
        act = activations.hidden(activation, gate, up)
        if scaled:
            act = act * scale_ref[pl.ds(row_start, block_m)][:, None]
        outputs = [(a_ref, act)]
        if save_preactivations:
            outputs += list(zip(preactivation_refs, preactivations, strict=True))
        for ref, value in outputs:
            plt.store(ref.at[tile], value.astype(ref.dtype), mask=mask)


def gmm_activation(
    x: jax.Array,
    w_gate: jax.Array | None,
    w_up: jax.Array,
    schedule: GmmSchedule,
    *,
    tiles: Tiles,
    backend: str,
    index: jax.Array | None = None,
    row_scale: jax.Array | None = None,
    save_preactivations: bool = False,
    activation: str = "swiglu",
) -> tuple[jax.Array | None, ...]:
    """Fused input projections and activation: ``a = f(x_r @ w_gate[e]) * (x_r @ w_up[e])``
    (``f(x_r @ w_up[e])`` when not gated), ``f`` the ``activation``'s nonlinearity
    (``tilax.moe.activations``).

    Args:
        x: ``[R_pad, d]`` rows, or ``[T, d]`` tokens gathered through ``index``.
        w_gate, w_up: ``[E, d, h]``; ``w_gate`` is ``None`` for the not-gated ``"gelu"``.
        schedule, tiles, backend, index: as for :func:`gmm`.
        row_scale: ``[R_pad]`` float32 factors applied to ``a`` (the combine weights: the
            scaled activation is the left operand of the ``w_down`` gradient).
        save_preactivations: also return the gate and up pre-activations (for the backward).
        activation: ``"swiglu"``, ``"geglu"`` or ``"gelu"`` (``MoEConfig.activation``).

    Returns:
        ``(a,)`` or ``(a, gate, up)``, each ``[R_pad, h]`` in ``x.dtype`` (``gate`` is
        ``None`` when not gated).
    """
    gated = activations.check_gate(activation, w_gate, "w_gate")
    num_rows = x.shape[0] if index is None else index.shape[0]
    d_dim, h_dim = w_up.shape[1], w_up.shape[2]
    block_n = fit_block(_capped_block_n(tiles, 64), h_dim)
    block_k = fit_block(tiles.block_k, d_dim)
    kernel = functools.partial(
        _activation_kernel,
        block_m=tiles.block_m,
        block_n=block_n,
        block_k=block_k,
        num_k=d_dim // block_k,
        gather=index is not None,
        gated=gated,
        scaled=row_scale is not None,
        save_preactivations=save_preactivations,
        activation=activation,
    )
    weights = [w_gate, w_up] if gated else [w_up]
    args = [*schedule] + ([index] if index is not None else []) + [x, *weights]
    args += [row_scale] if row_scale is not None else []
    out = jax.ShapeDtypeStruct((num_rows, h_dim), x.dtype)
    outs = _call(
        kernel,
        tiles=tiles,
        backend=backend,
        grid=(h_dim // block_n, schedule.expert.shape[0]),
        out_shape=[out] * (1 + save_preactivations * len(weights)),
        name=f"moe_gmm_{activation}",
    )(*args)
    if save_preactivations and not gated:
        return outs[0], None, outs[1]
    return tuple(outs)


# ----------------------------------------------------------------------------------------------
# gmm_activation_bwd: dz = dy_r @ w_down[e].T, then the activation's backward in the epilogue


def _activation_bwd_kernel(
    expert_ref, tile_ref, lo_ref, hi_ref, *refs,
    block_m, block_n, block_k, num_k, gather, gated, activation,
):
    refs = list(refs)
    index_ref = refs.pop(0) if gather else None
    dy_ref, w_ref = refs.pop(0), refs.pop(0)
    g_ref = refs.pop(0) if gated else None
    u_ref, scale_ref = refs.pop(0), refs.pop(0)
    dg_ref = refs.pop(0) if gated else None
    du_ref, dwp_ref = refs
    n_tile, item = pl.program_id(0), pl.program_id(1)
    lo, hi = lo_ref[item], hi_ref[item]

    @pl.when(lo < hi)
    def _compute():
        expert = expert_ref[item]
        row_start = pl.multiple_of(tile_ref[item] * block_m, block_m)
        n_start = pl.multiple_of(n_tile * block_n, block_n)
        src_rows = index_ref[pl.ds(row_start, block_m)] if gather else None

        def body(k, acc):
            k_start = pl.multiple_of(k * block_k, block_k)
            a = _load_rows(dy_ref, row_start, src_rows, k_start, block_m, block_k)
            b = _weight_tile(w_ref, expert, k_start, n_start, block_k, block_n, True)
            return acc + _dot(a, b, contract_b=1)

        dz = lax.fori_loop(0, num_k, body, jnp.zeros((block_m, block_n), jnp.float32))
        # Epilogue ordered so each output is stored as soon as it exists (register pressure).
        tile = (pl.ds(row_start, block_m), pl.ds(n_start, block_n))
        mask = _item_rows_mask(lo, hi, block_m)
        weight = scale_ref[pl.ds(row_start, block_m)][:, None]
        gate = g_ref[tile].astype(jnp.float32) if gated else None
        up = u_ref[tile].astype(jnp.float32)
        grad_refs = {"gate": dg_ref, "up": du_ref}
        for name, value in activations.hidden_backward(activation, gate, up, dz, weight):
            if name == "act":
                plt.store(
                    dwp_ref.at[n_tile, pl.ds(row_start, block_m)],
                    jnp.sum(dz * value, axis=1),
                    mask=mask[:, 0],
                )
            else:
                ref = grad_refs[name]
                plt.store(ref.at[tile], value.astype(ref.dtype), mask=mask)


def gmm_activation_bwd(
    dy: jax.Array,
    w_down: jax.Array,
    gate: jax.Array | None,
    up: jax.Array,
    row_scale: jax.Array,
    schedule: GmmSchedule,
    *,
    tiles: Tiles,
    backend: str,
    index: jax.Array | None = None,
    activation: str = "swiglu",
    deterministic: bool = False,
) -> tuple[jax.Array | None, jax.Array, jax.Array]:
    """Backward of ``y_r = w_r * a_r @ w_down[e]`` for every row, ``a`` the activation of
    :func:`gmm_activation` (``f(gate_r) * up_r``, or ``f(up_r)`` when not gated).

    With ``dz = dy_r @ w_down[e].T`` (float32): ``d_gate``, ``d_up`` (the activation's
    backward of ``w_r * dz``, ``activations.hidden_backward``) and the partial sums of
    ``dz . a`` per column tile (summed over tiles, the gradient of the row's combine weight).
    The ``w_down`` gradient's left operand, ``a * w_r``, is the forward's
    (``gmm_activation(row_scale=)``).

    Args:
        dy: ``[R_pad, d]`` rows, or ``[T, d]`` output gradients gathered through ``index``.
        w_down: ``[E, h, d]``.
        gate, up: ``[R_pad, h]`` pre-activations saved by the forward (``gate`` ``None``
            when not gated).
        row_scale: ``[R_pad]`` float32 combine weights ``w_r`` (0 on padding/dropped rows).
        schedule, tiles, backend, index: as for :func:`gmm`.
        activation: as for :func:`gmm_activation`.
        deterministic: accepted for the kernel contract: every partial sum here is stored
            by the one program that owns its row, so the result is deterministic anyway.

    Returns:
        ``d_gate, d_up`` (``[R_pad, h]``, ``up.dtype``; ``d_gate`` ``None`` when not gated)
        and ``dw_partial`` (``[h / block_n, R_pad]`` float32).
    """
    del deterministic
    gated = activations.check_gate(activation, gate, "gate")
    num_rows, h_dim = up.shape
    d_dim = w_down.shape[2]
    block_n = fit_block(_capped_block_n(tiles, 32), h_dim)
    block_k = fit_block(tiles.block_k, d_dim)
    n_tiles = h_dim // block_n
    kernel = functools.partial(
        _activation_bwd_kernel,
        block_m=tiles.block_m,
        block_n=block_n,
        block_k=block_k,
        num_k=d_dim // block_k,
        gather=index is not None,
        gated=gated,
        activation=activation,
    )
    pre = [gate, up] if gated else [up]
    args = [*schedule] + ([index] if index is not None else []) + [dy, w_down, *pre]
    rows = jax.ShapeDtypeStruct((num_rows, h_dim), up.dtype)
    outs = _call(
        kernel,
        tiles=tiles,
        backend=backend,
        grid=(n_tiles, schedule.expert.shape[0]),
        out_shape=[rows] * len(pre) + [jax.ShapeDtypeStruct((n_tiles, num_rows), jnp.float32)],
        name=f"moe_gmm_{activation}_bwd",
    )(*args, row_scale)
    return tuple(outs) if gated else (None, *outs)


# ----------------------------------------------------------------------------------------------
# gmm_combine: y[token(r)] += w_r * (a_r @ w_down[e]) with float32 atomics


def _combine_kernel(
    expert_ref, tile_ref, lo_ref, hi_ref, a_ref, w_ref, *refs,
    block_m, block_n, block_k, num_k, num_tokens, masked_atomics, scaled,
):
    scale_ref = refs[0] if scaled else None
    target_ref, _init_ref, y_ref = refs[scaled:]
    n_tile, item = pl.program_id(0), pl.program_id(1)
    lo, hi = lo_ref[item], hi_ref[item]

    @pl.when(lo < hi)
    def _compute():
        expert = expert_ref[item]
        row_start = pl.multiple_of(tile_ref[item] * block_m, block_m)
        n_start = pl.multiple_of(n_tile * block_n, block_n)

        def body(k, acc):
            k_start = pl.multiple_of(k * block_k, block_k)
            a = _load_rows(a_ref, row_start, None, k_start, block_m, block_k)
            b = _weight_tile(w_ref, expert, k_start, n_start, block_k, block_n, False)
            return acc + _dot(a, b)

        acc = lax.fori_loop(0, num_k, body, jnp.zeros((block_m, block_n), jnp.float32))
        if scaled:
            acc = acc * scale_ref[pl.ds(row_start, block_m)][:, None]
        target = target_ref[pl.ds(row_start, block_m)][:, None]
        keep = _item_rows_mask(lo, hi, block_m) & (target < num_tokens)
        cols = n_start + _iota((1, block_n), 1)
        if masked_atomics:
            mask = jnp.broadcast_to(keep, (block_m, block_n))
            plt.atomic_add(y_ref, (target, cols), acc, mask=mask)
        else:
            # Interpret mode has no masked atomics: rows this item does not own add into the
            # scratch row ``num_tokens`` instead (their tokens may repeat; kept rows never do).
            plt.atomic_add(y_ref, (jnp.where(keep, target, num_tokens), cols), acc)


def gmm_combine(
    hidden: jax.Array,
    w_down: jax.Array,
    row_scale: jax.Array | None,
    row_target: jax.Array,
    schedule: GmmSchedule,
    *,
    num_tokens: int,
    tiles: Tiles,
    backend: str,
) -> jax.Array:
    """Down projection with the weighted combine fused into the epilogue.

    ``y[t] = sum over rows r with row_target[r] == t of row_scale[r] * hidden[r] @ w_down[e(r)]``,
    accumulated with float32 atomic adds straight into the token outputs: no per-copy output
    buffer. Exact up to float32 rounding; with at most two copies per token (top_k <= 2) the
    result is bitwise deterministic (``0 + a + b == 0 + b + a``), with more copies the float32
    summation order may vary between runs (differences at float32 rounding level).

    Args:
        hidden: ``[R_pad, h]`` SwiGLU activations in row space.
        w_down: ``[E, h, d]``.
        row_scale: ``[R_pad]`` float32 combine weights, or ``None`` when ``hidden`` carries
            them already.
        row_target: ``[R_pad]`` int32 token of each row; ``num_tokens`` for rows to skip.
        schedule, tiles, backend: as for :func:`gmm`.
        num_tokens: ``T``.

    Returns:
        ``[T, d]`` float32.
    """
    num_rows, h_dim = hidden.shape
    d_dim = w_down.shape[2]
    block_n, block_k = fit_block(tiles.block_n, d_dim), fit_block(tiles.block_k, h_dim)
    kernel = functools.partial(
        _combine_kernel,
        block_m=tiles.block_m,
        block_n=block_n,
        block_k=block_k,
        num_k=h_dim // block_k,
        num_tokens=num_tokens,
        masked_atomics=backend == "triton",
        scaled=row_scale is not None,
    )
    init = jnp.zeros((num_tokens + 1, d_dim), jnp.float32)
    scale = [row_scale] if row_scale is not None else []
    args = [*schedule, hidden, w_down, *scale, row_target, init]
    out = _call(
        kernel,
        tiles=tiles,
        backend=backend,
        grid=(d_dim // block_n, schedule.expert.shape[0]),
        out_shape=jax.ShapeDtypeStruct(init.shape, jnp.float32),
        input_output_aliases={len(args) - 1: 0},
        name="moe_gmm_combine",
    )(*args)
    return out[:num_tokens]


# ----------------------------------------------------------------------------------------------
# tgmm: out[e] = lhs[rows of e].T @ rhs[rows of e]  (ragged contraction over rows)


def _tgmm_kernel(
    offsets_ref, *refs,
    block_m, block_n, block_k, lhs_gather, rhs_gather, dual,
):
    refs = list(refs)
    lhs_index_ref = refs.pop(0) if lhs_gather else None
    rhs_index_ref = refs.pop(0) if rhs_gather else None
    lhs_ref, rhs_ref = refs.pop(0), refs.pop(0)
    rhs2_ref = refs.pop(0) if dual else None
    out_refs = refs
    n_tile, m_tile, expert = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = offsets_ref[expert], offsets_ref[expert + 1]
    m_start = pl.multiple_of(m_tile * block_m, block_m)
    n_start = pl.multiple_of(n_tile * block_n, block_n)

    def body(chunk, accs):
        row_start = pl.multiple_of(chunk * block_k, block_k)
        rows = row_start + _iota((block_k, 1), 0)
        mask = (rows >= lo) & (rows < hi)
        lhs_rows = lhs_index_ref[pl.ds(row_start, block_k)] if lhs_gather else None
        rhs_rows = rhs_index_ref[pl.ds(row_start, block_k)] if rhs_gather else None
        a = _load_rows(lhs_ref, row_start, lhs_rows, m_start, block_k, block_m, mask)
        updated = []
        for acc, ref in zip(accs, (rhs_ref, rhs2_ref)[: len(accs)], strict=True):
            b = _load_rows(ref, row_start, rhs_rows, n_start, block_k, block_n, mask)
            updated.append(acc + _dot(a, b, contract_a=0))
        return tuple(updated)

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    accs = lax.fori_loop(
        lo // block_k, (hi + block_k - 1) // block_k, body, (zeros,) * (2 if dual else 1)
    )
    for ref, acc in zip(out_refs, accs, strict=True):
        ref[expert, pl.ds(m_start, block_m), pl.ds(n_start, block_n)] = acc.astype(ref.dtype)


def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_offsets: jax.Array,
    *,
    tiles: Tiles,
    backend: str,
    lhs_index: jax.Array | None = None,
    rhs_index: jax.Array | None = None,
    rhs2: jax.Array | None = None,
    out_dtype=None,
) -> tuple[jax.Array, ...]:
    """Per-expert ``lhs_rows.T @ rhs_rows`` over each expert's rows: weight gradients.

    ``out[e] = sum over r in [group_offsets[e], group_offsets[e+1]) of outer(lhs_r, rhs_r)``,
    with ``lhs_r = lhs[lhs_index[r]]`` when gathered (likewise ``rhs``). Rows outside every
    group (padding, dropped copies) are masked out of the loads; experts without rows get
    zeros.

    Args:
        lhs: ``[R_pad, K]`` rows, or a ``[S, K]`` source gathered through ``lhs_index``.
        rhs: ``[R_pad, N]`` rows, or a ``[S, N]`` source gathered through ``rhs_index``.
        group_offsets: ``[E + 1]`` int32 row boundaries of the experts.
        tiles, backend: as for :func:`gmm` (``block_k`` is the row step).
        lhs_index, rhs_index: ``[R_pad]`` int32 gathers.
        rhs2: a second right operand (same rows as ``rhs``) sharing the loads of ``lhs``.
        out_dtype: result dtype (default ``lhs.dtype``).

    Returns:
        ``(out,)`` or ``(out, out2)``, each ``[E, K, N]``.
    """
    num_rows = lhs.shape[0] if lhs_index is None else lhs_index.shape[0]
    k_dim, n_dim = lhs.shape[1], rhs.shape[1]
    num_experts = group_offsets.shape[0] - 1
    block_m = fit_block(tiles.block_m, k_dim)
    capped = _capped_block_n(dataclasses.replace(tiles, block_m=block_m), 64)
    block_n = fit_block(capped if rhs2 is not None else tiles.block_n, n_dim)
    block_k = tiles.block_k
    if num_rows % block_k:
        raise ValueError(f"row count {num_rows} is not a multiple of block_k {block_k}")
    kernel = functools.partial(
        _tgmm_kernel,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        lhs_gather=lhs_index is not None,
        rhs_gather=rhs_index is not None,
        dual=rhs2 is not None,
    )
    args = [group_offsets]
    args += [i for i in (lhs_index, rhs_index) if i is not None]
    args += [lhs, rhs] + ([rhs2] if rhs2 is not None else [])
    out = jax.ShapeDtypeStruct((num_experts, k_dim, n_dim), out_dtype or lhs.dtype)
    return tuple(
        _call(
            kernel,
            tiles=tiles,
            backend=backend,
            grid=(n_dim // block_n, k_dim // block_m, num_experts),
            out_shape=[out] * (2 if rhs2 is not None else 1),
            name="moe_tgmm",
        )(*args)
    )


def input_and_gate_up_grads(x_rows, d_gate, d_up, w_gate, w_up, group_offsets, *, tiles,
                            backend) -> None:
    """``None``: Triton has no kernel joining ``dx`` with the gate/up weight gradients; the
    path runs :func:`gmm` and :func:`tgmm`."""
    del x_rows, d_gate, d_up, w_gate, w_up, group_offsets, tiles, backend
