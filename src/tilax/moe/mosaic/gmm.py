"""Grouped matmul kernels for the MoE experts: Pallas, Mosaic GPU backend (Hopper, sm90+).

The second backend of the Pallas expert path (``pallas.py``): the kernel set of the
``base.GmmKernels`` contract, as ``triton`` has it, with its own tiles (:class:`Config`,
:func:`tiles_for`; tiles and building blocks live in ``mosaic/common.py``). bfloat16 and
float16 operands only: float32 raises ``ValueError`` (float32 experts run on Triton, and
``api.resolve_impl`` rejects ``impl="mosaic"`` with ``dtype=float32``). Feature dimensions are
multiples of 64 (``Config.feature_multiple``: the layer pads them).

Every kernel is persistent: ``Config.programs_per_sm`` programs per SM walk the work items,
and each item runs a TMA pipeline over the contraction (``num_stages`` swizzled SMEM buffers)
that feeds ``wgmma`` with a float32 accumulator in registers, the next steps' copies landing
while the MMAs run; with two programs per SM, one's prologue and epilogue overlap the other's
MMAs. Forward-type kernels follow the ``dispatch.GmmSchedule`` items of the Triton path: an item's
tile is staged in SMEM and only its rows ``[lo, hi)`` are stored, by one TMA store per set bit
of ``hi - lo`` (a TMA store has no row mask), so every row is written by exactly one program.
Rows a kernel reads through ``index`` are gathered in XLA first (Hopper's TMA copies tiles,
not gathered rows; Blackwell's can gather), except in a forward's :func:`gmm_activation` with
few column tiles, which gathers them with per-thread copies (``mosaic.gmm_gather``). A train step
reads sorted copies of ``x`` and ``dy`` that :func:`copy_rows` makes (``mosaic.gmm_rows``:
each token read once, not once per copy as by a gather).

Kernels (each wrapper launches one):

- :func:`copy_rows`: ``x[row_token]``, each token's row written to its copies' rows.
- :func:`gmm`: ``out[r] = scale[r] * (lhs[r] @ rhs[e(r)] (+ lhs2[r] @ rhs2[e(r)]))``, the
  weights optionally transposed (``wgmma`` reads the transposed SMEM tile); without a scale,
  for short contractions whose output columns split over two warpgroups, the
  warp-specialised kernel of ``mosaic.gmm_ws``.
- :func:`gmm_activation`: gate and up projections sharing the ``x`` tiles, the activation
  (``MoEConfig.activation``, from ``tilax.moe.activations``; optionally scaled per row by the
  combine weights) in the epilogue; the up projection alone for the not-gated ``"gelu"``.
- :func:`gmm_activation_bwd`: the down projection's input gradient with the activation's
  backward in the epilogue; the combine weights' gradient leaves as per-item row sums, added
  up in XLA.
- :func:`gmm_combine`: the down projection with scaled float32 rows (:func:`gmm`), added into
  their tokens by an XLA scatter-add.
- :func:`tgmm`: ``lhs[rows_e].T @ rhs[rows_e]`` (weight gradients); the first and last row
  chunk of each expert have the other rows zeroed in SMEM.
- :func:`input_and_gate_up_grads`: the rows' ``dx`` and the gate/up weight gradients in one
  pass over the gate and up gradients (``mosaic.gmm_dx``), where its shapes fit (the E64
  decoder's); elsewhere the path runs :func:`gmm` and :func:`tgmm`.

The other kernels are not warp-specialised: two programs per SM overlap one's loads and
epilogue with the other's MMAs (the activation kernels warp-specialised were no faster on the
H200: see docs/performance/moe.md). The plain grouped matmul over a short contraction is
(``mosaic.gmm_ws``): its epilogue (a whole output tile stored) is then most of its time, and
one memory warpgroup fetching across items hides it better (on the H200 at the E64
decoder's shapes, 0.41 against 0.60 ms). ``impl="auto"``
picks this backend where ``tilax.moe.rules`` holds a measured win.

Mosaic GPU APIs relied on, read in jax 0.10.2 (installed here) and jax-ml/jax main at
0.11.1.dev (2026-08), where they are unchanged except that 0.11 makes ``Warpgroup`` lowering
the default (set explicitly here): ``plgpu.kernel(out_type=, grid=, grid_names=,
kernel_name=, compiler_params=)``, ``plgpu.CompilerParams(lowering_semantics=, approx_math=)``,
``plgpu.nd_loop``, ``plgpu.emit_pipeline`` (static and traced grids),
``plgpu.BlockSpec(transforms=, delay_release=)``, ``plgpu.wgmma``, ``plgpu.transpose_ref``
(``ref.transpose`` from 0.11: ``tilax._pallas.transposed_ref``),
``plgpu.ACC``, ``plgpu.SMEM``, ``plgpu.Barrier``, ``plgpu.TilingTransform``,
``plgpu.SwizzleTransform``, ``plgpu.find_swizzle``, ``plgpu.copy_gmem_to_smem``,
``plgpu.barrier_wait``, ``plgpu.copy_smem_to_gmem(commit_group=)``,
``plgpu.commit_smem``, ``plgpu.commit_smem_to_gmem_group``,
``plgpu.wait_smem_to_gmem``; ``pl.run_scoped``, ``pl.loop``, ``pl.when``. jax 0.11 lowers
Mosaic GPU kernels only through ``plgpu.kernel`` (``pl.pallas_call`` with Mosaic GPU compiler
params has no lowering rule there).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.moe import activations, rules
from tilax.moe.dispatch import GmmSchedule, RowLayout, take_rows
from tilax.moe.mosaic import common, gmm_rows
from tilax.moe.mosaic import gmm_dx as joined_dx
from tilax.moe.mosaic import gmm_gather as gather
from tilax.moe.mosaic import gmm_ws as warp_specialised
from tilax.moe.mosaic.common import Config, default_config, plgpu, tiles_for

__all__ = ["Config", "default_config", "tiles_for", "copy_rows", "gmm", "gmm_activation",
           "gmm_activation_bwd", "gmm_combine", "tgmm", "input_and_gate_up_grads"]


def gathers_in_training() -> bool:
    """Whether a train step's kernels gather rows through the sort index (the ``train_rows``
    rule of ``tilax.moe.rules``): by default they read sorted copies of ``x`` and ``dy``
    (:func:`copy_rows`); only an inference forward's activation kernel gathers rows itself."""
    return rules.variant("train_rows") == "gather"


def copy_rows(x: jax.Array, layout: RowLayout) -> jax.Array:
    """``x[layout.row_token]``, ``[R_pad, d]``, for a layout in which every copy has a row: by
    the row-copy kernel (``mosaic.gmm_rows``, each token read once) where the ``copy_rows``
    rule of ``tilax.moe.rules`` takes it and its blocks fit, else by XLA's gather."""
    if rules.variant("copy_rows") == "kernel":
        block = gmm_rows.block_tokens(x.shape[0], x.shape[1], x.dtype.itemsize,
                                      layout.copy_row.shape[1],
                                      rules.limit("copy_rows", "min_block_tokens"))
        if block is not None and gmm_rows.copies_fit(x, layout):
            return gmm_rows.copy_rows(x, layout, block)
    return take_rows(x, layout.row_token)


# ----------------------------------------------------------------------------------------------
# gmm: out[r] = (lhs[r] @ rhs[e(r)] (+ lhs2[r] @ rhs2[e(r)])) (* scale[r])


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    schedule: GmmSchedule,
    *,
    tiles: Config,
    backend: str,
    index: jax.Array | None = None,
    transpose_rhs: bool = False,
    lhs2: jax.Array | None = None,
    rhs2: jax.Array | None = None,
    row_scale: jax.Array | None = None,
    out_dtype=None,
) -> jax.Array:
    """Grouped matmul over the scheduled row tiles (``triton.gmm``'s contract).

    Args:
        lhs: ``[R_pad, K]`` rows, or ``[T, K]`` tokens gathered through ``index``.
        rhs: ``[E, K, N]`` expert weights, or ``[E, N, K]`` with ``transpose_rhs``.
        schedule: the work items (built with ``tiles.block_m``).
        tiles: this module's :class:`Config`; backend: ``"mosaic"``.
        index: ``[R_pad]`` int32 rows of ``lhs`` to read.
        transpose_rhs: multiply by ``rhs[e].T`` (input gradients).
        lhs2, rhs2: a second product summed into the same accumulator (laid out as
            ``lhs``/``rhs``, never gathered).
        row_scale: ``[R_pad]`` float32 scale of each row's float32 result.
        out_dtype: result dtype (default ``lhs.dtype``).

    Returns:
        ``[R_pad, N]``; rows of no item are left unwritten.
    """
    del backend
    common.check_dtypes(lhs, rhs, lhs2, rhs2)
    lhs = common.gathered(lhs, index)
    num_rows, k_dim = lhs.shape
    n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    common.check_features(k_dim, n_dim)
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    block_m, block_n = tiles.block_m, common.fit_block(tiles.block_n, n_dim)
    pairs = [(lhs, rhs)] + ([(lhs2, rhs2)] if lhs2 is not None else [])
    ws_shapes = None  # warp-specialised where the gmm_ws rule takes it (not for scaled rows)
    if (row_scale is None and rules.variant("gmm_ws") == "short_contractions"
            and k_dim <= rules.limit("gmm_ws", "max_contraction")):
        ws_shapes = warp_specialised.layout(tiles, k_dim, n_dim, len(pairs), out_dtype)
    if ws_shapes is not None:
        return warp_specialised.gmm(pairs, schedule, tiles=tiles, shapes=ws_shapes,
                                    transpose_rhs=transpose_rhs, out_dtype=out_dtype)
    block_k, stages = common.fit_pipeline(
        tiles, common.fit_block(tiles.block_k, k_dim),
        len(pairs) * (block_m + block_n) * lhs.dtype.itemsize, live_bytes=block_m * 4,
    )
    w_block = (block_n, block_k) if transpose_rhs else (block_k, block_n)
    scaled = row_scale is not None

    def body(*refs):
        schedule_refs, operand_refs = refs[:4], refs[4 : 4 + 2 * len(pairs)]
        scale_g = refs[-2] if scaled else None
        out_g = refs[-1]

        def item_fn(item, _):
            tile = item.row_start // block_m
            w_index = (lambda k: (item.n, k)) if transpose_rhs else (lambda k: (k, item.n))
            operands = []
            for a_g, w_g in zip(operand_refs[::2], operand_refs[1::2], strict=True):
                operands += [(a_g, (block_m, block_k), lambda k: (tile, k)),
                             (w_g.at[item.expert], w_block, w_index)]

            def run(acc):
                def step(_, *smems):
                    for a, w in zip(smems[::2], smems[1::2], strict=True):
                        plgpu.wgmma(acc, a, _pallas.transposed_ref(w) if transpose_rhs else w)

                common.pipeline(step, k_dim // block_k, operands, stages)

            def compute(wait):
                (acc,) = common.accumulate(1, block_m, block_n, run)
                if scaled:
                    (scale_smem,) = wait()
                    acc = acc * common.rows_to_tile(scale_smem[...], acc.shape)

                def write(o_smem):
                    o_smem[...] = acc.astype(o_smem.dtype)

                common.stage_and_store([out_g], item, block_m, block_n, write)

            sources = [common.row_slice(scale_g, item, block_m)] if scaled else []
            common.with_fetched(sources, compute)

        common.for_each_item(schedule_refs, n_dim // block_n, block_m, item_fn)

    args = [*schedule, *[a for pair in pairs for a in pair]] + ([row_scale] if scaled else [])
    out = jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype)
    return common.launch(body, out, "moe_gmm_mosaic", tiles)(*args)


# ----------------------------------------------------------------------------------------------
# gmm_activation: a = f(x_r @ w_gate[e]) * (x_r @ w_up[e]), or f(x_r @ w_up[e]) when not gated


def gmm_activation(
    x: jax.Array,
    w_gate: jax.Array | None,
    w_up: jax.Array,
    schedule: GmmSchedule,
    *,
    tiles: Config,
    backend: str,
    index: jax.Array | None = None,
    row_scale: jax.Array | None = None,
    save_preactivations: bool = False,
    activation: str = "swiglu",
) -> tuple[jax.Array | None, ...]:
    """Gate and up projections sharing each ``x`` tile, the activation in the epilogue
    (``triton.gmm_activation``'s contract): ``(a,)`` or ``(a, gate, up)``, each ``[R_pad, h]``
    in ``x.dtype`` (``gate`` ``None`` and ``w_gate`` ``None`` for the not-gated ``"gelu"``:
    one projection), ``a`` scaled by ``row_scale`` when given (its rows arrive by TMA while
    the contraction runs). Two accumulators when gated: ``block_n`` is capped to keep them in
    registers (and as much for the not-gated one's epilogue). Rows read through ``index`` are
    gathered by the kernel itself where that pays (``mosaic.gmm_gather``), by XLA first
    elsewhere."""
    del backend
    gated = activations.check_gate(activation, w_gate, "w_gate")
    weights_in = [w_gate, w_up] if gated else [w_up]
    common.check_dtypes(x, *weights_in)
    d_dim, h_dim = x.shape[1], w_up.shape[2]
    common.check_features(d_dim, h_dim)
    block_m = tiles.block_m
    # A train step's forward (``save_preactivations``) reads a sorted copy: its backward reads
    # the same rows for the weight gradients (the Pallas path makes the copy once, with
    # ``copy_rows``; gathering in the kernel as well made the E64 decoder's train step 11.82 ms
    # against 11.26 on the H200, and gathering while writing the copy for the backward took
    # 8.0-8.3 ms against 7.8-8.0: docs/performance/moe.md).
    gathering = (index is not None and not save_preactivations
                 and rules.variant("gather_rows") == "few_column_tiles"
                 and gather.gathering_tiles(tiles, d_dim, h_dim, x.dtype,
                                            rules.limit("gather_rows", "max_column_tiles")))
    if gathering:
        rows_m, block_n, block_k, row_stages, stages = gathering
    else:
        # Two live tiles whether gated or not: the not-gated gelu's one accumulator leaves its
        # epilogue (gelu's cubic and sigmoid) the registers of the gated kernel's second one.
        rows_m, block_n = block_m, common.capped_block_n(tiles, h_dim, 2)
        block_k, stages = common.fit_pipeline(
            tiles, common.fit_block(tiles.block_k, d_dim),
            (block_m + len(weights_in) * block_n) * x.dtype.itemsize)
    # JAX's GPU interpreter cannot run the copies: there the sub-tiles read XLA's copy.
    copies_rows = bool(gathering) and not _pallas.interpreted()
    num_rows = index.shape[0] if index is not None else x.shape[0]
    if not copies_rows:
        x, index = common.gathered(x, index), None

    scaled = row_scale is not None
    num_w = len(weights_in)
    inputs = [x, *weights_in] + ([index] if copies_rows else []) + ([row_scale] if scaled else [])

    def body(*refs):
        schedule_refs, x_g, w_gs = refs[:4], refs[4], refs[5 : 5 + num_w]
        index_g = refs[5 + num_w] if copies_rows else None
        scale_g = refs[5 + num_w + copies_rows] if scaled else None
        outs = refs[4 + len(inputs):]

        def tile_fn(item):
            """The item's ``[rows_m, block_n]`` tile of each output."""
            weights = [(w_g.at[item.expert], (block_k, block_n), lambda k: (k, item.n))
                       for w_g in w_gs]

            def run(*accs):
                def step(_, x_smem, *w_smems):
                    for acc, w_smem in zip(accs, w_smems, strict=True):
                        plgpu.wgmma(acc, x_smem, w_smem)

                if copies_rows:
                    rows = (x_g, gather.index_rows(index_g, item.row_start, rows_m))
                    gather.pipeline(step, d_dim // block_k, rows, weights, row_stages, stages,
                                    num_w)
                else:
                    tile = item.row_start // rows_m
                    x_tiles = (x_g, (rows_m, block_k), lambda k: (tile, k))
                    common.pipeline(step, d_dim // block_k, [x_tiles, *weights], stages)

            def compute(wait):
                preactivations = common.accumulate(num_w, rows_m, block_n, run)
                (scale_smem,) = wait() if scaled else (None,)

                def write(a_smem, *preactivation_smems):
                    for rows, *pre_h in common.row_blocks(*preactivations):
                        gate_h, up_h = pre_h if gated else (None, *pre_h)
                        act = activations.hidden(activation, gate_h, up_h, common.sigmoid)
                        if scaled:
                            act = act * common.rows_to_tile(scale_smem[rows], act.shape)
                        a_smem.at[rows][...] = act.astype(a_smem.dtype)
                        for smem, value in zip(preactivation_smems,
                                               pre_h[: len(outs) - 1], strict=True):
                            smem.at[rows][...] = value.astype(smem.dtype)

                common.stage_and_store(outs, item, rows_m, block_n, write)

            sources = [common.row_slice(scale_g, item, rows_m)] if scaled else []
            common.with_fetched(sources, compute)

        def item_fn(item, _):
            if rows_m == block_m:
                tile_fn(item)
                return
            for start in range(0, block_m, rows_m):  # the item's rows, a sub-tile at a time
                lo = jnp.maximum(item.lo - start, 0)
                hi = jnp.minimum(item.hi - start, rows_m)
                sub_item = common.Item(item.expert, item.row_start + start, lo, hi, item.n)
                pl.when(lo < hi)(functools.partial(tile_fn, sub_item))

        common.for_each_item(schedule_refs, h_dim // block_n, block_m, item_fn)

    out = jax.ShapeDtypeStruct((num_rows, h_dim), x.dtype)
    outs = [out] * (1 + save_preactivations * num_w)
    kernel = common.launch(body, outs, f"moe_gmm_{activation}_mosaic", tiles)
    results = tuple(kernel(*schedule, *inputs))
    if save_preactivations and not gated:
        return results[0], None, results[1]
    return results


# ----------------------------------------------------------------------------------------------
# gmm_activation_bwd: dz = dy_r @ w_down[e].T, then the activation's backward in the epilogue


def gmm_activation_bwd(
    dy: jax.Array,
    w_down: jax.Array,
    gate: jax.Array | None,
    up: jax.Array,
    row_scale: jax.Array,
    schedule: GmmSchedule,
    *,
    tiles: Config,
    backend: str,
    index: jax.Array | None = None,
    activation: str = "swiglu",
    deterministic: bool = False,
) -> tuple[jax.Array | None, jax.Array, jax.Array]:
    """Backward of ``y_r = w_r * a_r @ w_down[e]``, ``a`` the activation of
    :func:`gmm_activation` (``triton.gmm_activation_bwd``'s contract; ``gate`` ``None`` and
    ``d_gate`` ``None`` when not gated).

    The gate and up tiles and the row weights arrive by TMA while the contraction runs. The
    combine weights' gradient (``dz . a`` per row) is stored per work item and column tile,
    ``[n_tiles, items, block_m]`` (a whole-vector TMA store cannot keep only the item's rows),
    and added up per row in XLA: by a scatter-add of every item's rows (the items that do
    not own a row add zeros to it), or with ``deterministic`` by a gather of each row from
    the item that owns it (:func:`_owned_rows`).

    Returns:
        ``d_gate, d_up`` (``[R_pad, h]``, ``gate.dtype``) and the combine weights' gradient
        as ``[1, R_pad]`` float32 partial sums.
    """
    del backend
    gated = activations.check_gate(activation, gate, "gate")
    pre = [gate, up] if gated else [up]
    common.check_dtypes(dy, w_down, *pre)
    dy = common.gathered(dy, index)
    num_rows, h_dim = up.shape
    d_dim = w_down.shape[2]
    common.check_features(d_dim, h_dim)
    # dz, gate and up are live through the epilogue: budgeted as two tiles, since the
    # epilogue's values die as it goes and ptxas reuses their registers.
    block_m, block_n = tiles.block_m, common.capped_block_n(tiles, h_dim, 2)
    n_tiles, num_items = h_dim // block_n, schedule.expert.shape[0]
    block_k, stages = common.fit_pipeline(
        tiles, common.fit_block(tiles.block_k, d_dim), (block_m + block_n) * dy.dtype.itemsize,
        live_bytes=len(pre) * block_m * block_n * up.dtype.itemsize + block_m * 4,
    )
    tile_smem = plgpu.SMEM((block_m, block_n), up.dtype,
                           transforms=common.mma_transforms(block_n, up.dtype))
    num_pre = len(pre)

    def body(*refs):
        schedule_refs, (dy_g, w_g), pre_gs = refs[:4], refs[4:6], refs[6 : 6 + num_pre]
        scale_g, outs = refs[6 + num_pre], refs[7 + num_pre:]
        *grad_gs, dw_items_g = outs  # (d_gate, d_up) or (d_up,)

        def item_fn(item, item_index):
            tile = item.row_start // block_m
            tile_view = (pl.ds(item.row_start, block_m), pl.ds(item.n * block_n, block_n))
            operands = [
                (dy_g, (block_m, block_k), lambda k: (tile, k)),
                (w_g.at[item.expert], (block_n, block_k), lambda k: (item.n, k)),
            ]

            def run(acc):
                def step(_, dy_smem, w_smem):
                    plgpu.wgmma(acc, dy_smem, _pallas.transposed_ref(w_smem))

                common.pipeline(step, d_dim // block_k, operands, stages)

            def compute(wait):
                (dz,) = common.accumulate(1, block_m, block_n, run)
                *pre_smems, scale_smem = wait()

                # Each output is written as soon as it exists: fewer float32 tiles live.
                def write(*grad_smems):
                    row_sums = []
                    targets = dict(zip(("gate", "up") if gated else ("up",), grad_smems,
                                       strict=True))
                    for rows, dz_h in common.row_blocks(dz):
                        weight = common.rows_to_tile(scale_smem[rows], dz_h.shape)
                        pre_t = [smem.at[rows][...].astype(jnp.float32) for smem in pre_smems]
                        gate_t, up_t = pre_t if gated else (None, *pre_t)
                        for name, value in activations.hidden_backward(
                                activation, gate_t, up_t, dz_h, weight, common.sigmoid):
                            if name == "act":
                                row_sums.append((rows, jnp.sum(dz_h * value, axis=1)))
                            else:
                                smem = targets[name]
                                smem.at[rows][...] = value.astype(smem.dtype)
                    common.store_vector(row_sums, block_m, dw_items_g.at[item.n, item_index])

                common.stage_and_store(grad_gs, item, block_m, block_n, write)

            sources = [(pre_g.at[tile_view], tile_smem) for pre_g in pre_gs]
            sources.append(common.row_slice(scale_g, item, block_m))
            common.with_fetched(sources, compute)

        common.for_each_item(schedule_refs, n_tiles, block_m, item_fn)

    rows = jax.ShapeDtypeStruct((num_rows, h_dim), up.dtype)
    per_item = jax.ShapeDtypeStruct((n_tiles, num_items, block_m), jnp.float32)
    *grads, dw_items = common.launch(
        body, [rows] * num_pre + [per_item], f"moe_gmm_{activation}_bwd_mosaic", tiles
    )(*schedule, dy, w_down, *pre, row_scale)
    d_gate, d_up = grads if gated else (None, *grads)
    return d_gate, d_up, _owned_rows(dw_items.sum(0), schedule, num_rows, deterministic)[None]


def _owned_rows(values: jax.Array, schedule: GmmSchedule, num_rows: int,
                deterministic: bool = False) -> jax.Array:
    """``[items, block_m]`` per-item row values to ``[num_rows]``: each row from the item that
    owns it (the rest, never written for items without rows, is masked out).

    By default a scatter-add of every item's rows; with ``deterministic`` a gather: the items'
    rows ``[tile * block_m + lo, tile * block_m + hi)`` are disjoint and ascending, so a row's
    owner is the last item starting at or before it (a binary search), if the row lies
    before that item's end. (No scatter-add: XLA's GPU backend runs it with atomics, and
    the repeated rows of items sharing a tile would leave their order open.)"""
    block_m = values.shape[1]
    local = jnp.arange(block_m, dtype=jnp.int32)
    if deterministic:
        used = schedule.lo < schedule.hi
        starts = jnp.where(used, schedule.tile * block_m + schedule.lo, num_rows)
        ends = schedule.tile * block_m + schedule.hi
        rows = jnp.arange(num_rows, dtype=jnp.int32)
        # unrolled: a dozen steps of elementwise gathers XLA can fuse, not a while loop
        owner = jnp.searchsorted(starts, rows, side="right", method="scan_unrolled")
        owner = jnp.maximum(owner - 1, 0)
        owned = (rows >= starts[owner]) & (rows < ends[owner])
        value = values[owner, jnp.clip(rows - schedule.tile[owner] * block_m, 0, block_m - 1)]
        return jnp.where(owned, value, 0.0)
    owned = (local >= schedule.lo[:, None]) & (local < schedule.hi[:, None])
    rows = schedule.tile[:, None] * block_m + local
    return jnp.zeros((num_rows,), jnp.float32).at[rows].add(jnp.where(owned, values, 0.0))


# ----------------------------------------------------------------------------------------------
# gmm_combine: y[token(r)] += w_r * (a_r @ w_down[e])


def gmm_combine(
    hidden: jax.Array,
    w_down: jax.Array,
    row_scale: jax.Array | None,
    row_target: jax.Array,
    schedule: GmmSchedule,
    *,
    num_tokens: int,
    tiles: Config,
    backend: str,
) -> jax.Array:
    """Down projection and weighted combine (``triton.gmm_combine``'s contract):
    ``[T, d]`` float32.

    The scaled rows come from :func:`gmm` (float32) and are added into their tokens by an XLA
    scatter-add (a target of ``num_tokens`` is dropped). Not in the kernel's epilogue: TMA
    reduce-adds of each row into its token (into a zeroed ``jax.new_ref`` operand that
    ``pl.kernel`` writes) made the E64 decoder's train step slower on the H200, one copy per
    row being the epilogue's pace (docs/performance/moe.md, "Token order and L2"); with
    whole 1 KiB rows the kernel still took 1.0 ms where it and XLA's sum take 0.7
    ("The row round trips as whole-row reduce-adds").
    """
    rows = gmm(hidden, w_down, schedule, tiles=tiles, backend=backend, row_scale=row_scale,
               out_dtype=jnp.float32)
    y = jnp.zeros((num_tokens + 1, rows.shape[1]), jnp.float32)
    return y.at[row_target].add(rows, mode="drop")[:num_tokens]


# ----------------------------------------------------------------------------------------------
# tgmm: out[e] = lhs[rows of e].T @ rhs[rows of e]  (ragged contraction over rows)

# Smallest row step: the first and last chunks are masked in registers, in the wgmma layout,
# whose tiles have 64 rows.
TGMM_MIN_ROWS = 64


def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_offsets: jax.Array,
    *,
    tiles: Config,
    backend: str,
    lhs_index: jax.Array | None = None,
    rhs_index: jax.Array | None = None,
    rhs2: jax.Array | None = None,
    out_dtype=None,
) -> tuple[jax.Array, ...]:
    """Per-expert ``lhs_rows.T @ rhs_rows`` (``triton.tgmm``'s contract).

    One work item per (expert, output tile): its pipeline runs over the row chunks holding the
    expert's rows; in the first and last chunk the rows of other experts, or of none (padding,
    which may hold anything), are zeroed in SMEM before the MMA.

    Returns:
        ``(out,)`` or ``(out, out2)``, each ``[E, K, N]`` in ``out_dtype`` (default
        ``lhs.dtype``); experts without rows get zeros.
    """
    del backend
    common.check_dtypes(lhs, rhs, rhs2)
    lhs, rhs, rhs2 = (common.gathered(lhs, lhs_index), common.gathered(rhs, rhs_index),
                      common.gathered(rhs2, rhs_index))
    num_rows, k_dim = lhs.shape
    n_dim = rhs.shape[1]
    common.check_features(k_dim, n_dim)
    num_experts = group_offsets.shape[0] - 1
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    rights = [rhs] + ([rhs2] if rhs2 is not None else [])
    block_m = common.fit_block(tiles.block_m, k_dim)
    block_n = common.capped_block_n(dataclasses.replace(tiles, block_m=block_m), n_dim, len(rights))
    block_k, stages = common.fit_pipeline(
        tiles, max(tiles.block_k, TGMM_MIN_ROWS),
        (block_m + len(rights) * block_n) * lhs.dtype.itemsize, min_block_k=TGMM_MIN_ROWS,
    )
    if num_rows % block_k:
        raise ValueError(f"row count {num_rows} is not a multiple of the row step {block_k}")

    def body(offsets_g, a_g, *refs):
        b_gs, outs = refs[: len(rights)], refs[len(rights) :]

        @plgpu.nd_loop((num_experts, k_dim // block_m, n_dim // block_n), collective_axes="sm")
        def _loop(info):
            expert, m, n = info.index
            lo, hi = offsets_g[expert], offsets_g[expert + 1]
            first = lo // block_k
            steps = pl.cdiv(hi, block_k) - first
            operands = [(a_g, (block_k, block_m), lambda k: (first + k, m))]
            operands += [(b_g, (block_k, block_n), lambda k: (first + k, n)) for b_g in b_gs]

            def run(*accs):
                def step(indices, a_smem, *b_smems):
                    (k,) = indices

                    @pl.when((k == 0) | (k == steps - 1))
                    def _mask():
                        for smem in (a_smem, *b_smems):
                            rows = (first + k) * block_k + lax.broadcasted_iota(
                                jnp.int32, smem.shape, 0)
                            keep = (rows >= lo) & (rows < hi)
                            # where, not a product: rows of no expert may hold NaN.
                            smem[...] = jnp.where(keep, smem[...], jnp.zeros((), smem.dtype))
                        plgpu.commit_smem()

                    for acc, b_smem in zip(accs, b_smems, strict=True):
                        plgpu.wgmma(acc, _pallas.transposed_ref(a_smem), b_smem)

                pl.when(hi > lo)(lambda: common.pipeline(step, steps, operands, stages))

            values = common.accumulate(len(rights), block_m, block_n, run)
            out_tile = (expert, pl.ds(m * block_m, block_m), pl.ds(n * block_n, block_n))

            def store(*smems):
                for smem, value in zip(smems, values, strict=True):
                    smem[...] = value.astype(smem.dtype)
                plgpu.commit_smem()
                for smem, out_g in zip(smems, outs, strict=True):
                    plgpu.copy_smem_to_gmem(smem, out_g.at[out_tile], commit_group=False)
                plgpu.commit_smem_to_gmem_group()
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            out_smem = plgpu.SMEM((block_m, block_n), out_dtype,
                                  transforms=common.mma_transforms(block_n, out_dtype))
            pl.run_scoped(store, *[out_smem] * len(rights))

    out = jax.ShapeDtypeStruct((num_experts, k_dim, n_dim), out_dtype)
    kernel = common.launch(body, [out] * len(rights), "moe_tgmm_mosaic", tiles)
    return tuple(kernel(group_offsets, lhs, *rights))


# ----------------------------------------------------------------------------------------------
# input_and_gate_up_grads: dx rows and dw_gate, dw_up in one pass (mosaic.gmm_dx)


def input_and_gate_up_grads(
    x_rows: jax.Array,
    d_gate: jax.Array,
    d_up: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    group_offsets: jax.Array,
    *,
    tiles: Config,
    backend: str,
) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """``(dx_rows, dw_gate, dw_up)`` by one kernel (``mosaic.gmm_dx``), or ``None`` where it
    does not apply (the path then runs :func:`gmm` and :func:`tgmm`): the ``joined_dx`` rule
    of ``tilax.moe.rules`` off (its pick: not yet measured on a GPU), ``d_model`` not a
    multiple of 128, ``d_hidden`` not 64 or 128, too many (expert, 128 features) items per
    SM, or operands of different dtypes. ``x_rows`` is the sorted copy of ``x``; every row
    of ``d_gate`` and ``d_up`` must hold finite values (the schedule covers the padding
    rows), as other experts' rows meet zeros of ``x`` there.

    Returns:
        ``[R_pad, d]`` rows of ``dx`` (rows of no expert unwritten) and ``[E, d, h]`` gate
        and up gradients, in the operands' dtype.
    """
    del tiles, backend
    option = rules.variant("joined_dx")
    if option == "off":
        return None
    common.check_dtypes(x_rows, d_gate, d_up, w_gate, w_up)
    dtypes = {jnp.dtype(a.dtype) for a in (x_rows, d_gate, d_up, w_gate, w_up)}
    num_experts, d_dim, h_dim = w_gate.shape
    stages = joined_dx.layout(d_dim, h_dim, num_experts, x_rows.dtype)
    if len(dtypes) > 1 or stages is None:
        return None
    return joined_dx.input_and_gate_up_grads(x_rows, d_gate, d_up, w_gate, w_up,
                                             group_offsets, stages=stages,
                                             overlap=option == "overlap")
