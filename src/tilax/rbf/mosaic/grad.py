"""Pallas Mosaic GPU kernel (Hopper) for the backward pass of ``rbf_kernel_mv``'s fast path.

One sweep over the pairs gives both gradients. Programs own rows ``i`` of one point set (the
keys), a loop runs over tiles of rows ``l`` of the other (the queries), and for each pair::

    A_il = exp2(x_i . y_l) (u_i . w_l)
    sums_i = sum_l A_il c_l      pw_i = sum_l exp2(x_i . y_l) w_l      (dk, dv)
    loop_sums_l = sum_i A_il o_i                                  (dq)

with ``x``, ``y`` the augmented points as TF32 parts (one TF32 dot gives the base-2 exponent,
as in the forward), ``u``, ``w`` the values and cotangents in bfloat16 (the ``"bf16"`` values
mode), ``c`` the loop's and ``o`` the program's augmented points, multiplied by the pair weights
rounded to bfloat16 (``a_hi c_hi + a_hi c_lo``: the ``"bf16x2"`` coords mode, one product
against the coordinates' ``[hi | lo]``; the points' column of ones gives the weights' row sums
from the same product). Each pair's exponential is computed once; the two sweeps this
replaces (one over queries for dq, one over keys for dk and dv) computed it twice.

The shape is the forward's (``tilax.rbf.mosaic.forward``): a memory warpgroup streams the loop
tiles through TMA into ``STAGES`` slots, two compute warpgroups own 64 rows each and run freely:
the forward's turns on the tensor cores (a shared barrier twice a tile) made this kernel 2%
slower on the H200 (docs/performance/rbf.md). The program's sums stay in registers.
For the loop rows' sums each warpgroup also writes its pair weights to shared memory and
multiplies them, transposed, by its own rows' coordinates; the ``[block_l, 2 C]`` result is
added into a zeroed buffer by a TMA reduction (``reduction_op="add"``), across all programs.
Programs start their loops at different tiles so that their additions spread over the buffer.

Runs where a path's ``dk`` launch names ``backend="mosaic"`` (program tile 128): the
``mosaic_fast_bwd`` rows of ``tilax.rbf.config.RULES`` (loop tiles of ``BLOCK_L``, or 64 where
the buffers, ``config.mosaic_sweep_shared_memory_bytes``, do not fit), with their stored runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.rbf import profiles
from tilax.rbf.mosaic.common import (
    BLOCK_P,
    COMPUTE_WARPGROUPS,
    MAX_WIDTH,
    ROWS_PER_WARPGROUP,
    batch_folding,
    bfloat16_bits,
    launch_on_refs,
    plgpu,
    rotated_tile,
    stream_tiles,
    swizzled,
)
from tilax.rbf.numerics import split

#: Loop tiles in flight.
STAGES = 2
#: Widest value/cotangent operand (columns): every column is in one program's registers.
MAX_COLUMNS = 64
#: Default loop tile (the faster of 64 and 128 on the H200; 64 where 128 does not fit).
BLOCK_L = 128


def unsupported_reason(parts_width: int, coords_width: int, columns: int, block_l: int) -> (
        str | None):
    """Why this kernel cannot run a sweep of these widths and loop tile, or ``None``."""
    if parts_width % 16 or parts_width > MAX_WIDTH:
        return f"parts width {parts_width} is not a multiple of 16 up to {MAX_WIDTH}"
    if coords_width % 16 or coords_width > MAX_WIDTH:
        return f"coordinates width {coords_width} is not a multiple of 16 up to {MAX_WIDTH}"
    if columns % 16 or columns > MAX_COLUMNS:
        return f"value columns {columns} are not a multiple of 16 up to {MAX_COLUMNS}"
    if block_l not in (64, 128):
        return f"loop tile {block_l} is not 64 or 128"
    return None


def rounded_bfloat16(a: jax.Array) -> jax.Array:
    """``a`` (float32) rounded to the nearest bfloat16, ties away from zero (as
    ``numerics.split``'s ``hi``), by integer operations on the ALU. Conversion instructions
    run on the exp unit (XU), which the exps keep busy already (ncu on the H200: with two
    conversions per pair it was the sweep's busiest pipe, 72%)."""
    return bfloat16_bits(lax.bitcast_convert_type(a, jnp.uint32) + jnp.uint32(0x8000))


def pair_sums(
    x: jax.Array,
    y: jax.Array,
    coords: jax.Array,
    own: jax.Array,
    u: jax.Array,
    w: jax.Array,
    *,
    valid_l: int,
    block_l: int = BLOCK_L,
    block_p: int = BLOCK_P,
    backend: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    profile: str = "rbf",
) -> dict[str, jax.Array]:
    """The sums above (for another kernel ``profile`` than the Gaussian, ``exp2`` is its
    values in ``pw`` and its pair weights in ``A``: ``tilax.rbf.profiles``), float32:
    ``{"sums": [B, P, C], "pw": [B, P, O], "loop_sums": [B, L, C]}``
    for ``x: [B, P, W]``, ``y: [B, L, W]`` (TF32 parts, float32), ``coords: [B, L, C]``,
    ``own: [B, P, C]`` (float32), ``u: [B, P, O]`` and ``w: [B, L, O]`` (bfloat16). ``P`` is a
    multiple of ``BLOCK_P`` (the program tile, ``block_p``), ``L`` of ``block_l``; loop rows at
    or beyond ``valid_l`` are masked by index, and program rows whose ``u`` is zero add nothing
    to the loop sums. ``backend``, ``num_warps`` and ``num_stages`` (a ``config.Launch``'s)
    are not used: one backend, three warpgroups, ``STAGES``."""
    del backend, num_warps, num_stages
    num_l, coords_width, columns = y.shape[1], coords.shape[2], u.shape[2]
    reason = unsupported_reason(x.shape[2], coords_width, columns, block_l)
    if reason is None and block_p != BLOCK_P:
        reason = f"program tile {block_p} (must be {BLOCK_P})"
    if reason is None and own.shape[2] != coords_width:
        reason = f"own coordinates width {own.shape[2]} (must be the loop's, {coords_width})"
    if reason is None and (x.shape[1] % BLOCK_P or num_l % block_l):
        reason = f"rows: P={x.shape[1]} by {BLOCK_P}, L={num_l} by {block_l}"
    if reason is not None:
        raise ValueError(f"the Mosaic GPU RBF gradient sweep cannot run this: {reason}")
    # Coordinates as [hi | lo]: one product of twice the width gives both terms' sums side by
    # side (one operand read for both: 3% faster on the H200 than two products).
    operands = (x, y, jnp.concatenate(split(coords.astype(jnp.float32), "bf16x2"), -1),
                jnp.concatenate(split(own.astype(jnp.float32), "bf16x2"), -1),
                u.astype(jnp.bfloat16), w.astype(jnp.bfloat16))

    sweep = batch_folding(functools.partial(_sweep, valid_l=valid_l, block_l=block_l,
                                            profile=profile))
    loop_sums, sums, pw = sweep(*operands)
    return {"sums": sums, "pw": pw, "loop_sums": loop_sums}


def _lo_plus_hi(sums: jax.Array) -> jax.Array:
    """Sums ``[rows, 2 C]`` against coordinates ``[hi | lo]`` as ``[rows, C]`` (small terms
    first); in a ``wgmma`` tile both halves of a row are one thread's registers."""
    half = sums.shape[1] // 2
    return sums[:, half:] + sums[:, :half]


def _sweep(x, y, c_parts, o_parts, u, w, *, valid_l: int, block_l: int, profile: str):
    """``pair_sums``'s kernel on its operands (coordinates as bfloat16 ``[hi | lo]``):
    ``(loop_sums, sums, pw)``."""
    batch, num_p, width = x.shape
    num_l, coords_width, columns = y.shape[1], c_parts.shape[2] // 2, u.shape[2]
    steps = pl.cdiv(valid_l, block_l)
    full_steps = valid_l // block_l
    stages = max(1, min(STAGES, steps))
    rows = ROWS_PER_WARPGROUP
    programs = num_p // BLOCK_P

    def kernel(x_ref, y_ref, c_ref, o_ref, u_ref, w_ref, loop_out, sums_out, pw_out, scoped):
        smem, barriers, slot_free = scoped
        x_smem2, u_smem2, o_smem2, y_smem, w_smem, c_smem, a_smem2, loop_smem2, pw_smem2 = smem
        y_ready, w_ready, c_ready, own_ready = barriers
        wg, b, p = lax.axis_index("wg"), lax.axis_index("b"), lax.axis_index("p")
        # Each program starts its loop at another tile, so that the programs running at once
        # add into different rows of the loop sums.
        offset = (p * full_steps) // programs

        def slot_of(step):
            return lax.rem(step, jnp.array(stages, step.dtype))

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            x_smem, u_smem = x_smem2.at[wg], u_smem2.at[wg]
            o_smem = o_smem2.at[wg]
            a_smem, loop_smem = a_smem2.at[wg], loop_smem2.at[wg]
            own = pl.ds(p * BLOCK_P + wg * rows, rows)
            mine = ((x_ref, x_smem), (u_ref, u_smem), (o_ref, o_smem))
            for i, (src, dst) in enumerate(mine):
                plgpu.copy_gmem_to_smem(src.at[b, own], dst, own_ready.at[len(mine) * wg + i])
            for i in range(len(mine)):
                plgpu.barrier_wait(own_ready.at[len(mine) * wg + i])
            plgpu.barrier_wait(y_ready.at[0])
            plgpu.barrier_wait(w_ready.at[0])

            def step(index, sums_ref, pw_ref, masked):
                slot = slot_of(index)
                tile = rotated_tile(index, full_steps, offset)

                def scores(t_ref, uw_ref):
                    plgpu.wgmma(t_ref, x_smem, _pallas.transposed_ref(y_smem.at[slot]))
                    plgpu.wgmma(uw_ref, u_smem, _pallas.transposed_ref(w_smem.at[slot]))
                    t = plgpu.wgmma_accumulator_load(t_ref, wait_n=1)  # uw may be in flight
                    # No clamp at 0, as in the forward: within the default fast budget a
                    # float32 kernel value exceeds 1 by less than its error bound (2^-8), and
                    # its bfloat16 rounding (dv's) is at most 1 (numerics.FAST_DISTANCE_BUDGET);
                    # a min per pair cost 2% of the sweep.
                    # (Matérn values: no clamp at 1 either, their bfloat16 rounding is at most
                    # 1; the float32 pair weights are not values.)
                    kernel_values, weights = profiles.values_and_weights(
                        profile, t, clamp=False, fast=True)
                    if masked:
                        column = plgpu.broadcasted_iota(jnp.int32, (rows, block_l), 1,
                                                        layout=plgpu.Layout.WGMMA)
                        valid = column + tile * block_l < valid_l
                        kernel_values = jnp.where(valid, kernel_values, 0.0)
                        weights = (kernel_values if profile == "rbf"
                                   else jnp.where(valid, weights, 0.0))
                    p16 = lax.optimization_barrier(kernel_values.astype(jnp.bfloat16))
                    # dv's product runs while the pair weights are formed and stored (2% faster
                    # than issuing it with the other sums' products on the H200).
                    plgpu.wgmma(pw_ref, p16, w_smem.at[slot])
                    uw = plgpu.wgmma_accumulator_load(uw_ref, wait_n=1)
                    return weights, uw

                weights, uw = pl.run_scoped(
                    scores, plgpu.ACC((rows, block_l), jnp.float32),
                    plgpu.ACC((rows, block_l), jnp.float32))
                a16 = lax.optimization_barrier(rounded_bfloat16(weights * uw))
                # This step's loop-sum dots of the last step are done (waited for below).
                a_smem[...] = a16
                plgpu.commit_smem()
                plgpu.barrier_wait(c_ready.at[slot])

                def dots(*loop_accs):
                    plgpu.wgmma(sums_ref, a16, c_smem.at[slot])
                    for half, acc in enumerate(loop_accs):  # A^T: loop rows by own rows
                        weights = _pallas.transposed_ref(a_smem.at[:, pl.ds(half * rows, rows)])
                        plgpu.wgmma(acc, weights, o_smem)
                    following = index + 1

                    @pl.when(following < steps)
                    def _():
                        plgpu.barrier_wait(y_ready.at[slot_of(following)])
                        plgpu.barrier_wait(w_ready.at[slot_of(following)])

                    plgpu.wgmma_wait(0)  # the slot is read: it may be refilled
                    plgpu.barrier_arrive(slot_free.at[slot])
                    return [acc[...] for acc in loop_accs]

                loop_sums = pl.run_scoped(
                    dots, *[plgpu.ACC((rows, 2 * coords_width), jnp.float32)] * (block_l // rows))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's sums are out
                for half, value in enumerate(loop_sums):
                    loop_smem.at[pl.ds(half * rows, rows)][...] = _lo_plus_hi(value)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(loop_smem, loop_out.at[b, pl.ds(tile * block_l, block_l)],
                                        reduction_op="add")

            def loop(sums_ref, pw_ref):
                @pl.loop(0, full_steps)
                def _(j):
                    step(j, sums_ref, pw_ref, False)

                if steps > full_steps:
                    step(jnp.int32(full_steps), sums_ref, pw_ref, True)
                return sums_ref[...], pw_ref[...]

            sums, pw = pl.run_scoped(loop, plgpu.ACC((rows, 2 * coords_width), jnp.float32),
                                     plgpu.ACC((rows, columns), jnp.float32))
            # The program's sums are staged where the loop's were (their last reduction read).
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            sums_smem = loop_smem.at[pl.ds(0, rows)]
            sums_smem[...] = _lo_plus_hi(sums)
            pw_smem2.at[wg][...] = pw
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(sums_smem, sums_out.at[b, own])
            plgpu.copy_smem_to_gmem(pw_smem2.at[wg], pw_out.at[b, own])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WARPGROUPS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(index, slot):
                tile_rows = pl.ds(rotated_tile(index, full_steps, offset) * block_l, block_l)
                plgpu.copy_gmem_to_smem(y_ref.at[b, tile_rows], y_smem.at[slot],
                                        y_ready.at[slot])
                plgpu.copy_gmem_to_smem(w_ref.at[b, tile_rows], w_smem.at[slot],
                                        w_ready.at[slot])
                plgpu.copy_gmem_to_smem(c_ref.at[b, tile_rows], c_smem.at[slot],
                                        c_ready.at[slot])

            stream_tiles(steps, stages, fetch, lambda slot: plgpu.barrier_wait(slot_free.at[slot]),
                         one_warp=False)  # (1.2% faster here, stream_tiles says)

    def entry(*refs):
        wgs = COMPUTE_WARPGROUPS
        coords_tiles = swizzled(2 * coords_width, 2)
        smem = [
            plgpu.SMEM((wgs, rows, width), jnp.float32, transforms=swizzled(width, 4)),
            plgpu.SMEM((wgs, rows, columns), jnp.bfloat16, transforms=swizzled(columns, 2)),
            plgpu.SMEM((wgs, rows, 2 * coords_width), jnp.bfloat16, transforms=coords_tiles),
            plgpu.SMEM((stages, block_l, width), jnp.float32, transforms=swizzled(width, 4)),
            plgpu.SMEM((stages, block_l, columns), jnp.bfloat16, transforms=swizzled(columns, 2)),
            plgpu.SMEM((stages, block_l, 2 * coords_width), jnp.bfloat16,
                       transforms=coords_tiles),
            # The pair weights as the loop sums' operand A (read transposed): its swizzle must
            # be the own coordinates' (``wgmma``). 128-byte swizzles with transposed own
            # coordinates were slower on the H200 (docs/performance/rbf.md).
            plgpu.SMEM((wgs, rows, block_l), jnp.bfloat16, transforms=coords_tiles),
            plgpu.SMEM((wgs, block_l, coords_width), jnp.float32),
            plgpu.SMEM((wgs, rows, columns), jnp.float32),
        ]
        barriers = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                    plgpu.Barrier(num_barriers=stages),
                    plgpu.Barrier(num_barriers=3 * wgs))
        pl.run_scoped(
            lambda *scoped: kernel(*refs, scoped),
            smem,
            barriers,
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
            collective_axes="wg",
        )

    zeros = [jnp.zeros((batch, rows_, cols), jnp.float32) for rows_, cols in
             ((num_l, coords_width), (num_p, coords_width), (num_p, columns))]
    launch = functools.partial(launch_on_refs, entry, programs=programs, batch=batch,
                               name="rbf_pair_sums_mosaic")
    return tuple(pl.run_state(launch)((x, y, c_parts, o_parts, u, w, *zeros))[-3:])


