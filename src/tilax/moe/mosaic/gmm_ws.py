"""The plain grouped matmul (``mosaic.gmm.gmm``), warp-specialised: Mosaic GPU, Hopper.

One program per SM with three warpgroups. A memory warpgroup streams the tiles of every
(item, contraction step) of the program's items through one ring of ``stages`` SMEM slots,
one flat pipeline, so that the next item's tiles land while this item's last MMA and
epilogue run. Two compute warpgroups share each item's row tile and own half of its
``2 * block_n`` columns each; an epilogue stages its tile in SMEM and TMA-stores the item's
rows, waiting for the previous store only before it writes the staging tile again.

Why (H200, E64 decoder shapes at 131 072 tokens, 1M rows, diagnostic runs): the per-item
pipelines of ``mosaic.gmm.gmm`` (two programs per SM) took 0.60 ms for the down projection
``[1M, 128] x [128, 512]``, where cuBLAS moves the same bytes as one dense product in 0.36-0.39
ms; ``ncu``: 49% of the DRAM's throughput, each program's warps waiting on their own loads and
stores. This kernel takes 0.41-0.42 ms (0.60 with two stages, which leave the memory
warpgroup nothing to fetch during an epilogue). Only short contractions take it (the
``gmm_ws`` rule of ``tilax.moe.rules``): with long ones the MMAs, not the epilogues, are the
time. In a train step on the H200 (131 072 tokens, bf16, three interleaved rounds in one
process, same outputs bit for bit) it took the E64 decoder (contractions of 128) from
9.37-9.50 to 9.09-9.16 ms, but the E8 layer (contractions of 1024, where the per-item kernel's
MMAs already run at 650-670 TFLOP/s) from 6.44-6.67 to 6.58-6.82 ms.

One pipeline spans many items, so each compute warpgroup's accumulator lives through all of
them (the pipeline's carry) and is zeroed at an item's first step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.moe.dispatch import GmmSchedule
from tilax.moe.mosaic import common
from tilax.moe.mosaic.common import Config, plgpu

COMPUTE_WARPGROUPS = 2
# Registers the memory warpgroup keeps (it only computes tile indices); the rest go to the
# compute warpgroups, whose float32 accumulators take block_m * block_n / 128 each.
MEMORY_REGISTERS = 40
# Ring slots: three let the memory warpgroup fetch two steps ahead while an epilogue runs.
MIN_STAGES, MAX_STAGES = 3, 4


def layout(tiles: Config, k_dim: int, n_dim: int, pairs: int, out_dtype) -> tuple | None:
    """``(block_k, block_n, stages)`` of the warp-specialised kernel for these shapes, or
    ``None`` where it does not fit: ``n_dim`` not a multiple of the two warpgroups' columns,
    or no ``MIN_STAGES`` ring slots (of ``block_k`` down to 32) next to the staging tiles.
    (Which contractions take it is the ``gmm_ws`` rule of ``tilax.moe.rules``.)"""
    block_n = tiles.block_n  # per compute warpgroup
    if n_dim % (COMPUTE_WARPGROUPS * block_n):
        return None
    staging = COMPUTE_WARPGROUPS * tiles.block_m * block_n * jnp.dtype(out_dtype).itemsize
    budget = common.whole_block_smem() - staging
    block_k = common.fit_block(tiles.block_k, k_dim)
    while block_k >= 32:
        stage = pairs * (tiles.block_m + COMPUTE_WARPGROUPS * block_n) * block_k * 2
        if budget // stage >= MIN_STAGES:
            return block_k, block_n, min(MAX_STAGES, budget // stage)
        block_k //= 2
    return None


def gmm(
    pairs: list[tuple[jax.Array, jax.Array]],
    schedule: GmmSchedule,
    *,
    tiles: Config,
    shapes: tuple[int, int, int],
    transpose_rhs: bool,
    out_dtype,
) -> jax.Array:
    """``out[r] = sum over pairs of lhs[r] @ rhs[e(r)]`` (``rhs[e(r)].T`` with
    ``transpose_rhs``): ``pairs`` of ``[R_pad, K]`` rows and ``[E, K, N]`` (or ``[E, N, K]``)
    weights, ``shapes = layout(...)``; rows of no item are left unwritten."""
    block_k, block_n, stages = shapes
    block_m = tiles.block_m
    num_rows, k_dim = pairs[0][0].shape
    n_dim = pairs[0][1].shape[1 if transpose_rhs else 2]
    item_n = COMPUTE_WARPGROUPS * block_n
    k_steps, n_tiles = k_dim // block_k, n_dim // item_n
    total = schedule.expert.shape[0] * n_tiles
    programs = common.sm_count()  # one program per SM
    w_shape = (item_n, block_k) if transpose_rhs else (block_k, item_n)
    swizzle = plgpu.find_swizzle(block_k * pairs[0][0].dtype.itemsize * 8)

    def body(expert_g, tile_g, lo_g, hi_g, *refs):
        operand_refs, out_g = refs[:-1], refs[-1]
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

        specs = []
        for a_g, w_g in zip(operand_refs[::2], operand_refs[1::2], strict=True):
            specs += [
                plgpu.BlockSpec((block_m, block_k), lhs_block,
                                transforms=common.mma_transforms(block_k, a_g.dtype, swizzle)),
                plgpu.BlockSpec((None, *w_shape), rhs_block,
                                transforms=common.mma_transforms(w_shape[1], w_g.dtype, swizzle)),
            ]

        def pipeline(step_fn, context):
            return plgpu.emit_pipeline_warp_specialized(
                step_fn, grid=(my_items * k_steps,), memory_registers=MEMORY_REGISTERS,
                in_specs=specs, max_concurrent_steps=stages, wg_axis="wg",
                num_compute_wgs=COMPUTE_WARPGROUPS, compute_context=context,
            )

        def scope(allocations, staging):
            wg = lax.axis_index("wg")
            columns = pl.ds(wg * block_n, block_n)

            def step_fn(indices, *smems_and_acc):
                *smems, acc_ref = smems_and_acc
                (step,) = indices
                k = step % k_steps

                @pl.when(k == 0)
                def _zero():
                    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

                for a_smem, w_smem in zip(smems[::2], smems[1::2], strict=True):
                    w = (_pallas.transposed_ref(w_smem.at[columns]) if transpose_rhs
                         else w_smem.at[:, columns])
                    plgpu.wgmma(acc_ref, a_smem, w)
                # The ring slot is released when this returns: the MMAs must have read it.
                plgpu.wgmma_wait(0)

                @pl.when(k == k_steps - 1)
                def _epilogue():
                    index, n, _ = coords(step)
                    item = common.Item(expert_g[index], tile_g[index] * block_m, lo_g[index],
                                      hi_g[index], n)
                    o_smem = staging.at[wg]
                    # The previous item's stores must have read the staging tile.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    o_smem[...] = acc_ref[...].astype(o_smem.dtype)
                    plgpu.commit_smem()
                    common.store_rows(o_smem, out_g, item, n * item_n + wg * block_n)
                    plgpu.commit_smem_to_gmem_group()

                return acc_ref

            def context(run):
                pl.run_scoped(run, plgpu.ACC((block_m, block_n)))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pipeline(step_fn, context)(*operand_refs, allocations=allocations)

        def ignore(*_, **__):
            return None

        pl.run_scoped(
            scope,
            allocations=pipeline(ignore, ignore).get_allocations(*operand_refs),
            staging=plgpu.SMEM((COMPUTE_WARPGROUPS, block_m, block_n), out_dtype,
                               transforms=common.row_transforms(block_n, out_dtype)),
            collective_axes="wg",
        )

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype),
        grid=(programs,), grid_names=("sm",), num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg", kernel_name="moe_gmm_ws_mosaic", compiler_params=common.compiler_params(),
    )
    return kernel(*schedule, *[array for pair in pairs for array in pair])
