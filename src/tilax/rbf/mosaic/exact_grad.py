"""Pallas Mosaic GPU kernel (Hopper) for the backward of ``rbf_kernel_mv``'s exact path at float32
accuracy: every gradient sum from one sweep over the pairs.

Programs own 128 keys (two compute warpgroups of 64) and loop over tiles of 64 queries; with
``A_il = exp2(t_il) (v_i . g_l)`` and the differences ``e_d = x_d - y_d`` (``x`` the keys, ``y``
the queries)::

    sums[d, i] = r_d sum_l A e_d        loop_sums[d, l] = sum_i A e_d (added over the programs)
    pw[i] = sum_l exp2(t) g_l           squares[d, i] = r_d^2 sum_l A e_d^2, or
                                        rows[0, i] = sum_l A t (shared scale)

(``t`` as in ``tilax.rbf.mosaic.exact``, whose layout this kernel shares: coordinates as
row and column vectors of the ``wgmma`` register layout, differences on the FMA units): dk, dv
and the lengthscale's pair-by-pair squares from the program's rows, dq from the loop's columns.
``v . g`` and ``exp2(t) g`` run on the tensor cores from operands split exactly into three
bfloat16 parts (six products, a fresh accumulator a tile, added in float32); ``v . g`` is
issued before the tile's exponents are formed, so that it is ready when they are. The row sums
are float32 multiply-adds, each thread folding a tile's columns onto 8 that it keeps until the
loop ends. The column sums are formed per tile: the second pass (pair weights times
differences) runs in a lane-permuted column order, each thread adds its two rows, butterfly
shuffles halve the columns among a warp's row groups without selects
(``_column_sums_of_permuted``), and each thread adds its two sums into the output with one
vector atomic add (``red.global``), with no shared memory staging and no warpgroup barrier.

This one sweep replaced two that each formed every pair's exponent; what each step of it
gained on the H200 is on docs/performance/rbf.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.rbf import profiles
from tilax.rbf.mosaic.common import (
    BLOCK_P,
    COMPUTE_WARPGROUPS,
    PRODUCTS,
    ROWS_PER_WARPGROUP,
    batch_folding,
    exact_distance_reason,
    launch_on_refs,
    load_in_layout,
    paired_columns,
    paired_keys,
    plgpu,
    rotated_tile,
    row_group,
    scale_rows,
    split3,
    stream_tiles,
    swizzled,
    wgmma_array,
)
from tilax.rbf.numerics import FLOAT32_MAX, Distance

#: Loop tiles in flight.
STAGES = 2
#: Loop tile: a warpgroup's 64 x 64 pairs keep the exponents, kernel values, ``u . w`` and
#: pair weights in registers at once.
BLOCK_L = 64
#: Widest value/cotangent operand (columns).
MAX_COLUMNS = 64
#: Columns the row sums keep until the loop ends (a thread's registers of a ``wgmma`` tile
#: span 8 columns): the adds across a row's threads run once, not every tile.
FOLD = 8


def unsupported_reason(distance: Distance, values: str, columns: int) -> str | None:
    """Why this kernel cannot run a sweep of these settings, or ``None``."""
    if reason := exact_distance_reason(distance, values):
        return reason
    if columns % 16 or columns > MAX_COLUMNS:
        return f"value columns {columns} are not a multiple of 16 up to {MAX_COLUMNS}"
    return None


# The second pass runs in lane-permuted column order: thread ``32 w + L`` keeps the columns of
# 8-column chunk ``j ^ (L >> 2)`` where ``wgmma``'s register layout keeps chunk ``j``, so that
# the column sums' butterfly keeps and sends fixed registers (no selects by lane); see
# ``_column_sums_of_permuted``. The row sums add every chunk of a row and are unchanged.


def _lane_permuted(values: jax.Array, scratch_ref) -> jax.Array:
    """``values: [64, 64]`` (float32, ``wgmma`` layout) in the lane-permuted order, through
    ``scratch_ref: [8, 128, 4]`` (shared memory, one warpgroup's): each thread stores its four
    values of each chunk and loads them back in its own order; no thread reads another's, and
    a warp's 16-byte accesses to one chunk are contiguous (no bank conflicts). In JAX's GPU
    interpreter, ``values`` as they are."""
    if _pallas.interpreted():
        return values
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct(values.shape, jnp.float32,
                                                          layout=plgpu.Layout.WGMMA))
    def permute(ctx, array, ref):
        del ctx
        i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
        _, group = row_group(i32)
        thread = arith.remui(mgpu.utils.thread_idx(), mgpu.c(128, i32))
        base = mgpu.utils.memref_ptr(ref)
        vec4 = ir.VectorType.get((4,), f32)
        regs = array.registers

        def address(chunk):
            return mgpu.utils.getelementptr(
                base, [arith.muli(arith.addi(arith.muli(chunk, mgpu.c(128, i32)), thread),
                                  mgpu.c(4, i32))], f32)

        for j in range(8):
            both = mgpu.utils.vector_concat([regs[0, j, 0, 0, h, 0, 0, 0, 0] for h in range(2)])
            llvm.store(both, address(mgpu.c(j, i32)))
        registers = []
        for j in range(8):
            both = llvm.load(vec4, address(arith.xori(group, mgpu.c(j, i32))))
            registers.append((mgpu.utils.vector_slice(both, slice(0, 2)),
                              mgpu.utils.vector_slice(both, slice(2, 4))))
        return wgmma_array(registers)

    return permute(values, scratch_ref)


def _column_sums_of_permuted(values: jax.Array) -> jax.Array:
    """``values: [64, 64]`` (float32, lane-permuted ``wgmma`` layout) summed over each warp's
    16 rows: ``[4, 64]``, in the layout where thread ``32 w + L`` holds row ``w``'s columns
    ``2L`` and ``2L + 1`` (``WG_STRIDED`` with vectors of two).

    Each thread adds its two rows of a column, then the eight threads that share a column in a
    warp halve their chunks three times with butterfly shuffles: in the permuted order a
    thread keeps its first half of registers and sends the second half, the registers that
    hold its partner's kept chunks (14 shuffles and 14 adds a thread, no selects). In JAX's GPU
    interpreter (plain order) the same sums by ``jnp.sum``."""
    rows, cols = values.shape
    warps = rows // 16
    # Three halving rounds over the eight lanes of a column leave one 8-column chunk a thread.
    assert (rows, cols) == (64, 64), values.shape
    if _pallas.interpreted():
        return jnp.sum(values.reshape(warps, 16, cols), axis=1)
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir.dialects import arith

    layout = plgpu.Layout.WG_STRIDED((warps, cols), vec_size=2)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct((warps, cols), jnp.float32,
                                                          layout=layout))
    def reduce(ctx, array):
        del ctx
        regs = array.registers  # [1, register j, 1, 1, row half h, 1, 1, 1, 1]
        chunks = [arith.addf(regs[0, j, 0, 0, 0, 0, 0, 0, 0], regs[0, j, 0, 0, 1, 0, 0, 0, 0])
                  for j in range(regs.shape[1])]
        # Register j holds chunk j ^ g (g = L >> 2: lane bits 4, 3, 2). The partner at
        # distance 16, 8, 4 has g ^ half (half = 4, 2, 1), so its register j + half (j < half)
        # holds chunk (j + half) ^ g ^ half = j ^ g: the chunk this thread keeps in register j.
        for distance in (16, 8, 4):
            half = len(chunks) // 2
            chunks = [arith.addf(chunks[j], mgpu.utils.shfl_bfly(chunks[j + half], distance))
                      for j in range(half)]
        # Thread L of warp w keeps register 0, chunk g = L >> 2: columns 8 g + 2 (L & 3) +
        # {0, 1}, that is 2 L and 2 L + 1.
        return mgpu.FragmentedArray(_registers=np.asarray(chunks, dtype=object),
                                    _layout=layout.to_mgpu(), _is_signed=None)

    return reduce(values)


def pair_sums(
    x: jax.Array,
    y: jax.Array,
    *,
    distance: Distance,
    valid_l: int,
    scale: jax.Array,
    u: jax.Array,
    w: jax.Array,
    with_squares: bool,
    block_p: int = BLOCK_P,
    block_l: int = BLOCK_L,
    backend: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    profile: str = "rbf",
) -> dict[str, jax.Array]:
    """The sums in the module docstring (for another kernel ``profile`` than the Gaussian,
    ``exp2`` is its values in ``pw`` and its pair weights in ``A``: ``tilax.rbf.profiles``),
    programs over the rows of ``x`` (keys), a loop over the
    tiles of ``y`` (queries), ``u: [B, P, O]`` the keys' values and ``w: [B, L, O]`` the
    cotangents (``A_il = exp2(t_il) (u_i . w_l)``).

    ``x: [B, D, P]`` and ``y: [B, D, L]`` are the exact path's coordinates
    (``vjp.exact_points``), ``scale`` its residual scale, ``u`` and ``w`` float32.
    Returns ``{"sums": [B, D, P], "pw": [B, P, O], "loop_sums": [B, D, 4, L]}`` and with
    ``with_squares`` ``"squares": [B, D, P]`` (per-dimension scale) or ``"rows": [B, 1, P]``;
    ``loop_sums`` holds one row of partial sums a warp, unscaled (the caller adds the rows and
    multiplies by ``r_d``). ``block_p`` and ``block_l`` must be the kernel's; ``backend``,
    ``num_warps`` and ``num_stages`` are not used (one backend, three warpgroups)."""
    del backend, num_warps, num_stages
    batch, dims, num_p = x.shape
    num_l, columns = y.shape[2], u.shape[2]
    reason = unsupported_reason(distance, "tf32x3", columns)
    if reason is None and (block_p != BLOCK_P or block_l != BLOCK_L or num_p % BLOCK_P
                           or num_l % BLOCK_L or dims != distance.dim):
        reason = (f"tiles: P={num_p} by {block_p} (must be {BLOCK_P}), L={num_l} by "
                  f"{block_l} (must be {BLOCK_L}), D={dims}")
    if reason is not None:
        raise ValueError(f"the Mosaic GPU exact RBF pair sums cannot run this: {reason}")
    per_dimension = distance.per_dimension
    squares_out = with_squares and per_dimension
    rows_out = with_squares and not per_dimension
    x = jnp.concatenate([x.astype(jnp.float32), scale_rows(scale, per_dimension, num_p,
                                                            batch)], axis=1)
    y = y.astype(jnp.float32)
    if not _pallas.interpreted():  # (the keys of the program's loop, read in pairs of chunks)
        y = paired_columns(y)
    operands = (x, y, *split3(u.astype(jnp.float32)),
                *split3(w.astype(jnp.float32)))
    launch = functools.partial(_launch_pair_sums, per_dimension=per_dimension,
                               squares_out=squares_out, rows_out=rows_out, valid_l=valid_l,
                               profile=profile)

    def sweep(*operands):
        batch_ = operands[0].shape[0]
        zeros = [jnp.zeros(s, jnp.float32) for s in
                 ((batch_, dims, 4, num_l), (batch_, dims, num_p),
                  (batch_, dims if squares_out else 1, num_p), (batch_, num_p, columns))]
        return tuple(pl.run_state(launch)((*operands, *zeros))[-4:])

    loop_sums, sums, stats, pw = batch_folding(sweep)(*operands)
    out = {"loop_sums": loop_sums, "sums": sums, "pw": pw}
    if with_squares:
        out["squares" if squares_out else "rows"] = stats
    return out


def _launch_pair_sums(refs, *, per_dimension, squares_out, rows_out, valid_l, profile):
    """``pair_sums``'s kernel on the Refs of ``run_state``: ``x, y``, the three parts of ``u``
    and of ``w``, then the zeroed ``loop_sums, sums, stats, pw``."""
    batch, width, num_p = refs[0].shape
    dims = refs[1].shape[1]
    columns = refs[2].shape[2]
    block_l = BLOCK_L
    steps = pl.cdiv(valid_l, block_l)
    full_steps = valid_l // block_l
    stages = max(1, min(STAGES, steps))
    rows = ROWS_PER_WARPGROUP
    programs = num_p // BLOCK_P
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    shape = (rows, block_l)

    def kernel(refs, scoped):
        x_ref, y_ref, u_refs, w_refs = refs[0], refs[1], refs[2:5], refs[5:8]
        loop_out, sums_out, stats_out, pw_out = refs[8:]
        (x_smem2, u_smem, y_smem, w_smem, sums_smem2, stats_smem2, pw_smem2, staging2), \
            (own_ready, y_ready, w_ready), slot_free = scoped
        wg, b, p = lax.axis_index("wg"), lax.axis_index("b"), lax.axis_index("p")
        # Each program starts its loop at another tile, so that the programs running at once
        # add into different columns of the loop sums.
        offset = (p * full_steps) // programs

        def slot_of(step):
            return lax.rem(step, jnp.array(stages, step.dtype))

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            x_smem = x_smem2.at[wg]
            # JAX's GPU interpreter has no rule for atomic stores: there the column sums go
            # through shared memory (``staging``) and a TMA reduction. On the GPU ``staging``
            # is the scratch of ``_lane_permuted``.
            interpreted = _pallas.interpreted()
            staging = staging2.at[wg]
            own = pl.ds(p * BLOCK_P + wg * rows, rows)
            plgpu.copy_gmem_to_smem(x_ref.at[b, :, own], x_smem, own_ready.at[4 * wg])
            for part, u_ref in enumerate(u_refs):
                plgpu.copy_gmem_to_smem(u_ref.at[b, own], u_smem.at[3 * wg + part],
                                        own_ready.at[4 * wg + 1 + part])
            for index in range(4):
                plgpu.barrier_wait(own_ready.at[4 * wg + index])
            points = [load_in_layout(x_smem.at[d], row_layout) for d in range(dims)]
            scales = [load_in_layout(x_smem.at[dims + d], row_layout)
                      for d in range(dims if per_dimension else 1)]

            def differences(slot, d):
                return by_rows(points[d]) - paired_keys(y_smem.at[slot, d], shape)

            def by_rows(vector):
                return lax.broadcast_in_dim(vector, shape, (0,))

            def folded(x, y=None):
                total = None
                for start in range(0, block_l, FOLD):
                    part = x[:, start:start + FOLD]
                    if y is not None:
                        part = part * y[:, start:start + FOLD]
                    total = part if total is None else total + part
                return total

            def step(index, carry, masked):
                sums, squares, stat, pw = carry
                slot = slot_of(index)
                tile = rotated_tile(index, full_steps, offset)
                plgpu.barrier_wait(y_ready.at[slot])
                for part in range(3):
                    plgpu.barrier_wait(w_ready.at[3 * slot + part])

                # The tensor cores run ``u . w`` while the exponents are formed.
                def kernel_and_cotangents(uw_ref):
                    for u_part, w_part in PRODUCTS:
                        plgpu.wgmma(uw_ref, u_smem.at[3 * wg + u_part],
                                    _pallas.transposed_ref(w_smem.at[3 * slot + w_part]))
                    t = None
                    for d in range(dims):
                        e = differences(slot, d)
                        if per_dimension:
                            e = e * by_rows(scales[d])
                        t = (-e) * e if t is None else t - e * e
                    if not per_dimension:
                        t = t * by_rows(scales[0])
                    kernel_values, weights = profiles.values_and_weights(profile, t)
                    if masked:
                        column = plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                                        layout=plgpu.Layout.WGMMA)
                        valid = column + tile * block_l < valid_l
                        kernel_values = jnp.where(valid, kernel_values, 0.0)
                        weights = (kernel_values if profile == "rbf"
                                   else jnp.where(valid, weights, 0.0))
                    return t, kernel_values, weights * uw_ref[...]

                t, kernel_values, a = pl.run_scoped(kernel_and_cotangents,
                                                    plgpu.ACC(shape, jnp.float32))
                p_parts = lax.optimization_barrier(split3(kernel_values))

                def value_products(acc_ref):
                    for p_part, w_part in PRODUCTS:
                        plgpu.wgmma(acc_ref, p_parts[p_part], w_smem.at[3 * slot + w_part])
                    return acc_ref[...]

                pw = pw + pl.run_scoped(value_products, plgpu.ACC((rows, columns), jnp.float32))
                loop_columns = loop_out.at[b, :, :, pl.ds(tile * block_l, block_l)]
                if interpreted:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's are out
                new_sums, new_squares = [], []
                # The pair weights and differences in the lane-permuted column order (the row
                # sums add every column of a row, in any order).
                a_permuted = _lane_permuted(a, staging)
                for d in range(dims):  # unscaled: the residual scale multiplies the sums last
                    e = by_rows(points[d]) - paired_keys(y_smem.at[slot, d], shape,
                                                         lane_permuted=True)
                    ae = a_permuted * e
                    new_sums.append(sums[d] + folded(ae))
                    if squares_out:
                        new_squares.append(squares[d] + folded(ae, e))
                    column_sums = _column_sums_of_permuted(ae)
                    if interpreted:
                        staging.at[d][...] = column_sums
                    else:  # one vector atomic add a thread, from registers
                        plgpu.atomic_add(loop_columns.at[d], column_sums)
                if rows_out:  # (t = -inf beyond float32 would give 0 * inf)
                    stat = stat + folded(a, jnp.maximum(t, -FLOAT32_MAX))
                plgpu.barrier_arrive(slot_free.at[slot])  # every read of the slot is done
                if interpreted:
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(staging, loop_columns, reduction_op="add")
                return tuple(new_sums), tuple(new_squares), stat, pw

            def zeros(shape_):
                return plgpu.layout_cast(jnp.zeros(shape_, jnp.float32), plgpu.Layout.WGMMA)

            partial = (rows, FOLD)
            carry = (tuple(zeros(partial) for _ in range(dims)),
                     tuple(zeros(partial) for _ in range(dims if squares_out else 0)),
                     zeros(partial), zeros((rows, columns)))
            carry = lax.fori_loop(0, full_steps, lambda j, c: step(j, c, False), carry)
            if steps > full_steps:
                carry = step(jnp.int32(full_steps), carry, True)
            sums, squares, stat = jax.tree.map(lambda acc: jnp.sum(acc, axis=1), carry[:3])
            pw = carry[3]
            for d in range(dims):
                residual = scales[d] if per_dimension else None
                sums_smem2.at[wg, d][...] = sums[d] * residual if per_dimension else sums[d]
                if squares_out:
                    stats_smem2.at[wg, d][...] = squares[d] * (residual * residual)
            if rows_out:
                stats_smem2.at[wg, 0][...] = stat
            pw_smem2.at[wg][...] = pw
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(sums_smem2.at[wg], sums_out.at[b, :, own])
            if squares_out or rows_out:
                stat_rows = stats_out.shape[1]
                plgpu.copy_smem_to_gmem(stats_smem2.at[wg, pl.ds(0, stat_rows)],
                                        stats_out.at[b, :, own])
            plgpu.copy_smem_to_gmem(pw_smem2.at[wg], pw_out.at[b, own])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WARPGROUPS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(index, slot):
                tile_rows = pl.ds(rotated_tile(index, full_steps, offset) * block_l, block_l)
                plgpu.copy_gmem_to_smem(y_ref.at[b, :, tile_rows], y_smem.at[slot],
                                        y_ready.at[slot])
                for part, w_ref in enumerate(w_refs):
                    plgpu.copy_gmem_to_smem(w_ref.at[b, tile_rows], w_smem.at[3 * slot + part],
                                            w_ready.at[3 * slot + part])

            stream_tiles(steps, stages, fetch,
                         lambda slot: plgpu.barrier_wait(slot_free.at[slot]))

    def entry(*kernel_refs):
        wgs = COMPUTE_WARPGROUPS
        smem = [
            plgpu.SMEM((wgs, width, rows), jnp.float32),
            plgpu.SMEM((3 * wgs, rows, columns), jnp.bfloat16, transforms=swizzled(columns, 2)),
            plgpu.SMEM((stages, dims, block_l), jnp.float32),
            plgpu.SMEM((3 * stages, block_l, columns), jnp.bfloat16,
                       transforms=swizzled(columns, 2)),
            plgpu.SMEM((wgs, dims, rows), jnp.float32),
            plgpu.SMEM((wgs, dims, rows), jnp.float32),
            plgpu.SMEM((wgs, rows, columns), jnp.float32),
        ]
        if _pallas.interpreted():  # (see ``staging`` in the kernel)
            smem.append(plgpu.SMEM((wgs, dims, 4, block_l), jnp.float32))
        else:
            smem.append(plgpu.SMEM((wgs, 8, 128, 4), jnp.float32))
        barriers = (plgpu.Barrier(num_barriers=4 * wgs), plgpu.Barrier(num_barriers=stages),
                    plgpu.Barrier(num_barriers=3 * stages))
        pl.run_scoped(lambda *scoped: kernel(kernel_refs, scoped), smem, barriers,
                      plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
                      collective_axes="wg")

    launch_on_refs(entry, refs, programs=programs, batch=batch, name="rbf_pair_sums_exact_mosaic")
