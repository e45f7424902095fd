"""The rows' input gradient and the gate/up weight gradients in one kernel: Mosaic GPU, Hopper.

After the SwiGLU backward, a train step's backward has two products that read the gate and
up gradients ``dg, du`` (``[R_pad, h]``): the rows' input gradient
``dx[r] = dg[r] @ w_gate[e].T + du[r] @ w_up[e].T`` and the weight gradients
``dw_gate[e] = x[rows of e].T @ dg[rows of e]`` (``du`` and ``w_up`` alike). Separately
(``mosaic.gmm.gmm`` and ``mosaic.gmm.tgmm``) they read ``dg`` and ``du`` twice; here one pass
over each expert's rows computes both.

Work items are (expert, 128 input features), the four of one expert on neighbouring
programs (their reads of ``dg`` and ``du`` meet in L2). One program per SM, three
warpgroups. The memory warpgroup streams the item's 64-row chunks of ``dg``, ``du`` and the
item's two 64-feature halves of the sorted ``x`` through a ring of ``stages`` SMEM slots,
one flat pipeline over all of the program's items. Compute warpgroup ``w`` owns 64 features
``f``: per chunk it computes ``dx[chunk, f]`` (two MMAs against its weight slices, loaded at
the item's first chunk, staged and stored for the expert's rows only) and adds
``x[chunk, f].T @ dg[chunk]`` and ``x[chunk, f].T @ du[chunk]`` into its two weight-gradient
accumulators, stored at the item's last chunk through the weight slices' SMEM. In a chunk
that the item shares with another expert (its first and last), each compute warpgroup
zeroes the other rows of its own half of the ``x`` slot, so no warpgroup writes what the
other reads. ``dg`` and ``du`` are not masked: the rows of other experts and the padding
rows the schedule covers (``cover_tail``) hold finite values, which meet zeros of ``x``.
An expert without rows gets one fully masked chunk, so its gradients are stored as zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.moe.mosaic import common
from tilax.moe.mosaic.common import plgpu

COMPUTE_WARPGROUPS = 2
# Input features of one compute warpgroup (its dx columns and its weight-gradient rows), and
# rows per chunk: one wgmma of 64 rows each way.
FEATURES = 64
ITEM_FEATURES = COMPUTE_WARPGROUPS * FEATURES
CHUNK_ROWS = 64
# Registers of the memory warpgroup, as in gmm_ws; the compute warpgroups' three
# accumulators take 32 + 2 * h / 2 of the 232 they get.
MEMORY_REGISTERS = 40
MIN_STAGES, MAX_STAGES = 2, 3
# Items of one program are found from its step by comparing the step with their first steps,
# unrolled: beyond this many items a program's lookup would cost more than it saves.
MAX_ITEMS_PER_PROGRAM = 8


def layout(d_dim: int, h_dim: int, num_experts: int, dtype) -> int | None:
    """Ring stages of the joined kernel for these shapes, or ``None`` where it does not apply:
    ``d_dim`` not a multiple of 128, ``h_dim`` not 64 or 128 (the weight-gradient
    accumulators must fit a warpgroup's registers), more than ``MAX_ITEMS_PER_PROGRAM`` items
    per SM, or fewer than ``MIN_STAGES`` slots beside the weight slices and the staging."""
    if d_dim % ITEM_FEATURES or h_dim not in (64, 128):
        return None
    if pl.cdiv(num_experts * d_dim // ITEM_FEATURES, common.sm_count()) > MAX_ITEMS_PER_PROGRAM:
        return None
    itemsize = jnp.dtype(dtype).itemsize
    stage = CHUNK_ROWS * (2 * h_dim + ITEM_FEATURES) * itemsize
    fixed = COMPUTE_WARPGROUPS * (2 * FEATURES * h_dim + CHUNK_ROWS * FEATURES) * itemsize
    stages = (common.whole_block_smem() - fixed) // stage
    return min(MAX_STAGES, stages) if stages >= MIN_STAGES else None


def item_starts(group_offsets: jax.Array, num_feature_blocks: int, programs: int) -> jax.Array:
    """``[programs, J + 1]`` int32: the first pipeline step of each of a program's ``J`` items
    and, last, its step count. Item ``i = expert * num_feature_blocks + block`` runs on
    program ``i % programs``; it takes one step per 64-row chunk holding the expert's rows
    (at least one)."""
    lo, hi = group_offsets[:-1], group_offsets[1:]
    steps = jnp.maximum(pl.cdiv(hi, CHUNK_ROWS) - lo // CHUNK_ROWS, 1)
    steps = jnp.repeat(steps, num_feature_blocks)
    per_program = pl.cdiv(steps.shape[0], programs)
    steps = jnp.pad(steps, (0, per_program * programs - steps.shape[0]))
    steps = steps.reshape(per_program, programs).T
    return jnp.pad(jnp.cumsum(steps, axis=1), ((0, 0), (1, 0))).astype(jnp.int32)


def input_and_gate_up_grads(
    x_rows: jax.Array,
    d_gate: jax.Array,
    d_up: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    group_offsets: jax.Array,
    *,
    stages: int,
    overlap: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dx_rows, dw_gate, dw_up)``: ``[R_pad, d]`` rows of ``dg @ w_gate[e].T + du @
    w_up[e].T`` (rows of no expert left unwritten) and ``[E, d, h]`` gradients, all in the
    operands' dtype; ``stages = layout(...)``. ``overlap``: the dx epilogue runs while the
    weight-gradient MMAs do (``wgmma_accumulator_load`` with ``wait_n=2``), the second
    variant of the A/B that decides the ``joined_dx`` rule of ``tilax.moe.rules``."""
    num_rows, d_dim = x_rows.shape
    num_experts, _, h_dim = w_gate.shape
    feature_blocks = d_dim // ITEM_FEATURES
    programs = common.sm_count()
    starts = item_starts(group_offsets, feature_blocks, programs)
    items_per_program = starts.shape[1] - 1
    last_chunk = num_rows // CHUNK_ROWS - 1
    dtype = x_rows.dtype

    def body(offsets_g, starts_g, dg_g, du_g, x_g, wg_g, wu_g, dx_g, dwg_g, dwu_g):
        program = lax.axis_index("sm")

        def locate(step):
            """The step's item: expert, first feature, rows ``[lo, hi)``, chunk, its step
            within the item and the item's step count."""
            slot = jnp.int32(0)
            for later in range(1, items_per_program):
                slot += (step >= starts_g[program, later]).astype(jnp.int32)
            item = program + slot * programs
            expert = item // feature_blocks
            first_step = starts_g[program, slot]
            lo, hi = offsets_g[expert], offsets_g[expert + 1]
            k = step - first_step
            chunk = jnp.minimum(lo // CHUNK_ROWS + k, last_chunk)
            return (expert, (item % feature_blocks) * ITEM_FEATURES, lo, hi, chunk, k,
                    starts_g[program, slot + 1] - first_step)

        def rows_block(step):
            return locate(step)[4], 0

        def x_block(half):
            def index(step):
                _, feature, _, _, chunk, _, _ = locate(step)
                return chunk, feature // FEATURES + half

            return index

        swizzle = plgpu.find_swizzle(FEATURES * dtype.itemsize * 8)
        specs = [
            plgpu.BlockSpec((CHUNK_ROWS, h_dim), rows_block,
                            transforms=common.mma_transforms(h_dim, dtype, swizzle)),
            plgpu.BlockSpec((CHUNK_ROWS, h_dim), rows_block,
                            transforms=common.mma_transforms(h_dim, dtype, swizzle)),
            *[plgpu.BlockSpec((CHUNK_ROWS, FEATURES), x_block(half),
                              transforms=common.mma_transforms(FEATURES, dtype, swizzle))
              for half in range(COMPUTE_WARPGROUPS)],
        ]
        operands = (dg_g, du_g, x_g, x_g)

        def pipeline(step_fn, context):
            return plgpu.emit_pipeline_warp_specialized(
                step_fn, grid=(starts_g[program, items_per_program],),
                memory_registers=MEMORY_REGISTERS, in_specs=specs, max_concurrent_steps=stages,
                wg_axis="wg", num_compute_wgs=COMPUTE_WARPGROUPS, compute_context=context,
            )

        def scope(allocations, w_gate_smem, w_up_smem, staging, loaded):
            wg = lax.axis_index("wg")
            my_gate, my_up, my_staging = w_gate_smem.at[wg], w_up_smem.at[wg], staging.at[wg]

            def step_fn(indices, dg_smem, du_smem, *x_smems_and_accs):
                *x_smems, accs = x_smems_and_accs
                dx_acc, dwg_acc, dwu_acc = accs
                (step,) = indices
                expert, feature, lo, hi, chunk, k, steps = locate(step)
                features = pl.ds(feature + wg * FEATURES, FEATURES)

                @pl.when(k == 0)
                def _item_start():
                    # The previous item's gradients must have left these slices.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    plgpu.copy_gmem_to_smem(wg_g.at[expert, features], my_gate, loaded.at[wg])
                    plgpu.copy_gmem_to_smem(wu_g.at[expert, features], my_up, loaded.at[wg])
                    dwg_acc[...] = jnp.zeros(dwg_acc.shape, jnp.float32)
                    dwu_acc[...] = jnp.zeros(dwu_acc.shape, jnp.float32)
                    plgpu.barrier_wait(loaded.at[wg])

                dx_acc[...] = jnp.zeros(dx_acc.shape, jnp.float32)
                plgpu.wgmma(dx_acc, dg_smem, _pallas.transposed_ref(my_gate))
                plgpu.wgmma(dx_acc, du_smem, _pallas.transposed_ref(my_up))
                for half, x_smem in enumerate(x_smems):
                    @pl.when(wg == half)
                    def _weight_grads(x_smem=x_smem):
                        @pl.when((k == 0) | (k == steps - 1))
                        def _mask():
                            rows = chunk * CHUNK_ROWS + lax.broadcasted_iota(
                                jnp.int32, x_smem.shape, 0)
                            keep = (rows >= lo) & (rows < hi)
                            x_smem[...] = jnp.where(keep, x_smem[...], jnp.zeros((), dtype))
                            plgpu.commit_smem()

                        plgpu.wgmma(dwg_acc, _pallas.transposed_ref(x_smem), dg_smem)
                        plgpu.wgmma(dwu_acc, _pallas.transposed_ref(x_smem), du_smem)

                if overlap:
                    dx = plgpu.wgmma_accumulator_load(dx_acc, wait_n=2)
                else:
                    plgpu.wgmma_wait(0)
                    dx = dx_acc[...]
                # The previous chunk's stores must have read the staging tile.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                my_staging[...] = dx.astype(dtype)
                plgpu.commit_smem()
                row_start = chunk * CHUNK_ROWS
                local_lo = jnp.clip(lo - row_start, 0, CHUNK_ROWS)
                local_hi = jnp.clip(hi - row_start, local_lo, CHUNK_ROWS)
                item = common.Item(expert, row_start, local_lo, local_hi, 0)
                common.store_rows(my_staging, dx_g, item, feature + wg * FEATURES)
                plgpu.commit_smem_to_gmem_group()
                # The ring slots are released when this returns: the MMAs must have read them.
                plgpu.wgmma_wait(0)

                @pl.when(k == steps - 1)
                def _item_end():
                    # The weight slices are free: this item's last MMAs have read them.
                    my_gate[...] = dwg_acc[...].astype(my_gate.dtype)
                    my_up[...] = dwu_acc[...].astype(my_up.dtype)
                    plgpu.commit_smem()
                    for smem, out_g in ((my_gate, dwg_g), (my_up, dwu_g)):
                        plgpu.copy_smem_to_gmem(smem, out_g.at[expert, features],
                                                commit_group=False)
                    plgpu.commit_smem_to_gmem_group()

                return accs

            def context(run):
                pl.run_scoped(
                    lambda *accs: run(accs),
                    plgpu.ACC((CHUNK_ROWS, FEATURES)),
                    plgpu.ACC((FEATURES, h_dim)),
                    plgpu.ACC((FEATURES, h_dim)),
                )
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pipeline(step_fn, context)(*operands, allocations=allocations)

        def ignore(*_, **__):
            return None

        weights = plgpu.SMEM((COMPUTE_WARPGROUPS, FEATURES, h_dim), w_gate.dtype,
                             transforms=common.mma_transforms(h_dim, w_gate.dtype))
        pl.run_scoped(
            scope,
            allocations=pipeline(ignore, ignore).get_allocations(*operands),
            w_gate_smem=weights,
            w_up_smem=weights,
            staging=plgpu.SMEM((COMPUTE_WARPGROUPS, CHUNK_ROWS, FEATURES), dtype,
                               transforms=common.row_transforms(FEATURES, dtype)),
            loaded=plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WARPGROUPS),
            collective_axes="wg",
        )

    grads = jax.ShapeDtypeStruct((num_experts, d_dim, h_dim), w_gate.dtype)
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((num_rows, d_dim), dtype), grads, grads),
        grid=(programs,), grid_names=("sm",), num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg", kernel_name="moe_gmm_dx_mosaic", compiler_params=common.compiler_params(),
    )
    return kernel(group_offsets, starts, d_gate, d_up, x_rows, w_gate, w_up)
