"""Rows gathered inside the Mosaic GPU grouped matmuls: per-thread asynchronous copies.

Hopper's TMA copies tiles, not gathered rows, so without this the rows a kernel reads through
``index`` are gathered by XLA first (``mosaic.common.gathered``): for the E64 top-8
decoder at 131 072 tokens a copy of 1M rows of 512 bfloat16 (1 GB written, about as much
read) that took 0.56 ms of its 3.37 ms forward on the H200. Here the warpgroup's threads copy
the rows of the tile themselves, eight lanes a row's 128-byte slice of each contraction step
(16-byte ``cp.async`` copies, coalesced along the row), straight into the swizzled SMEM tile
``wgmma`` reads, as Triton's kernels gather (Mosaic GPU's own ``cp.async`` path is for GPUs
before Hopper and copies tiles). The weight tiles still come by TMA.

:func:`pipeline` is ``mosaic.common.pipeline`` with its first operand gathered into
its own ring of ``row_stages`` slots beside the ``stages`` of the TMA-copied weight tiles, the
copies of step ``k + row_stages - 1`` issued once the ``wgmma`` of step ``k - 1`` has read
its slot, each thread waiting for its own copies (``cp.async.wait_group``) and then the
warpgroup together (``commit_smem``: a proxy fence, so that ``wgmma``'s reads see the copies,
and a warpgroup barrier) before a step's ``wgmma``.

JAX's GPU interpreter cannot run inlined Mosaic GPU code: there (on a CPU) the kernels keep
the sub-tiles of :func:`gathering_tiles` but read them from XLA's gathered copy by TMA.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tilax.moe.mosaic.common import capped_block_n, mma_transforms, plgpu, smem_budget

# The warpgroup's threads share a tile's rows (eight lanes a row), and a contraction step is
# one 128-byte swizzle row of 16-bit values: the layout the copies below write (tiles of 8
# rows of 128 bytes, 16-byte chunks XOR-ed by the row within its tile, as TMA and wgmma read
# a 128-byte swizzle).
THREADS = 128
ROW_BYTES = 128
CHUNK_BYTES = 16
# A gathering kernel works each item in sub-tiles of this many rows, so that two float32
# accumulators of 128 columns fit one warpgroup's registers and the E64 decoder's SwiGLU
# kernel (128 hidden columns) gathers each row once.
SUB_ROWS = 64
# Slots of gathered rows in flight. E64 decoder forward on the H200 (diagnostic A/B, medians
# of 5 rounds, same process): 131 072 tokens 2.95 / 2.85 / 2.88 ms with 2 / 3 / 5 slots
# (Triton 3.04, XLA's gather first 3.27); 16 384 tokens 0.477 / 0.472 / 0.479 ms (Triton
# 0.494). Copies of a lane a row instead of eight lanes a row: 3.08 and 0.505 ms.
ROW_STAGES = 3


def gathering_tiles(tiles, d_dim: int, h_dim: int, dtype, max_column_tiles: int):
    """``(rows, block_n, block_k, row_stages, stages)`` of a SwiGLU kernel that gathers its
    own rows: ``SUB_ROWS``-row sub-tiles of each item, as many columns as its two float32
    accumulators allow, one 128-byte step of ``x`` at a time; two stages of weight tiles
    (each expert's, read by all its row tiles, mostly come from L2) and up to ``ROW_STAGES``
    of the gathered rows (from anywhere in HBM: the deeper ring); ``None`` where that does not
    fit, or where more than ``max_column_tiles`` column tiles would each gather the rows
    again (the ``gather_rows`` rule of ``tilax.moe.rules``: on the H200 the E8 layer's SwiGLU
    kernel gathering for each of its 16 column tiles of 128 rows made the forward at 131 072
    tokens 2.68 ms against 1.81 with XLA's gather first; diagnostic A/B, copies of a lane a
    row). XLA then gathers the rows first."""
    itemsize = jnp.dtype(dtype).itemsize
    block_k = ROW_BYTES // itemsize
    if tiles.block_m % SUB_ROWS or d_dim % block_k:
        return None
    block_n = capped_block_n(dataclasses.replace(tiles, block_m=SUB_ROWS), h_dim, 2)
    if block_n * itemsize < ROW_BYTES or h_dim // block_n > max_column_tiles:
        return None  # (every operand tile of a wgmma at the copies' 128-byte swizzle)
    stages, weight_bytes, row_bytes = 2, 2 * block_k * block_n * itemsize, SUB_ROWS * ROW_BYTES
    row_stages = min(ROW_STAGES, (smem_budget(tiles) - stages * weight_bytes) // row_bytes)
    if row_stages < 2:
        return None
    return SUB_ROWS, block_n, block_k, row_stages, stages  # (pipeline caps both by the steps)


def _copy_rows(x_g, index_view, slot, col_start: int) -> None:
    """``slot[r, :] = x_g[index_view[r], col_start : col_start + block_k]`` for the tile's
    rows, as ``cp.async`` copies committed as one group. Eight neighbouring lanes copy the
    eight 16-byte chunks of one row (one 128-byte line a row, four a warp's copy), and a
    thread the same chunk of every sixteenth row: a lane a row would make each copy
    instruction touch 32 lines."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref

    itemsize = jnp.dtype(x_g.dtype).itemsize
    tiled = plgpu.RefType(transforms=mma_transforms(slot.shape[1], slot.dtype))
    lanes_per_row = ROW_BYTES // CHUNK_BYTES
    rows_per_copy = THREADS // lanes_per_row

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), tiled))
    def copy(ctx, x_ref, index_ref, slot_ref):
        del ctx
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        void = ir.Type.parse("!llvm.void")
        block_m = ir.MemRefType(index_ref.type).shape[0]
        num_tokens, width = ir.MemRefType(x_ref.type).shape
        thread = arith.remui(mgpu.utils.thread_idx(), mgpu.c(THREADS, i32))
        chunk = arith.remui(thread, mgpu.c(lanes_per_row, i32))
        first_row = arith.divui(thread, mgpu.c(lanes_per_row, i32))
        # The 128-byte swizzle puts chunk c of row r at chunk c ^ (r % 8): rows_per_copy is a
        # multiple of 8, so that is the same for all of this thread's rows.
        place = arith.shli(arith.xori(chunk, arith.andi(first_row, mgpu.c(7, i32))),
                           mgpu.c(4, i32))
        source = arith.addi(
            llvm.ptrtoint(i64, mgpu.utils.memref_ptr(x_ref)),
            arith.extui(i64, arith.addi(arith.shli(chunk, mgpu.c(4, i32)),
                                        mgpu.c(col_start * itemsize, i32))))
        target = arith.addi(llvm.ptrtoint(i32, mgpu.utils.memref_ptr(slot_ref)), place)
        for first in range(0, block_m, rows_per_copy):
            row = arith.addi(first_row, mgpu.c(first, i32))
            token = memref.load(index_ref, [arith.index_cast(ir.IndexType.get(), row)])
            # In bounds by construction; clamped (unsigned) so that no index can fault.
            token = arith.minui(token, mgpu.c(num_tokens - 1, i32))
            row_source = arith.addi(
                source, arith.muli(arith.extui(i64, token), mgpu.c(width * itemsize, i64)))
            row_target = arith.addi(target, arith.muli(row, mgpu.c(ROW_BYTES, i32)))
            llvm.inline_asm(
                void, [row_target, row_source],
                f"cp.async.cg.shared.global [$0], [$1], {CHUNK_BYTES};", "r,l",
                has_side_effects=True)
        llvm.inline_asm(void, [], "cp.async.commit_group;", "", has_side_effects=True)

    copy(x_g, index_view, slot)


def _wait_copies(pending: int) -> None:
    """Wait until at most ``pending`` of this thread's copy groups are in flight, then for the
    whole warpgroup (``commit_smem``: proxy fence and barrier)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    @plgpu.inline_mgpu()
    def wait(ctx):
        del ctx
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], f"cp.async.wait_group {pending};", "",
                        has_side_effects=True)

    wait()
    plgpu.commit_smem()


def pipeline(step, num_steps: int, rows, operands, row_stages: int, stages: int,
             mmas_per_step: int) -> None:
    """``mosaic.common.pipeline`` whose first operand is gathered: ``rows = (x_g,
    index_view)`` with ``x_g: [T, K]`` in GMEM and ``index_view: [block_m]`` the tile's rows of
    ``x_g``, in a ring of ``row_stages`` slots; ``operands`` the TMA-copied ones,
    ``(gmem_ref, block_shape, index_map)``, in rings of ``stages``; ``step(k, x_smem,
    *smem_refs)`` issues the ``mmas_per_step`` MMAs of step ``k``. Each ring's slot of step
    ``k - 1`` is refilled once that step's MMAs are done, with the step a ring's depth ahead."""
    from jax.experimental import pallas as pl

    x_g, index_view = rows
    block_m, block_k = index_view.shape[0], ROW_BYTES // x_g.dtype.itemsize
    row_stages = max(2, min(row_stages, num_steps))
    stages = max(2, min(stages, num_steps))

    def scope(x_ring, *rest):
        *rings, ready = rest

        def issue_rows(k: int) -> None:
            _copy_rows(x_g, index_view, x_ring.at[k % row_stages], k * block_k)

        def issue_operands(k: int) -> None:
            for (ref, shape, index_map), ring in zip(operands, rings, strict=True):
                window = tuple(pl.ds(i * size, size) for i, size in zip(index_map(k), shape,
                                                                         strict=True))
                plgpu.copy_gmem_to_smem(ref.at[window], ring.at[k % stages], ready.at[k % stages])

        for k in range(min(row_stages - 1, num_steps)):
            issue_rows(k)
        for k in range(min(stages - 1, num_steps)):
            issue_operands(k)
        for k in range(num_steps):
            # Row groups committed after step k's: those of the steps issued ahead of it.
            _wait_copies(min(row_stages - 2, num_steps - 1 - k))
            plgpu.barrier_wait(ready.at[k % stages])
            step(k, x_ring.at[k % row_stages], *[ring.at[k % stages] for ring in rings])
            # Step k - 1's wgmma has read its slots: refill them.
            plgpu.wgmma_wait(mmas_per_step)
            if k + row_stages - 1 < num_steps:
                issue_rows(k + row_stages - 1)
            if k + stages - 1 < num_steps:
                issue_operands(k + stages - 1)
        plgpu.wgmma_wait(0)

    dtype = x_g.dtype
    pl.run_scoped(
        scope,
        plgpu.SMEM((row_stages, block_m, block_k), dtype,
                   transforms=mma_transforms(block_k, dtype)),
        *[plgpu.SMEM((stages, *shape), ref.dtype, transforms=mma_transforms(shape[1], ref.dtype))
          for ref, shape, _ in operands],
        plgpu.Barrier(num_arrivals=len(operands), num_barriers=stages),
    )


def index_rows(index_g: jax.Array, row_start, block_m: int) -> jax.Array:
    """The tile's ``block_m`` entries of ``index_g`` (a GMEM ref) from ``row_start``."""
    from jax.experimental import pallas as pl

    return index_g.at[pl.ds(row_start, block_m)]
