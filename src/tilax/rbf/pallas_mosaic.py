"""Pallas Mosaic GPU kernel (Hopper) for the RBF fast forward: ``out = exp2(x y^T) v``.

The Triton forward runs each key tile as a chain (distance ``wgmma``, a full wait, the exps,
the values ``wgmma``, another full wait), so the tensor cores and the exp unit of one program
never overlap (see docs/performance/rbf.md). This kernel takes FlashAttention-3's shape
(``jax.experimental.pallas.ops.gpu.attention_mgpu``): per program, one memory warpgroup streams
key and value tiles through TMA into a ring of ``KEY_STAGES`` slots, and two compute
warpgroups own 64 query rows each and take turns on the tensor cores (a schedule barrier).
ptxas moves the "done with the exps" arrival above the exps (it depends on no register), so
the turn passes as a warpgroup starts its exps and both warpgroups' exps overlap; that was the
fastest schedule measured on the H200 (docs/performance/rbf.md).

Operands are the Triton forward's (``tilax.rbf.pallas_layout``): the augmented points as TF32
parts ``x: [B, P, W]`` (first) and ``y: [B, L, W]`` (second), so that one TF32 dot gives the
base-2 exponent, and the values ``v: [B, L, O]`` in bfloat16 (the ``"bf16"`` values mode). Keys
at or beyond ``valid_l`` are masked by their index in the last tile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.rbf.pallas_triton import Distance, Expansion

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # tilax imports anyway; _pallas.mosaic_unavailable_reason says why
    plgpu = None

ROWS_PER_WARPGROUP = 64
COMPUTE_WARPGROUPS = 2
#: Rows a program owns: the forward launch's ``block_p`` on this backend.
BLOCK_P = ROWS_PER_WARPGROUP * COMPUTE_WARPGROUPS
#: Widest TF32 parts operand (columns) the kernel's shared memory is planned for.
MAX_WIDTH = 64
#: Key/value tiles in flight (on the H200, two ran faster than three).
KEY_STAGES = 2


def unsupported_reason(distance: Distance, values: str, width: int, block_o: int) -> str | None:
    """Why this kernel cannot run a forward of these settings, or ``None``."""
    if distance != Expansion("tf32_parts"):
        return f"it reads the expansion as TF32 parts, not {distance}"
    if values != "bf16":
        return f"it multiplies values in bfloat16, not {values!r}"
    if width % 16 or width > MAX_WIDTH:
        return f"parts width {width} is not a multiple of 16 up to {MAX_WIDTH}"
    if block_o % 16 or block_o > 256:
        return f"value tile {block_o} is not a multiple of 16 up to 256"
    return None


def runs(launch, distance: Distance, values: str, width: int) -> bool:
    """Whether the fast forward of ``launch`` (a ``pallas_config.Launch``) runs here: on a
    Hopper GPU, for settings this kernel supports, with its program tile."""
    return (_pallas.mosaic_unavailable_reason() is None
            and unsupported_reason(distance, values, width, launch.block_o) is None
            and launch.block_p == BLOCK_P and launch.block_l % 64 == 0)


def _tiles(cols: int, itemsize: int):
    swizzle = plgpu.find_swizzle(cols * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def compiler_params():
    """Settings of every RBF Mosaic GPU kernel: the exp unit's approximate ``exp2``, and no
    warpgroup barriers around each load and store (``unsafe_no_auto_barriers``). Pallas puts
    them there in case a thread reads what another thread of its warpgroup stored; in these
    kernels nothing is read that way except through ``commit_smem`` (which has its own
    barrier), stored operand tiles are reused only after the ``wgmma`` that read them was waited
    for, and ring slots only after mbarriers say they were read. On the H200 the barriers
    (under jax 0.11, two a dimension a tile around the exact sweep's atomic column sums) cost
    4% of a forward+backward at either precision (docs/performance/rbf.md)."""
    return plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True)


def stream_tiles(steps: int, stages: int, fetch, wait_free, *, one_warp: bool = True) -> None:
    """The memory warpgroup's loop: ``fetch(tile, slot)`` the first ``stages`` tiles, then
    each next tile into its slot once ``wait_free(slot)`` returns; at the end, wait for every
    slot's last release (a barrier phase nobody waits for is a bug in the eyes of JAX's GPU
    interpreter, and costs nothing here).

    With ``one_warp`` (on the GPU) one warp of the warpgroup runs it and the other three wait
    at the join: a waiting warp polls its barrier in a loop that takes issue slots from the
    compute warps (2% of them in the exact kernels, as ncu counted on the H200; the exact
    forward+backward ran 1.0% faster so, the fast one 1.2% slower)."""

    def loop():
        for slot in range(stages):
            fetch(slot, slot)

        @pl.loop(0, steps - stages)
        def _(step):
            slot = lax.rem(step, jnp.array(stages, step.dtype))
            wait_free(slot)
            fetch(step + stages, slot)

        for last in range(steps - stages, steps):
            wait_free(last % stages)

    if not one_warp or _pallas.interpreted():  # (the interpreter runs warpgroups, not warps)
        loop()
        return

    @plgpu.warp_map
    def _one_warp(warp):
        pl.when(warp == 0)(loop)


def launch_forward(entry, out_shape: tuple[int, int, int], block_p: int, block_o: int,
                   name: str):
    """``plgpu.kernel`` of a forward kernel ``entry``: float32 ``out_shape`` ``[B, P, O]``,
    grid (P tiles, O tiles, batch), the compute warpgroups and the memory warpgroup, with
    ``compiler_params()``."""
    batch, num_p, num_o = out_shape
    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(num_p // block_p, num_o // block_o, batch),
        grid_names=("p", "o", "b"),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=compiler_params(),
        kernel_name=name,
    )


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
    backend: str = "mosaic",
    scale: jax.Array | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """``out[b, i, :] = sum_{l < valid_l} exp2(x[b, i] . y[b, l]) v[b, l, :]``, float32
    ``[B, P, O]``; the signature of ``pallas_triton.kernel_matmul`` (``backend``, ``scale``,
    ``num_warps`` and ``num_stages`` are not used: one backend, no residual scale, three
    warpgroups, ``KEY_STAGES``)."""
    del backend, num_warps, num_stages
    batch, num_p, width = x.shape
    num_l, num_o = v.shape[1], v.shape[2]
    reason = unsupported_reason(distance, values, width, block_o)
    if reason is None and scale is not None:
        reason = "it takes no residual scale"
    if reason is None and (block_p != BLOCK_P or num_p % block_p or num_l % block_l
                           or num_o % block_o or block_l % 64):
        reason = (f"tiles: P={num_p} by {block_p} (must be {BLOCK_P}), L={num_l} by "
                  f"{block_l} (a multiple of 64), O={num_o} by {block_o}")
    if reason is not None:
        raise ValueError(f"the Mosaic GPU RBF forward cannot run this: {reason}")
    kv_steps = pl.cdiv(valid_l, block_l)
    full_steps = valid_l // block_l
    steps = max(1, min(KEY_STAGES, kv_steps))
    rows = ROWS_PER_WARPGROUP

    def kernel(x_ref, y_ref, v_ref, out_ref, scoped):
        (x_smem2, y_smem, v_smem, o_smem2), (y_ready, v_ready, x_ready), free, turn = scoped
        y_free, v_free = free
        wg, b = lax.axis_index("wg"), lax.axis_index("b")
        cols = pl.ds(lax.axis_index("o") * block_o, block_o)

        def take_turn():
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        def slot_of(step):
            return lax.rem(step, jnp.array(steps, step.dtype))

        def kernel_values(t, kv_step, masked):
            """``exp2(t)`` in bfloat16 for the values dot; in the last tile, keys at or beyond
            ``valid_l`` masked by index. No clamp at 0 (a float32 ``min`` per pair costs 4% of
            the kernel): within the default fast budget an exponent's rounding error leaves
            ``exp2(t)`` below ``1 + 2^-8``, which bfloat16 rounds to 1
            (``numerics.FAST_DISTANCE_BUDGET``)."""
            p = jnp.exp2(t)
            if masked:
                column = plgpu.broadcasted_iota(jnp.int32, (rows, block_l), 1,
                                                layout=plgpu.Layout.WGMMA)
                p = jnp.where(column + kv_step * block_l < valid_l, p, 0.0)
            return lax.optimization_barrier(p.astype(jnp.bfloat16))

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            x_smem, o_smem = x_smem2.at[wg], o_smem2.at[wg]
            own = pl.ds(lax.axis_index("p") * block_p + wg * rows, rows)
            plgpu.copy_gmem_to_smem(x_ref.at[b, own], x_smem, x_ready.at[wg])
            plgpu.barrier_wait(x_ready.at[wg])
            plgpu.barrier_wait(y_ready.at[0])
            pl.when(wg == 1)(take_turn)

            def step(kv_step, acc_ref, masked):
                slot = slot_of(kv_step)

                def exponents(t_ref):
                    plgpu.wgmma(t_ref, x_smem, _pallas.transposed_ref(y_smem.at[slot]))
                    take_turn()
                    return t_ref[...]

                t = pl.run_scoped(exponents, plgpu.ACC((rows, block_l), jnp.float32))
                plgpu.barrier_arrive(y_free.at[slot])
                p16 = kernel_values(t, kv_step, masked)
                plgpu.barrier_arrive(turn)  # "done with the exps" (ptxas issues it earlier)
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(turn)  # the tensor cores are this warpgroup's again
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                following = kv_step + 1

                @pl.when(following < kv_steps)
                def _():
                    plgpu.barrier_wait(y_ready.at[slot_of(following)])

                plgpu.wgmma_wait(0)  # the value tile is read: its slot may be refilled
                plgpu.barrier_arrive(v_free.at[slot])

            def loop(acc_ref):
                @pl.loop(0, full_steps)
                def _(j):
                    step(j, acc_ref, False)

                if kv_steps > full_steps:
                    step(jnp.int32(full_steps), acc_ref, True)
                return acc_ref[...]

            acc = pl.run_scoped(loop, plgpu.ACC((rows, block_o), jnp.float32))
            pl.when(wg == 0)(take_turn)
            o_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[b, own, cols])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WARPGROUPS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(tile, slot):
                keys = pl.ds(tile * block_l, block_l)
                plgpu.copy_gmem_to_smem(y_ref.at[b, keys], y_smem.at[slot], y_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[b, keys, cols], v_smem.at[slot],
                                        v_ready.at[slot])

            def wait_free(slot):
                plgpu.barrier_wait(y_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

            stream_tiles(kv_steps, steps, fetch, wait_free)

    def entry(x_ref, y_ref, v_ref, out_ref):
        smem = [
            plgpu.SMEM((COMPUTE_WARPGROUPS, rows, width), jnp.float32, transforms=_tiles(width, 4)),
            plgpu.SMEM((steps, block_l, width), jnp.float32, transforms=_tiles(width, 4)),
            plgpu.SMEM((steps, block_l, block_o), jnp.bfloat16, transforms=_tiles(block_o, 2)),
            plgpu.SMEM((COMPUTE_WARPGROUPS, rows, block_o), jnp.float32),
        ]
        pl.run_scoped(
            lambda *scoped: kernel(x_ref, y_ref, v_ref, out_ref, scoped),
            smem,
            (plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=steps),
             plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS)),
            (plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=steps),) * 2,
            plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS),
            collective_axes="wg",
        )

    return launch_forward(entry, (batch, num_p, num_o), block_p, block_o,
                          "rbf_kernel_matmul_mosaic")(x, y, v)
