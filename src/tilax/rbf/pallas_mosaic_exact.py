"""Pallas Mosaic GPU kernel (Hopper) for the exact RBF forward at float32 accuracy:
``out = exp2(-sum_d (r_d (x_d - y_d))^2) v`` from coordinate differences.

``precision="highest"``'s forward (``rbf_kernel_mv``) runs here on Hopper instead of the Triton
difference kernel (``pallas_triton.Difference``), whose registers and instruction mix Triton
chooses (ncu on the H200: 46 instructions a pair, 237 registers, 58% of the issue slots). Here
every pair lives in the ``wgmma`` accumulator layout from the start:

* a compute warpgroup owns 64 query rows; their coordinates (and the residual scales) are row
  vectors held in registers for the whole loop, each key tile's coordinates are column vectors
  read from shared memory (``plgpu.Layout.WGMMA.reduce``); per pair and dimension one
  subtraction, one multiply by the residual scale and one multiply-add;
* ``exp2`` on the exp unit, then the kernel value split *exactly* into three bfloat16 parts by
  truncation (``hi + mid + lo``, 24 bits: integer masks and subtractions, no conversions);
* the values, split the same way outside the kernel, multiply on the tensor cores with A from
  registers: the six products ``hi.hi, hi.mid, mid.hi, hi.lo, mid.mid, lo.hi`` (each part is
  below 2^-8 of the one before, so the dropped ones are below 2^-24 of the product), float32
  accumulation: float32 accuracy, as the Triton kernel's three TF32 passes (2^-21).

A memory warpgroup streams key coordinates and value parts through TMA into ``STAGES`` slots;
the two compute warpgroups run independently (FMA-bound, no turns on the tensor cores). Each key
tile's exponents are formed ``CHUNK_L`` columns at a time and each chunk's products issued
before the next chunk's exponents, so that only the last chunk's wait for the tensor cores is
exposed (the chunk width measured on the H200: docs/performance/rbf.md). Keys are
stored in ``paired_columns`` order and read 16 bytes at a time (``paired_keys``); keys at or
beyond ``valid_l`` are masked by index in the last tile.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.rbf.pallas_mosaic import (
    BLOCK_P,
    COMPUTE_WARPGROUPS,
    ROWS_PER_WARPGROUP,
    _tiles,
    launch_forward,
    plgpu,
    stream_tiles,
)
from tilax.rbf.pallas_mosaic_grad import _bfloat16_bits
from tilax.rbf.pallas_triton import Difference, Distance

#: Key tiles in flight.
STAGES = 2
#: Key tile (columns of a warpgroup's pairs).
BLOCK_L = 128
#: Columns whose exponents are formed before their products are issued (64 for value tiles
#: of 64 columns or more, whose swizzle groups ``wgmma``'s K by 64).
CHUNK_L = 32
#: Most coordinates a program holds in registers (two a dimension a thread).
MAX_DIMS = 16
#: (kernel value part, value part) products, small terms first; parts are hi, mid, lo.
PRODUCTS = ((2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0))
_HIGH_HALF = 0xFFFF0000

# jax 0.10 takes the index as a separate, positional argument of plgpu.load; 0.11 deprecates it.
_LOAD_TAKES_INDEX = plgpu is not None and (
    inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty)


def _load(ref, layout):
    return plgpu.load(ref, (), layout=layout) if _LOAD_TAKES_INDEX else plgpu.load(
        ref, layout=layout)


def distance_reason(distance: Distance, values: str) -> str | None:
    """Why the exact Mosaic GPU kernels (forward and sweeps) cannot take this distance and
    values mode, or ``None``."""
    if not isinstance(distance, Difference) or distance.rounded:
        return f"it forms exponents from unrounded differences, not {distance}"
    if distance.dim > MAX_DIMS:
        return f"{distance.dim} dimensions (at most {MAX_DIMS})"
    if values != "tf32x3":
        return f"it multiplies values at float32 accuracy (the 'tf32x3' mode), not {values!r}"
    return None


def unsupported_reason(distance: Distance, values: str, block_o: int) -> str | None:
    """Why this kernel cannot run a forward of these settings, or ``None``."""
    if reason := distance_reason(distance, values):
        return reason
    if block_o % 16 or block_o > 256:
        return f"value tile {block_o} is not a multiple of 16 up to 256"
    return None


def runs(launch, distance: Distance, values: str) -> bool:
    """Whether the exact forward of ``launch`` (a ``pallas_config.Launch``) runs here: on a
    Hopper GPU, for settings this kernel supports, with its tiles."""
    return (_pallas.mosaic_unavailable_reason() is None
            and unsupported_reason(distance, values, launch.block_o) is None
            and launch.block_p == BLOCK_P and launch.block_l == BLOCK_L)


def split3(a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``a`` (float32) as bfloat16 ``(hi, mid, lo)`` with ``hi + mid + lo = a`` to 2^-24 of
    ``|a|`` (normal numbers), by truncation: each part is the high half of the float32 bits of
    what the parts before leave, and the rests are exact float32 subtractions."""
    bits0 = lax.bitcast_convert_type(a, jnp.uint32)
    rest1 = a - lax.bitcast_convert_type(bits0 & jnp.uint32(_HIGH_HALF), jnp.float32)
    bits1 = lax.bitcast_convert_type(rest1, jnp.uint32)
    rest2 = rest1 - lax.bitcast_convert_type(bits1 & jnp.uint32(_HIGH_HALF), jnp.float32)
    bits2 = lax.bitcast_convert_type(rest2, jnp.uint32)
    return _bfloat16_bits(bits0), _bfloat16_bits(bits1), _bfloat16_bits(bits2)


def paired_columns(y: jax.Array) -> jax.Array:
    """``y: [..., L]`` (``L`` a multiple of 16) with the columns of each 16 in the order that
    ``paired_keys`` reads: column ``16 m + 8 q + 2 c + p`` at ``16 m + 4 c + 2 q + p``, so that
    the four keys a thread of ``wgmma``'s register layout needs from two neighbouring 8-column
    chunks (``2 c + p`` of each) lie side by side."""
    *lead, n = y.shape
    return y.reshape(*lead, n // 16, 2, 4, 2).swapaxes(-3, -2).reshape(*lead, n)


def row_group(i32):
    """``(L, L >> 2)`` for this thread (``L`` its lane): ``L >> 2`` is its rows' index within 8
    in ``wgmma``'s register layout (rows ``16 w + (L >> 2)`` and 8 below), ``L & 3`` its
    columns' pair within each 8-column chunk."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir.dialects import arith

    lane = arith.remui(mgpu.utils.thread_idx(), mgpu.c(32, i32))
    return lane, arith.shrui(lane, mgpu.c(2, i32))


def wgmma_array(registers):
    """A ``[64, 8 J]`` float32 array of ``wgmma``'s register layout from its registers
    ``[chunk j < J][row half h]`` (vectors of two columns)."""
    import jax.experimental.mosaic.gpu as mgpu

    regs = np.empty((1, len(registers), 1, 1, 2, 1, 1, 1, 1), dtype=object)
    for j, halves in enumerate(registers):
        for h, register in enumerate(halves):
            regs[0, j, 0, 0, h, 0, 0, 0, 0] = register
    return mgpu.FragmentedArray(_registers=regs, _layout=plgpu.Layout.WGMMA.to_mgpu(),
                                _is_signed=None)


def paired_keys(keys_ref, shape, *, lane_permuted: bool = False) -> jax.Array:
    """Keys ``keys_ref: [W]`` (shared memory, ``paired_columns`` order) as the columns of a
    ``shape = [64, W]`` array of ``wgmma``'s register layout: one 16-byte load a thread for
    each 16 columns, where a plain load takes two 8-byte ones. With ``lane_permuted`` in the
    exact sweep's lane-permuted order instead (``tilax.rbf.pallas_mosaic_exact_grad``: the
    thread of lane ``L`` holds chunk ``j ^ (L >> 2)`` where the layout holds chunk ``j``), one
    8-byte load a chunk. In JAX's GPU interpreter the keys are in the plain order and loaded
    so (there nothing is permuted)."""
    if _pallas.interpreted():
        return lax.broadcast_in_dim(_load(keys_ref, plgpu.Layout.WGMMA.reduce(0)), shape, (1,))
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct(shape, jnp.float32,
                                                          layout=plgpu.Layout.WGMMA))
    def load(ctx, ref):
        del ctx
        i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
        lane, group = row_group(i32)
        quad = arith.muli(arith.andi(lane, mgpu.c(3, i32)), mgpu.c(4, i32))
        base = mgpu.utils.memref_ptr(ref)

        def keys(column, count):
            ptr = mgpu.utils.getelementptr(base, [column], f32)
            return llvm.load(ir.VectorType.get((count,), f32), ptr)

        registers = []  # [chunk][row half]: keys vary by column only
        if lane_permuted:
            for j in range(shape[1] // 8):
                chunk = arith.xori(group, mgpu.c(j, i32))
                # chunk k's pair for this thread is at 16 (k >> 1) + 4 (L & 3) + 2 (k & 1)
                start = arith.addi(arith.muli(arith.shrui(chunk, mgpu.c(1, i32)), mgpu.c(16, i32)),
                                   arith.muli(arith.andi(chunk, mgpu.c(1, i32)), mgpu.c(2, i32)))
                pair = keys(arith.addi(start, quad), 2)
                registers.append((pair, pair))
        else:
            for first in range(0, shape[1], 16):  # chunks first / 8 and first / 8 + 1
                four = keys(arith.addi(quad, mgpu.c(first, i32)), 4)
                for q in range(2):
                    pair = mgpu.utils.vector_slice(four, slice(2 * q, 2 * q + 2))
                    registers.append((pair, pair))
        return wgmma_array(registers)

    return load(keys_ref)


def scale_rows(scale: jax.Array, per_dimension: bool, num_p: int, batch: int) -> jax.Array:
    """The residual scales as rows to go below the program's coordinates (then row vectors in
    registers, as the coordinates): ``r_d`` for each dimension, or ``r^2`` once;
    ``[B, S, P]``."""
    scale = scale.astype(jnp.float32)
    rows = scale if per_dimension else scale[:1] * scale[:1]
    return jnp.broadcast_to(rows[None, :, None], (batch, rows.size, num_p))


def kernel_matmul(
    x: jax.Array,
    y: jax.Array,
    v: jax.Array,
    *,
    distance: Distance,
    valid_l: int,
    block_p: int,
    block_l: int,
    block_o: int,
    values: str,
    scale: jax.Array,
    backend: str = "mosaic",
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """``out[b, i, :] = sum_{l < valid_l} exp2(t[b, i, l]) v[b, l, :]``, float32 ``[B, P, O]``,
    with ``t = -sum_d (r_d (x[b, d, i] - y[b, d, l]))^2`` (``r = scale``, ``[D]``) or, for a
    shared scale (``scale: [1]``), ``-r^2 sum_d (x - y)^2``; the signature of
    ``pallas_triton.kernel_matmul`` for a :class:`~tilax.rbf.pallas_triton.Difference`
    (``x: [B, D, P]``, ``y: [B, D, L]``, ``v: [B, L, O]`` float32; ``backend``, ``num_warps``
    and ``num_stages`` are not used)."""
    del backend, num_warps, num_stages
    batch, dims, num_p = x.shape
    num_l, num_o = v.shape[1], v.shape[2]
    reason = unsupported_reason(distance, values, block_o)
    if reason is None and (block_p != BLOCK_P or block_l != BLOCK_L or num_p % block_p
                           or num_l % block_l or num_o % block_o or dims != distance.dim):
        reason = (f"tiles: P={num_p} by {block_p} (must be {BLOCK_P}), L={num_l} by "
                  f"{block_l} (must be {BLOCK_L}), O={num_o} by {block_o}, D={dims}")
    if reason is not None:
        raise ValueError(f"the Mosaic GPU exact RBF forward cannot run this: {reason}")
    per_dimension = distance.per_dimension
    x = jnp.concatenate([x.astype(jnp.float32), scale_rows(scale, per_dimension, num_p,
                                                            batch)], axis=1)
    v_parts = split3(v.astype(jnp.float32))
    if not _pallas.interpreted():
        y = paired_columns(y.astype(jnp.float32))
    steps = pl.cdiv(valid_l, block_l)
    full_steps = valid_l // block_l
    stages = max(1, min(STAGES, steps))
    rows = ROWS_PER_WARPGROUP
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    # wgmma takes the chunk's keys (its K) in groups as wide as the value tiles' swizzle.
    chunk_l = max(CHUNK_L, plgpu.find_swizzle(block_o * 16) // 2)
    shape = (rows, chunk_l)

    def kernel(x_ref, y_ref, v_refs, out_ref, scoped):
        (x_smem2, y_smem, v_smem, o_smem2), (y_ready, v_ready, x_ready), (y_free, v_free) = scoped
        wg, b = lax.axis_index("wg"), lax.axis_index("b")
        cols = pl.ds(lax.axis_index("o") * block_o, block_o)

        def slot_of(step):
            return lax.rem(step, jnp.array(stages, step.dtype))

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            x_smem, o_smem = x_smem2.at[wg], o_smem2.at[wg]
            own = pl.ds(lax.axis_index("p") * block_p + wg * rows, rows)
            plgpu.copy_gmem_to_smem(x_ref.at[b, :, own], x_smem, x_ready.at[wg])
            plgpu.barrier_wait(x_ready.at[wg])
            coords = [_load(x_smem.at[d], row_layout) for d in range(dims)]
            scales = [_load(x_smem.at[dims + d], row_layout)
                      for d in range(dims if per_dimension else 1)]

            def kernel_values(slot, kv_step, chunk, masked):
                columns = pl.ds(chunk * chunk_l, chunk_l)
                t = None  # minus the sum of squares, so that each square is one multiply-add
                for d in range(dims):
                    e = (lax.broadcast_in_dim(coords[d], shape, (0,))
                         - paired_keys(y_smem.at[slot, d, columns], shape))
                    if per_dimension:
                        e = e * lax.broadcast_in_dim(scales[d], shape, (0,))
                    t = (-e) * e if t is None else t - e * e
                if not per_dimension:
                    t = t * lax.broadcast_in_dim(scales[0], shape, (0,))
                p = jnp.exp2(t)
                if masked:
                    column = plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                                    layout=plgpu.Layout.WGMMA)
                    p = jnp.where(column + (kv_step * block_l + chunk * chunk_l) < valid_l,
                                  p, 0.0)
                return lax.optimization_barrier(split3(p))

            def step(kv_step, total, masked):
                slot = slot_of(kv_step)
                plgpu.barrier_wait(y_ready.at[slot])

                # Each chunk's products run on the tensor cores while the next chunk's
                # exponents are formed: only the last chunk's wait is exposed.
                def products(acc_ref):
                    for chunk in range(block_l // chunk_l):
                        parts = kernel_values(slot, kv_step, chunk, masked)
                        if chunk == 0:
                            for part in range(3):
                                plgpu.barrier_wait(v_ready.at[3 * slot + part])
                        keys = pl.ds(chunk * chunk_l, chunk_l)
                        for p_part, v_part in PRODUCTS:
                            plgpu.wgmma(acc_ref, parts[p_part],
                                        v_smem.at[3 * slot + v_part, keys])
                    plgpu.barrier_arrive(y_free.at[slot])
                    return acc_ref[...]  # (waits for the products)

                # A fresh accumulator a tile, added with a float32 add: the tensor cores'
                # accumulation truncates, and over all tiles its error grew to 2^-14 of the
                # terms' size on the H200 (the Triton kernels add each dot the same way).
                tile = pl.run_scoped(products, plgpu.ACC((rows, block_o), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])  # the value parts are read
                return total + tile

            total = plgpu.layout_cast(jnp.zeros((rows, block_o), jnp.float32),
                                      plgpu.Layout.WGMMA)
            total = lax.fori_loop(0, full_steps, lambda j, acc: step(j, acc, False), total)
            if steps > full_steps:
                total = step(jnp.int32(full_steps), total, True)
            o_smem[...] = total
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[b, own, cols])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WARPGROUPS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(tile, slot):
                keys = pl.ds(tile * block_l, block_l)
                plgpu.copy_gmem_to_smem(y_ref.at[b, :, keys], y_smem.at[slot], y_ready.at[slot])
                for part, v_ref in enumerate(v_refs):  # (one copy a part: TMA takes 5 dims)
                    plgpu.copy_gmem_to_smem(v_ref.at[b, keys, cols], v_smem.at[3 * slot + part],
                                            v_ready.at[3 * slot + part])

            def wait_free(slot):
                plgpu.barrier_wait(y_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

            stream_tiles(steps, stages, fetch, wait_free)

    def entry(x_ref, y_ref, v_hi, v_mid, v_lo, out_ref):
        smem = [
            plgpu.SMEM((COMPUTE_WARPGROUPS, x.shape[1], rows), jnp.float32),
            plgpu.SMEM((stages, dims, block_l), jnp.float32),
            plgpu.SMEM((3 * stages, block_l, block_o), jnp.bfloat16,
                       transforms=_tiles(block_o, 2)),
            plgpu.SMEM((COMPUTE_WARPGROUPS, rows, block_o), jnp.float32),
        ]
        pl.run_scoped(
            lambda *scoped: kernel(x_ref, y_ref, (v_hi, v_mid, v_lo), out_ref, scoped),
            smem,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=3 * stages),
             plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS)),
            (plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),) * 2,
            collective_axes="wg",
        )

    return launch_forward(entry, (batch, num_p, num_o), block_p, block_o,
                          "rbf_kernel_matmul_exact_mosaic")(x, y, *v_parts)
