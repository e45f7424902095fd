"""Warp-specialised grouped matmuls over short contractions: Mosaic GPU, Hopper.

One program per SM with three warpgroups. A memory warpgroup streams the tiles of every
(item, contraction step) of the program's items through one ring of ``stages`` SMEM slots,
one flat pipeline, so that the next item's tiles land while this item's last MMA and
epilogue run. Two compute warpgroups share each item's row tile and own half of its
``2 * block_n`` columns each; an epilogue stages its tiles in SMEM and TMA-stores the item's
rows, waiting for the previous item's stores only before it writes the staging tiles again.

Kernels: :func:`gmm` (``gmm_mosaic.gmm`` without a row scale) and :func:`gmm_swiglu_bwd`
(``gmm_mosaic.gmm_swiglu_bwd``: its gate and up tiles and row weights, which only the
epilogue reads, are fetched by each compute warpgroup at the item's first step).

Why (H200, E64 decoder shapes at 131 072 tokens, 1M rows, diagnostic runs): the per-item
pipelines of ``gmm_mosaic.gmm`` (two programs per SM) took 0.60 ms for the down projection
``[1M, 128] x [128, 512]``, where cuBLAS moves the same bytes as one dense product in 0.36-0.39
ms; ``ncu``: 49% of the DRAM's throughput, each program's warps waiting on their own loads and
stores. This kernel takes 0.41-0.42 ms (0.60 with two stages, which leave the memory
warpgroup nothing to fetch during an epilogue). Only short contractions take it
(``MAX_CONTRACTION``): with long ones the MMAs, not the epilogues, are the time.

One pipeline spans many items, so each compute warpgroup's accumulator lives through all of
them (the pipeline's carry) and is zeroed at an item's first step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.moe import gmm_mosaic_parts as parts
from tilax.moe.dispatch import GmmSchedule
from tilax.moe.gmm_mosaic_parts import Config, plgpu

COMPUTE_WARPGROUPS = 2
# Registers the memory warpgroup keeps (it only computes tile indices); the rest go to the
# compute warpgroups, whose float32 accumulators take block_m * block_n / 128 each.
MEMORY_REGISTERS = 40
# Ring slots: three let the memory warpgroup fetch two steps ahead while an epilogue runs.
MIN_STAGES, MAX_STAGES = 3, 4
# Longest contraction (per operand pair) the plain grouped matmul takes. In a train step on
# the H200 (131 072 tokens, bf16, three interleaved rounds in one process, same outputs bit
# for bit) it took the E64 decoder (contractions of 128) from 9.37-9.50 to 9.09-9.16 ms, but
# the E8 layer (contractions of 1024, where the per-item kernel's MMAs already run at
# 650-670 TFLOP/s) from 6.44-6.67 to 6.58-6.82 ms.
MAX_CONTRACTION = 256


class Layout(NamedTuple):
    """Tiles of a warp-specialised kernel: ``block_n`` columns per compute warpgroup."""

    block_k: int
    block_n: int
    stages: int


def _fit(tiles: Config, k_dim: int, block_n: int, row_bytes: int, fixed_bytes: int):
    """:class:`Layout` whose ring (``row_bytes`` per contraction step, ``block_k`` halved
    down to 32) has ``MIN_STAGES`` slots next to ``fixed_bytes`` of SMEM, or ``None``."""
    budget = parts.SMEM_PER_BLOCK - parts.SMEM_SLACK - fixed_bytes
    block_k = parts.fit_block(tiles.block_k, k_dim)
    while block_k >= 32:
        stages = budget // (row_bytes * block_k)
        if stages >= MIN_STAGES:
            return Layout(block_k, block_n, min(MAX_STAGES, stages))
        block_k //= 2
    return None


def layout(tiles: Config, k_dim: int, n_dim: int, pairs: int, out_dtype) -> Layout | None:
    """:class:`Layout` of :func:`gmm` for these shapes, or ``None`` where it does not apply:
    a contraction longer than ``MAX_CONTRACTION``, ``n_dim`` not a multiple of the two
    warpgroups' columns, or no ``MIN_STAGES`` ring slots next to the staging tiles."""
    block_m, block_n = tiles.block_m, tiles.block_n
    if k_dim > MAX_CONTRACTION or n_dim % (COMPUTE_WARPGROUPS * block_n):
        return None
    staging = COMPUTE_WARPGROUPS * block_m * block_n * jnp.dtype(out_dtype).itemsize
    return _fit(tiles, k_dim, block_n, pairs * (block_m + COMPUTE_WARPGROUPS * block_n) * 2,
                staging)


def swiglu_layout(tiles: Config, d_dim: int, h_dim: int, dtype, outputs: int,
                  scaled: bool) -> Layout | None:
    """:class:`Layout` of :func:`gmm_swiglu` with ``outputs`` staged tiles per warpgroup
    (and a row vector if ``scaled``), or ``None`` as :func:`swiglu_bwd_layout`."""
    block_m = tiles.block_m
    block_n = parts.capped_block_n(tiles, h_dim, 2)  # the gate and up accumulators
    if h_dim % (COMPUTE_WARPGROUPS * block_n):
        return None
    per_warpgroup = outputs * block_m * block_n * jnp.dtype(dtype).itemsize + scaled * block_m * 4
    return _fit(tiles, d_dim, block_n, (block_m + 2 * COMPUTE_WARPGROUPS * block_n) * 2,
                COMPUTE_WARPGROUPS * per_warpgroup)


def swiglu_bwd_layout(tiles: Config, d_dim: int, h_dim: int, dtype) -> Layout | None:
    """:class:`Layout` of :func:`gmm_swiglu_bwd`, or ``None`` where ``h_dim`` is not a
    multiple of the two warpgroups' columns or no ``MIN_STAGES`` ring slots fit next to each
    warpgroup's gate, up, two output tiles and row vectors."""
    block_m = tiles.block_m
    # dz, gate and up live through the epilogue, as in gmm_mosaic.gmm_swiglu_bwd.
    block_n = parts.capped_block_n(tiles, h_dim, 2)
    if h_dim % (COMPUTE_WARPGROUPS * block_n):
        return None
    per_warpgroup = 4 * block_m * block_n * jnp.dtype(dtype).itemsize + 2 * block_m * 4
    return _fit(tiles, d_dim, block_n, (block_m + COMPUTE_WARPGROUPS * block_n) * 2,
                COMPUTE_WARPGROUPS * per_warpgroup)


def num_programs() -> int:
    """One program per SM."""
    return _pallas.gpu_core_count() or parts.DEFAULT_SMS


class Tile(NamedTuple):
    """What an item's hooks know: the item (``n``: the warpgroup's first output column), its
    schedule index, the warpgroup and its column tile's index among all of them."""

    item: parts.Item
    index: jax.Array
    wg: jax.Array
    column_tile: jax.Array


def _kernel(schedule: GmmSchedule, *, lhs, rhs, products, extra, tiles: Config,
            shapes: Layout, n_dim: int, transpose_rhs: bool, out_type, scratch, start, finish,
            name: str):
    """Launch a warp-specialised kernel over the schedule's items.

    ``lhs``: ``[R_pad, K]`` row arrays; ``rhs``: ``[E, K, N]`` (or ``[E, N, K]``) weights;
    ``products[a]``: the ``(lhs, rhs)`` index pairs summed into accumulator ``a``; ``extra``:
    more inputs, for the hooks. Per compute warpgroup and item, ``start(tile, scratch,
    extra_refs)`` runs at its first step and ``finish(tile, acc_refs, scratch, extra_refs,
    outs)`` at its last; ``scratch`` are SMEM types allocated once for the whole kernel.
    """
    block_k, block_n, stages = shapes
    block_m = tiles.block_m
    k_dim = lhs[0].shape[1]
    item_n = COMPUTE_WARPGROUPS * block_n
    k_steps, n_tiles = k_dim // block_k, n_dim // item_n
    total = schedule.expert.shape[0] * n_tiles
    programs = num_programs()
    w_shape = (item_n, block_k) if transpose_rhs else (block_k, item_n)
    swizzle = plgpu.find_swizzle(block_k * lhs[0].dtype.itemsize * 8)
    operands = [*lhs, *rhs]

    def body(expert_g, tile_g, lo_g, hi_g, *refs):
        operand_refs = refs[: len(operands)]
        extra_refs = refs[len(operands) : len(operands) + len(extra)]
        outs = refs[len(operands) + len(extra) :]
        program = lax.axis_index("sm")
        my_items = (total - program + programs - 1) // programs

        def coords(step):
            """(schedule index, column tile, contraction step) of a pipeline step."""
            flat = program + (step // k_steps) * programs
            return flat // n_tiles, flat % n_tiles, step % k_steps

        def lhs_block(step):
            index, _, k = coords(step)
            return tile_g[index], k

        def rhs_block(step):
            index, n, k = coords(step)
            return (expert_g[index], n, k) if transpose_rhs else (expert_g[index], k, n)

        specs = [plgpu.BlockSpec((block_m, block_k), lhs_block,
                                 transforms=parts.mma_transforms(block_k, a.dtype, swizzle))
                 for a in lhs]
        specs += [plgpu.BlockSpec((None, *w_shape), rhs_block,
                                  transforms=parts.mma_transforms(w_shape[1], w.dtype, swizzle))
                  for w in rhs]

        def pipeline(step_fn, context):
            return plgpu.emit_pipeline_warp_specialized(
                step_fn, grid=(my_items * k_steps,), memory_registers=MEMORY_REGISTERS,
                in_specs=specs, max_concurrent_steps=stages, wg_axis="wg",
                num_compute_wgs=COMPUTE_WARPGROUPS, compute_context=context,
            )

        def scope(allocations, *scratch_refs):
            wg = lax.axis_index("wg")
            columns = pl.ds(wg * block_n, block_n)

            def tile_of(step):
                index, n, _ = coords(step)
                item = parts.Item(expert_g[index], tile_g[index] * block_m, lo_g[index],
                                  hi_g[index], n * item_n + wg * block_n)
                return Tile(item, index, wg, n * COMPUTE_WARPGROUPS + wg)

            def step_fn(indices, *smems_and_accs):
                *smems, acc_refs = smems_and_accs
                lhs_smems, rhs_smems = smems[: len(lhs)], smems[len(lhs) :]
                (step,) = indices
                k = step % k_steps

                @pl.when(k == 0)
                def _start():
                    for acc_ref in acc_refs:
                        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
                    start(tile_of(step), scratch_refs, extra_refs)

                for acc_ref, pairs in zip(acc_refs, products, strict=True):
                    for a, w in pairs:
                        w_smem = rhs_smems[w]
                        w_view = (_pallas.transposed_ref(w_smem.at[columns]) if transpose_rhs
                                  else w_smem.at[:, columns])
                        plgpu.wgmma(acc_ref, lhs_smems[a], w_view)
                # The ring slot is released when this returns: the MMAs must have read it.
                plgpu.wgmma_wait(0)

                @pl.when(k == k_steps - 1)
                def _finish():
                    finish(tile_of(step), acc_refs, scratch_refs, extra_refs, outs)

                return acc_refs

            def context(run):
                pl.run_scoped(lambda *accs: run(accs),
                              *[plgpu.ACC((block_m, block_n))] * len(products))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pipeline(step_fn, context)(*operand_refs, allocations=allocations)

        def ignore(*_, **__):
            return None

        pl.run_scoped(
            scope, pipeline(ignore, ignore).get_allocations(*operand_refs), *scratch,
            collective_axes="wg",
        )

    kernel = plgpu.kernel(
        body, out_type=out_type, grid=(programs,), grid_names=("sm",),
        num_threads=COMPUTE_WARPGROUPS + 1, thread_name="wg", kernel_name=name,
        compiler_params=parts.compiler_params(),
    )
    return kernel(*schedule, *operands, *extra)


def _staging(block_m: int, block_n: int, dtype):
    """One staged output tile per compute warpgroup."""
    return plgpu.SMEM((COMPUTE_WARPGROUPS, block_m, block_n), dtype,
                      transforms=parts.row_transforms(block_n, dtype))


def gmm(
    pairs: list[tuple[jax.Array, jax.Array]],
    schedule: GmmSchedule,
    *,
    tiles: Config,
    shapes: Layout,
    transpose_rhs: bool,
    out_dtype,
) -> jax.Array:
    """``out[r] = sum over pairs of lhs[r] @ rhs[e(r)]`` (``rhs[e(r)].T`` with
    ``transpose_rhs``): ``pairs`` of ``[R_pad, K]`` rows and ``[E, K, N]`` (or ``[E, N, K]``)
    weights, ``shapes = layout(...)``; rows of no item are left unwritten."""
    num_rows = pairs[0][0].shape[0]
    n_dim = pairs[0][1].shape[1 if transpose_rhs else 2]

    def finish(tile, acc_refs, scratch, inputs, outs):
        del inputs
        (acc_ref,), (staging,), (out_g,) = acc_refs, scratch, outs
        o_smem = staging.at[tile.wg]
        # The previous item's stores must have read the staging tile.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        o_smem[...] = acc_ref[...].astype(o_smem.dtype)
        plgpu.commit_smem()
        parts.store_rows(o_smem, out_g, tile.item, tile.item.n)
        plgpu.commit_smem_to_gmem_group()

    return _kernel(
        schedule, lhs=[a for a, _ in pairs], rhs=[w for _, w in pairs],
        products=[[(i, i) for i in range(len(pairs))]], extra=[], tiles=tiles, shapes=shapes,
        n_dim=n_dim, transpose_rhs=transpose_rhs,
        out_type=jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype),
        scratch=[_staging(tiles.block_m, shapes.block_n, out_dtype)],
        start=lambda *_: None, finish=finish, name="moe_gmm_ws_mosaic",
    )


def gmm_swiglu_bwd(dy, w_down, gate, up, row_scale, schedule: GmmSchedule, *, tiles: Config,
                   shapes: Layout, swiglu_grads):
    """``gmm_mosaic.gmm_swiglu_bwd`` warp-specialised: ``dz = dy_r @ w_down[e].T`` and the
    SwiGLU backward (``swiglu_grads(dz, gate, up, weight) -> (d_gate, d_up, dz . act)`` on
    float32 row blocks) in the epilogue. Returns ``d_gate, d_up`` and the per-row products'
    sums per (column tile, item): ``[h / block_n, items, block_m]`` float32."""
    block_m, block_n = tiles.block_m, shapes.block_n
    num_rows, h_dim = gate.shape
    num_items = schedule.expert.shape[0]
    dtype = gate.dtype
    tile_smem = plgpu.SMEM((COMPUTE_WARPGROUPS, block_m, block_n), dtype,
                           transforms=parts.mma_transforms(block_n, dtype))
    vectors = plgpu.SMEM((COMPUTE_WARPGROUPS, block_m), jnp.float32)

    def tile_view(ref, tile):
        return ref.at[pl.ds(tile.item.row_start, block_m), pl.ds(tile.item.n, block_n)]

    def start(tile, scratch, inputs):
        # The epilogue's inputs land while the contraction runs; the previous item's
        # epilogue has read these buffers (its loads are done when its stores are issued).
        gate_in, up_in, scale_in = inputs
        gate_smem, up_smem, scale_smem, barrier = (ref.at[tile.wg] for ref in scratch[:4])
        plgpu.copy_gmem_to_smem(tile_view(gate_in, tile), gate_smem, barrier)
        plgpu.copy_gmem_to_smem(tile_view(up_in, tile), up_smem, barrier)
        plgpu.copy_gmem_to_smem(scale_in.at[pl.ds(tile.item.row_start, block_m)], scale_smem,
                                barrier)

    def finish(tile, acc_refs, scratch, inputs, outs):
        del inputs
        (acc_ref,) = acc_refs
        gate_smem, up_smem, scale_smem, barrier, dg_smem, du_smem, sums_smem = (
            ref.at[tile.wg] for ref in scratch)
        dg_g, du_g, sums_g = outs
        plgpu.barrier_wait(barrier)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's stores
        for rows, dz in parts.row_blocks(acc_ref[...]):
            d_gate, d_up, sums = swiglu_grads(
                dz, gate_smem.at[rows][...].astype(jnp.float32),
                up_smem.at[rows][...].astype(jnp.float32),
                parts.rows_to_tile(scale_smem[rows], dz.shape))
            dg_smem.at[rows][...] = d_gate.astype(dtype)
            du_smem.at[rows][...] = d_up.astype(dtype)
            sums_smem[rows] = sums
        plgpu.commit_smem()
        parts.store_rows(dg_smem, dg_g, tile.item, tile.item.n)
        parts.store_rows(du_smem, du_g, tile.item, tile.item.n)
        plgpu.copy_smem_to_gmem(sums_smem, sums_g.at[tile.column_tile, tile.index],
                                commit_group=False)
        plgpu.commit_smem_to_gmem_group()

    rows = jax.ShapeDtypeStruct((num_rows, h_dim), dtype)
    sums = jax.ShapeDtypeStruct((h_dim // block_n, num_items, block_m), jnp.float32)
    staging = _staging(block_m, block_n, dtype)
    return _kernel(
        schedule, lhs=[dy], rhs=[w_down], products=[[(0, 0)]], extra=[gate, up, row_scale],
        tiles=tiles, shapes=shapes, n_dim=h_dim, transpose_rhs=True, out_type=[rows, rows, sums],
        scratch=[tile_smem, tile_smem, vectors,
                 plgpu.Barrier(num_arrivals=3, num_barriers=COMPUTE_WARPGROUPS),
                 staging, staging, vectors],
        start=start, finish=finish, name="moe_gmm_swiglu_bwd_ws_mosaic",
    )


def gmm_swiglu(x, w_gate, w_up, row_scale, schedule: GmmSchedule, *, tiles: Config,
               shapes: Layout, outputs: int, swiglu):
    """``gmm_mosaic.gmm_swiglu`` warp-specialised, on rows XLA has gathered: the gate and up
    projections of each ``x`` tile and ``swiglu(gate, up)`` (float32 row blocks), scaled by
    ``row_scale`` when given, in the epilogue. Returns ``outputs`` arrays ``[R_pad, h]``:
    the activation, then the gate and up projections."""
    block_m, block_n = tiles.block_m, shapes.block_n
    num_rows, h_dim = x.shape[0], w_gate.shape[2]
    dtype = x.dtype
    scaled = row_scale is not None
    scratch = [_staging(block_m, block_n, dtype)] * outputs
    if scaled:
        scratch += [plgpu.SMEM((COMPUTE_WARPGROUPS, block_m), jnp.float32),
                    plgpu.Barrier(num_arrivals=1, num_barriers=COMPUTE_WARPGROUPS)]

    def start(tile, scratch, inputs):
        if scaled:
            scale_smem, barrier = (ref.at[tile.wg] for ref in scratch[outputs:])
            plgpu.copy_gmem_to_smem(inputs[0].at[pl.ds(tile.item.row_start, block_m)],
                                    scale_smem, barrier)

    def finish(tile, acc_refs, scratch, inputs, outs):
        del inputs
        smems = [ref.at[tile.wg] for ref in scratch[:outputs]]
        if scaled:
            scale_smem, barrier = (ref.at[tile.wg] for ref in scratch[outputs:])
            plgpu.barrier_wait(barrier)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's stores
        for rows, gate, up in parts.row_blocks(*(acc_ref[...] for acc_ref in acc_refs)):
            act = swiglu(gate, up)
            if scaled:
                act = act * parts.rows_to_tile(scale_smem[rows], act.shape)
            for smem, value in zip(smems, (act, gate, up)[:outputs], strict=False):
                smem.at[rows][...] = value.astype(dtype)
        plgpu.commit_smem()
        for smem, out_g in zip(smems, outs, strict=True):
            parts.store_rows(smem, out_g, tile.item, tile.item.n)
        plgpu.commit_smem_to_gmem_group()

    out = jax.ShapeDtypeStruct((num_rows, h_dim), dtype)
    return _kernel(
        schedule, lhs=[x], rhs=[w_gate, w_up], products=[[(0, 0)], [(0, 1)]],
        extra=[row_scale] if scaled else [], tiles=tiles, shapes=shapes, n_dim=h_dim,
        transpose_rhs=False, out_type=[out] * outputs, scratch=scratch, start=start,
        finish=finish, name="moe_gmm_swiglu_ws_mosaic",
    )
