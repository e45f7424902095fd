"""Pallas Mosaic GPU kernel (Hopper) for the exact RBF forward at float32 accuracy:
``out = exp2(-sum_d (r_d (x_d - y_d))^2) v`` from coordinate differences.

``precision="highest"``'s forward (``rbf_kernel_mv``) runs here on Hopper instead of the Triton
difference kernel (``tilax.rbf.triton``), whose registers and instruction mix Triton
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

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.rbf import profiles
from tilax.rbf.mosaic.common import (
    BLOCK_P,
    COMPUTE_WARPGROUPS,
    PRODUCTS,
    ROWS_PER_WARPGROUP,
    exact_distance_reason,
    launch_forward,
    load_in_layout,
    paired_columns,
    paired_keys,
    plgpu,
    scale_rows,
    split3,
    stream_tiles,
    swizzled,
)
from tilax.rbf.numerics import Distance

#: Key tiles in flight.
STAGES = 2
#: Key tile (columns of a warpgroup's pairs).
BLOCK_L = 128
#: Columns whose exponents are formed before their products are issued (64 for value tiles
#: of 64 columns or more, whose swizzle groups ``wgmma``'s K by 64).
CHUNK_L = 32


def unsupported_reason(distance: Distance, values: str, block_o: int) -> str | None:
    """Why this kernel cannot run a forward of these settings, or ``None``."""
    if reason := exact_distance_reason(distance, values):
        return reason
    if block_o % 16 or block_o > 256:
        return f"value tile {block_o} is not a multiple of 16 up to 256"
    return None


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
    profile: str = "rbf",
) -> jax.Array:
    """``out[b, i, :] = sum_{l < valid_l} k(t[b, i, l]) v[b, l, :]``, float32 ``[B, P, O]``
    (``k`` the kernel ``profile``, ``exp2`` for the Gaussian kernel: ``tilax.rbf.profiles``),
    with ``t = -sum_d (r_d (x[b, d, i] - y[b, d, l]))^2`` (``r = scale``, ``[D]``) or, for a
    shared scale (``scale: [1]``), ``-r^2 sum_d (x - y)^2``; the signature of
    ``tilax.rbf.triton.kernel_matmul`` for a :class:`~tilax.rbf.numerics.Difference`
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
            coords = [load_in_layout(x_smem.at[d], row_layout) for d in range(dims)]
            scales = [load_in_layout(x_smem.at[dims + d], row_layout)
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
                p = profiles.kernel_values(profile, t)
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
                       transforms=swizzled(block_o, 2)),
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
