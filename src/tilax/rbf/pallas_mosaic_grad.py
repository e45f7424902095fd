"""Pallas Mosaic GPU kernel (Hopper) for the gradient sweeps of ``rbf_kernel_mv``'s fast path.

One sweep (programs over the rows of one point set, a loop over tiles of the other) forms, for
each program row ``i``, the pair sums of ``pallas_triton.kernel_matmul_grad``'s expansion case::

    A_il = exp2(min(x_i . y_l, 0)) (u_i . w_l)
    sums_i = sum_l A_il c_l            pw_i = sum_l exp2(min(x_i . y_l, 0)) w_l

with ``x``, ``y`` the augmented points as TF32 parts (one TF32 dot gives the base-2 exponent,
as in the forward), ``u``, ``w`` the cotangents and values in bfloat16 (the ``"bf16"`` values
mode) and ``c`` the loop's augmented points, multiplied in bfloat16 x 3 (``a_lo c_hi + a_hi c_lo
+ a_hi c_hi``: the ``"bf16x3"`` coords mode). The query sweep (programs over queries) gives dq,
the key sweep (programs over keys, ``pw`` on) dk and dv.

The shape is the forward's (``tilax.rbf.pallas_mosaic``): a memory warpgroup streams the loop
tiles through TMA into ``STAGES`` slots, two compute warpgroups own 64 rows each and take turns
on the tensor cores, so that one's exps and pair weights run while the other's dots do.

Runs where a path's ``dq`` and ``dk`` launches name ``backend="mosaic"`` (program tile 128).
``pallas_config.default_config`` chooses it for ``rbf_kernel_mv`` wherever it runs (:func:`runs`)
with loop tiles of ``BLOCK_L``: on the H200 at N = M = 65536, D = 8, O = 16 the fwd_bwd call
took 8.38 ms with it against 10.74 ms on the Triton sweeps' default launch (the
``kernel_mv_launches`` bench suite's ``fast_bwd-mosaic`` rows; see the methodology page).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.rbf.pallas_dots import split
from tilax.rbf.pallas_mosaic import (
    BLOCK_P,
    COMPUTE_WARPGROUPS,
    MAX_WIDTH,
    ROWS_PER_WARPGROUP,
    _tiles,
    _transposed,
    plgpu,
    stream_tiles,
)

#: Loop tiles in flight.
STAGES = 2
#: Widest value/cotangent operand (columns): every column is in one program's registers.
MAX_COLUMNS = 64
#: Default loop tile (the faster of 64 and 128 on the H200).
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


def _bfloat16_bits(bits: jax.Array) -> jax.Array:
    """The bfloat16 whose bits are the high half of ``bits`` (uint32): float32 truncated."""
    return lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)


def _truncated_split(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a`` (float32) as bfloat16 ``(hi, lo)`` with ``|a - hi - lo| < 2^-15 |a|`` (``a`` and
    the rest normal numbers; rounding would give 2^-17, and the values and cotangents the pair
    weights come from are bfloat16, 2^-9), by truncation: integer operations on the ALU.
    Conversion instructions run on the exp unit (XU), which the exps keep busy already (ncu on
    the H200: with two conversions per pair it was the sweep's busiest pipe, 72%)."""
    bits = lax.bitcast_convert_type(a, jnp.uint32)
    rest = a - lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), jnp.float32)  # exact
    return _bfloat16_bits(bits), _bfloat16_bits(lax.bitcast_convert_type(rest, jnp.uint32))


def runs(launch, values: str, coords: str, parts_width: int, coords_width: int,
         columns: int) -> bool:
    """Whether a sweep of ``launch`` (a ``pallas_config.Launch``) runs here: on a Hopper GPU,
    for a path whose values are multiplied in bfloat16 and coordinates in bfloat16 x 3 (the
    default precision's), at widths this kernel supports, with its program tile."""
    return (_pallas.mosaic_unavailable_reason() is None
            and (values, coords) == ("bf16", "bf16x3")
            and unsupported_reason(parts_width, coords_width, columns, launch.block_l) is None
            and launch.block_p == BLOCK_P)


def pair_sums(
    x: jax.Array,
    y: jax.Array,
    coords: jax.Array,
    u: jax.Array,
    w: jax.Array,
    *,
    valid_l: int,
    block_l: int = 64,
    with_pw: bool = False,
    block_p: int = BLOCK_P,
    backend: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> dict[str, jax.Array]:
    """The sums above: ``{"sums": [B, P, C]}`` (and ``"pw": [B, P, O]`` with ``with_pw``),
    float32, for ``x: [B, P, W]``, ``y: [B, L, W]`` (TF32 parts, float32), ``coords: [B, L, C]``
    (float32), ``u: [B, P, O]`` and ``w: [B, L, O]`` (bfloat16). ``P`` is a multiple of
    ``BLOCK_P`` (the program tile, ``block_p``), ``L`` of ``block_l``; loop rows at or beyond
    ``valid_l`` are masked by index. ``backend``, ``num_warps`` and ``num_stages`` (a
    ``pallas_config.Launch``'s) are not used: one backend, three warpgroups, ``STAGES``."""
    del backend, num_warps, num_stages
    batch, num_p, width = x.shape
    num_l, coords_width, columns = y.shape[1], coords.shape[2], u.shape[2]
    reason = unsupported_reason(width, coords_width, columns, block_l)
    if reason is None and block_p != BLOCK_P:
        reason = f"program tile {block_p} (must be {BLOCK_P})"
    if reason is None and (num_p % BLOCK_P or num_l % block_l):
        reason = f"rows: P={num_p} by {BLOCK_P}, L={num_l} by {block_l}"
    if reason is not None:
        raise ValueError(f"the Mosaic GPU RBF gradient sweep cannot run this: {reason}")
    c_hi, c_lo = split(coords.astype(jnp.float32), "bf16x3")
    u, w = u.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    steps = pl.cdiv(valid_l, block_l)
    full_steps = valid_l // block_l
    stages = max(1, min(STAGES, steps))
    rows = ROWS_PER_WARPGROUP

    def kernel(x_ref, y_ref, chi_ref, clo_ref, u_ref, w_ref, out_refs, scoped):
        (x_smem2, u_smem2, y_smem, w_smem, chi_smem, clo_smem, sums_smem2, pw_smem2), \
            barriers, slot_free, turn = scoped
        y_ready, w_ready, c_ready, own_ready = barriers
        wg, b = lax.axis_index("wg"), lax.axis_index("b")

        def take_turn():
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        def slot_of(step):
            return lax.rem(step, jnp.array(stages, step.dtype))

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            x_smem, u_smem = x_smem2.at[wg], u_smem2.at[wg]
            own = pl.ds(lax.axis_index("p") * BLOCK_P + wg * rows, rows)
            plgpu.copy_gmem_to_smem(x_ref.at[b, own], x_smem, own_ready.at[wg])
            plgpu.copy_gmem_to_smem(u_ref.at[b, own], u_smem, own_ready.at[wg + 2])
            plgpu.barrier_wait(own_ready.at[wg])
            plgpu.barrier_wait(own_ready.at[wg + 2])
            plgpu.barrier_wait(y_ready.at[0])
            plgpu.barrier_wait(w_ready.at[0])
            pl.when(wg == 1)(take_turn)

            def step(index, sums_ref, pw_ref, masked):
                slot = slot_of(index)

                def scores(t_ref, uw_ref):
                    plgpu.wgmma(t_ref, x_smem, _transposed(y_smem.at[slot]))
                    plgpu.wgmma(uw_ref, u_smem, _transposed(w_smem.at[slot]))
                    take_turn()
                    return t_ref[...], uw_ref[...]

                t, uw = pl.run_scoped(scores, plgpu.ACC((rows, block_l), jnp.float32),
                                      plgpu.ACC((rows, block_l), jnp.float32))
                p = jnp.exp2(jnp.minimum(t, 0.0))
                if masked:
                    column = plgpu.broadcasted_iota(jnp.int32, (rows, block_l), 1,
                                                    layout=plgpu.Layout.WGMMA)
                    p = jnp.where(column + index * block_l < valid_l, p, 0.0)
                a_hi, a_lo = lax.optimization_barrier(_truncated_split(p * uw))
                p16 = lax.optimization_barrier(p.astype(jnp.bfloat16)) if with_pw else None
                plgpu.barrier_arrive(turn)  # done with the exps
                plgpu.barrier_wait(c_ready.at[slot])
                plgpu.barrier_wait(c_ready.at[slot + stages])
                plgpu.barrier_wait(turn)  # the tensor cores are this warpgroup's again
                # small terms first
                plgpu.wgmma(sums_ref, a_lo, chi_smem.at[slot])
                plgpu.wgmma(sums_ref, a_hi, clo_smem.at[slot])
                plgpu.wgmma(sums_ref, a_hi, chi_smem.at[slot])
                if with_pw:
                    plgpu.wgmma(pw_ref, p16, w_smem.at[slot])
                following = index + 1

                @pl.when(following < steps)
                def _():
                    plgpu.barrier_wait(y_ready.at[slot_of(following)])
                    plgpu.barrier_wait(w_ready.at[slot_of(following)])

                plgpu.wgmma_wait(0)  # the slot is read: it may be refilled
                plgpu.barrier_arrive(slot_free.at[slot])

            def loop(sums_ref, pw_ref):
                @pl.loop(0, full_steps)
                def _(j):
                    step(j, sums_ref, pw_ref, False)

                if steps > full_steps:
                    step(jnp.int32(full_steps), sums_ref, pw_ref, True)
                return sums_ref[...], (pw_ref[...] if with_pw else None)

            accs = [plgpu.ACC((rows, coords_width), jnp.float32)]
            accs.append(plgpu.ACC((rows, columns), jnp.float32) if with_pw else None)
            sums, pw = pl.run_scoped(loop, *accs) if with_pw else pl.run_scoped(
                lambda sums_ref: loop(sums_ref, None), accs[0])
            pl.when(wg == 0)(take_turn)
            sums_smem2.at[wg][...] = sums
            if with_pw:
                pw_smem2.at[wg][...] = pw
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(sums_smem2.at[wg], out_refs[0].at[b, own])
            if with_pw:
                plgpu.copy_smem_to_gmem(pw_smem2.at[wg], out_refs[1].at[b, own])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WARPGROUPS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(tile, slot):
                tile_rows = pl.ds(tile * block_l, block_l)
                plgpu.copy_gmem_to_smem(y_ref.at[b, tile_rows], y_smem.at[slot],
                                        y_ready.at[slot])
                plgpu.copy_gmem_to_smem(w_ref.at[b, tile_rows], w_smem.at[slot],
                                        w_ready.at[slot])
                plgpu.copy_gmem_to_smem(chi_ref.at[b, tile_rows], chi_smem.at[slot],
                                        c_ready.at[slot])
                plgpu.copy_gmem_to_smem(clo_ref.at[b, tile_rows], clo_smem.at[slot],
                                        c_ready.at[slot + stages])

            stream_tiles(steps, stages, fetch, lambda slot: plgpu.barrier_wait(slot_free.at[slot]))

    def entry(x_ref, y_ref, chi_ref, clo_ref, u_ref, w_ref, *out_refs):
        smem = [
            plgpu.SMEM((COMPUTE_WARPGROUPS, rows, width), jnp.float32, transforms=_tiles(width, 4)),
            plgpu.SMEM((COMPUTE_WARPGROUPS, rows, columns), jnp.bfloat16,
                       transforms=_tiles(columns, 2)),
            plgpu.SMEM((stages, block_l, width), jnp.float32, transforms=_tiles(width, 4)),
            plgpu.SMEM((stages, block_l, columns), jnp.bfloat16, transforms=_tiles(columns, 2)),
            plgpu.SMEM((stages, block_l, coords_width), jnp.bfloat16,
                       transforms=_tiles(coords_width, 2)),
            plgpu.SMEM((stages, block_l, coords_width), jnp.bfloat16,
                       transforms=_tiles(coords_width, 2)),
            plgpu.SMEM((COMPUTE_WARPGROUPS, rows, coords_width), jnp.float32),
            plgpu.SMEM((COMPUTE_WARPGROUPS, rows, columns if with_pw else 16), jnp.float32),
        ]
        barriers = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                    plgpu.Barrier(num_barriers=2 * stages),
                    plgpu.Barrier(num_barriers=2 * COMPUTE_WARPGROUPS))
        pl.run_scoped(
            lambda *scoped: kernel(x_ref, y_ref, chi_ref, clo_ref, u_ref, w_ref, out_refs,
                                   scoped),
            smem,
            barriers,
            plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS),
            collective_axes="wg",
        )

    out_types = [jax.ShapeDtypeStruct((batch, num_p, coords_width), jnp.float32)]
    if with_pw:
        out_types.append(jax.ShapeDtypeStruct((batch, num_p, columns), jnp.float32))
    results = plgpu.kernel(
        entry,
        out_type=tuple(out_types),
        grid=(num_p // BLOCK_P, batch),
        grid_names=("p", "b"),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name="rbf_pair_sums_mosaic",
    )(x, y, c_hi, c_lo, u, w)
    return dict(zip(("sums", "pw"), results, strict=False))
