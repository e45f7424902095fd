"""Pallas Mosaic GPU kernel (Hopper) for the gradient sweeps of ``rbf_kernel_mv``'s exact path at
float32 accuracy: the sums of ``pallas_triton.kernel_matmul_grad``'s difference case.

One sweep (programs over the rows of one point set, a loop over tiles of the other) forms, for
each program row ``i``, with ``A_il = exp2(t_il) (u_i . w_l)`` and ``e_d = x_d - y_d``::

    sums[d, i] = r_d sum_l A_il e_d                  squares[d, i] = r_d^2 sum_l A_il e_d^2
    rows[0, i] = sum_l A_il t_il (shared scale)      pw[i] = sum_l exp2(t_il) w_l

(``t`` as in ``tilax.rbf.pallas_mosaic_exact``, whose layout this kernel shares: coordinates as
row and column vectors of the ``wgmma`` register layout, differences on the FMA units). The
query sweep (squares or rows on) gives dq and the lengthscale's gradient, the key sweep (``pw``
on) dk and dv. ``u . w`` and ``exp2(t) w`` run on the tensor cores from operands split exactly
into three bfloat16 parts (six products, a fresh accumulator a tile, added in float32); the
sums over ``l`` are float32 multiply-adds, each thread folding a tile's columns onto 8 that it
keeps until the loop ends (no adds across threads per tile).

Runs where an exact path's ``dq`` and ``dk`` launches name ``backend="mosaic"`` (program tile
``BLOCK_P``, loop tile ``BLOCK_L``), as ``pallas_config`` chooses for ``rbf_kernel_mv`` on
Hopper: forward + backward 35.1 ms against 50.7 ms with the Triton sweeps on the H200 (N = M =
65536, D = 8, O = 16), 33.3 ms with the row sums folded per thread.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.rbf.pallas_mosaic import (
    BLOCK_P,
    COMPUTE_WARPGROUPS,
    ROWS_PER_WARPGROUP,
    _tiles,
    _transposed,
    plgpu,
    stream_tiles,
)
from tilax.rbf.pallas_mosaic_exact import (
    PRODUCTS,
    _load,
    distance_reason,
    scale_rows,
    split3,
)
from tilax.rbf.pallas_triton import FLOAT32_MAX, Distance

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
    if reason := distance_reason(distance, values):
        return reason
    if columns % 16 or columns > MAX_COLUMNS:
        return f"value columns {columns} are not a multiple of 16 up to {MAX_COLUMNS}"
    return None


def runs(launch, distance: Distance, values: str, columns: int) -> bool:
    """Whether a sweep of ``launch`` (a ``pallas_config.Launch``) runs here: on a Hopper GPU,
    for settings this kernel supports, with its tiles."""
    return (_pallas.mosaic_unavailable_reason() is None
            and unsupported_reason(distance, values, columns) is None
            and launch.block_p == BLOCK_P and launch.block_l == BLOCK_L)


def kernel_matmul_grad(
    x: jax.Array,
    y: jax.Array,
    *,
    distance: Distance,
    valid_l: int,
    block_p: int,
    block_l: int,
    scale: jax.Array,
    u: jax.Array,
    w: jax.Array,
    values: str,
    with_squares: bool = False,
    with_pw: bool = False,
    backend: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_o: int | None = None,
    coords: str | None = None,
) -> dict[str, jax.Array]:
    """The sums above, as ``pallas_triton.kernel_matmul_grad`` returns them for a
    :class:`~tilax.rbf.pallas_triton.Difference` with cotangents ``u: [B, P, O]`` and values
    ``w: [B, L, O]`` (float32): ``{"sums": [B, D, P]}``, with ``with_squares`` also
    ``"squares": [B, D, P]`` (per-dimension scale) or ``"rows": [B, 1, P]`` (shared), with
    ``with_pw`` also ``"pw": [B, P, O]``. ``backend``, ``num_warps``, ``num_stages``,
    ``block_o`` and ``coords`` are not used (one backend, three warpgroups, every column at
    once, no coordinate products)."""
    del backend, num_warps, num_stages, block_o, coords
    batch, dims, num_p = x.shape
    num_l, columns = y.shape[2], u.shape[2]
    reason = unsupported_reason(distance, values, columns)
    if reason is None and (block_p != BLOCK_P or block_l != BLOCK_L or num_p % block_p
                           or num_l % block_l or dims != distance.dim):
        reason = (f"tiles: P={num_p} by {block_p} (must be {BLOCK_P}), L={num_l} by "
                  f"{block_l} (must be {BLOCK_L}), D={dims}")
    if reason is not None:
        raise ValueError(f"the Mosaic GPU exact RBF gradient sweep cannot run this: {reason}")
    per_dimension = distance.per_dimension
    squares_out = with_squares and per_dimension
    rows_out = with_squares and not per_dimension
    x = jnp.concatenate([x.astype(jnp.float32), scale_rows(scale, per_dimension, num_p,
                                                            batch)], axis=1)
    u_parts, w_parts = split3(u.astype(jnp.float32)), split3(w.astype(jnp.float32))
    steps = pl.cdiv(valid_l, block_l)
    full_steps = valid_l // block_l
    stages = max(1, min(STAGES, steps))
    rows = ROWS_PER_WARPGROUP
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    column_layout = plgpu.Layout.WGMMA.reduce(0)
    shape = (rows, block_l)
    outputs = ["sums", *(["squares"] if squares_out else []), *(["rows"] if rows_out else []),
               *(["pw"] if with_pw else [])]

    def kernel(x_ref, y_ref, u_refs, w_refs, out_refs, scoped):
        (x_smem2, u_smem, y_smem, w_smem, sums_smem2, squares_smem2, pw_smem2), \
            (own_ready, y_ready, w_ready), slot_free = scoped
        wg, b = lax.axis_index("wg"), lax.axis_index("b")
        out = dict(zip(outputs, out_refs, strict=True))

        def slot_of(step):
            return lax.rem(step, jnp.array(stages, step.dtype))

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            x_smem = x_smem2.at[wg]
            own = pl.ds(lax.axis_index("p") * BLOCK_P + wg * rows, rows)
            plgpu.copy_gmem_to_smem(x_ref.at[b, :, own], x_smem, own_ready.at[4 * wg])
            for part, u_ref in enumerate(u_refs):
                plgpu.copy_gmem_to_smem(u_ref.at[b, own], u_smem.at[3 * wg + part],
                                        own_ready.at[4 * wg + 1 + part])
            for index in range(4):
                plgpu.barrier_wait(own_ready.at[4 * wg + index])
            points = [_load(x_smem.at[d], row_layout) for d in range(dims)]
            scales = [_load(x_smem.at[dims + d], row_layout)
                      for d in range(dims if per_dimension else 1)]

            def differences(slot, d):
                key = _load(y_smem.at[slot, d], column_layout)
                return (lax.broadcast_in_dim(points[d], shape, (0,))
                        - lax.broadcast_in_dim(key, shape, (1,)))

            def by_rows(vector):
                return lax.broadcast_in_dim(vector, shape, (0,))

            def folded(x, y=None):
                """The tile's sums of ``x`` (times ``y``) over each row's columns, folded to
                ``FOLD`` columns: each thread adds its own registers (multiply-adds), and the
                adds across threads wait for the end of the loop."""
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
                plgpu.barrier_wait(y_ready.at[slot])
                t = None
                for d in range(dims):
                    e = differences(slot, d)
                    if per_dimension:
                        e = e * by_rows(scales[d])
                    t = (-e) * e if t is None else t - e * e
                if not per_dimension:
                    t = t * by_rows(scales[0])
                p = jnp.exp2(t)
                if masked:
                    column = plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                                    layout=plgpu.Layout.WGMMA)
                    p = jnp.where(column + index * block_l < valid_l, p, 0.0)
                for part in range(3):
                    plgpu.barrier_wait(w_ready.at[3 * slot + part])

                def cotangent_products(acc_ref):
                    for u_part, w_part in PRODUCTS:
                        plgpu.wgmma(acc_ref, u_smem.at[3 * wg + u_part],
                                    _transposed(w_smem.at[3 * slot + w_part]))
                    return acc_ref[...]

                a = p * pl.run_scoped(cotangent_products, plgpu.ACC(shape, jnp.float32))
                if with_pw:
                    p_parts = lax.optimization_barrier(split3(p))

                    def value_products(acc_ref):
                        for p_part, w_part in PRODUCTS:
                            plgpu.wgmma(acc_ref, p_parts[p_part], w_smem.at[3 * slot + w_part])
                        return acc_ref[...]

                    pw = pw + pl.run_scoped(value_products,
                                            plgpu.ACC((rows, columns), jnp.float32))
                new_sums, new_squares = [], []
                for d in range(dims):  # unscaled: the residual scale multiplies the sums last
                    e = differences(slot, d)
                    if squares_out:
                        ae = a * e
                        new_sums.append(sums[d] + folded(ae))
                        new_squares.append(squares[d] + folded(ae, e))
                    else:
                        new_sums.append(sums[d] + folded(a, e))
                if rows_out:  # (t = -inf beyond float32 would give 0 * inf)
                    stat = stat + folded(a, jnp.maximum(t, -FLOAT32_MAX))
                plgpu.barrier_arrive(slot_free.at[slot])  # every read of the slot is done
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
                    squares_smem2.at[wg, d][...] = squares[d] * (residual * residual)
            if rows_out:
                squares_smem2.at[wg, 0][...] = stat
            if with_pw:
                pw_smem2.at[wg][...] = pw
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(sums_smem2.at[wg], out["sums"].at[b, :, own])
            if squares_out or rows_out:
                stats = squares_smem2.at[wg] if squares_out else squares_smem2.at[wg, pl.ds(0, 1)]
                plgpu.copy_smem_to_gmem(stats, out["squares" if squares_out else "rows"].at[
                    b, :, own])
            if with_pw:
                plgpu.copy_smem_to_gmem(pw_smem2.at[wg], out["pw"].at[b, own])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WARPGROUPS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(tile, slot):
                tile_rows = pl.ds(tile * block_l, block_l)
                plgpu.copy_gmem_to_smem(y_ref.at[b, :, tile_rows], y_smem.at[slot],
                                        y_ready.at[slot])
                for part, w_ref in enumerate(w_refs):
                    plgpu.copy_gmem_to_smem(w_ref.at[b, tile_rows], w_smem.at[3 * slot + part],
                                            w_ready.at[3 * slot + part])

            stream_tiles(steps, stages, fetch,
                         lambda slot: plgpu.barrier_wait(slot_free.at[slot]))

    def entry(x_ref, y_ref, u_hi, u_mid, u_lo, w_hi, w_mid, w_lo, *out_refs):
        smem = [
            plgpu.SMEM((COMPUTE_WARPGROUPS, x.shape[1], rows), jnp.float32),
            plgpu.SMEM((3 * COMPUTE_WARPGROUPS, rows, columns), jnp.bfloat16,
                       transforms=_tiles(columns, 2)),
            plgpu.SMEM((stages, dims, block_l), jnp.float32),
            plgpu.SMEM((3 * stages, block_l, columns), jnp.bfloat16,
                       transforms=_tiles(columns, 2)),
            plgpu.SMEM((COMPUTE_WARPGROUPS, dims, rows), jnp.float32),
            plgpu.SMEM((COMPUTE_WARPGROUPS, dims, rows), jnp.float32),
            plgpu.SMEM((COMPUTE_WARPGROUPS, rows, columns), jnp.float32),
        ]
        barriers = (plgpu.Barrier(num_barriers=4 * COMPUTE_WARPGROUPS),
                    plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=3 * stages))
        pl.run_scoped(
            lambda *scoped: kernel(x_ref, y_ref, (u_hi, u_mid, u_lo), (w_hi, w_mid, w_lo),
                                   out_refs, scoped),
            smem,
            barriers,
            plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),
            collective_axes="wg",
        )

    out_shapes = {"sums": (batch, dims, num_p), "squares": (batch, dims, num_p),
                  "rows": (batch, 1, num_p), "pw": (batch, num_p, columns)}
    results = plgpu.kernel(
        entry,
        out_type=tuple(jax.ShapeDtypeStruct(out_shapes[name], jnp.float32)
                       for name in outputs),
        grid=(num_p // BLOCK_P, batch),
        grid_names=("p", "b"),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name="rbf_pair_sums_exact_mosaic",
    )(x, y, *u_parts, *w_parts)
    return dict(zip(outputs, results, strict=True))
