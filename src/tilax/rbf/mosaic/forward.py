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

Operands are the Triton forward's (``tilax.rbf.vjp`` builds them): the augmented points as TF32
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
from tilax.rbf import profiles
from tilax.rbf.mosaic.common import (
    BLOCK_P,
    COMPUTE_WARPGROUPS,
    MAX_WIDTH,
    ROWS_PER_WARPGROUP,
    launch_forward,
    plgpu,
    stream_tiles,
    swizzled,
)
from tilax.rbf.numerics import Distance, Expansion

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
    profile: str = "rbf",
) -> jax.Array:
    """``out[b, i, :] = sum_{l < valid_l} k(x[b, i] . y[b, l]) v[b, l, :]``, float32
    ``[B, P, O]``, ``k`` the kernel ``profile`` of the base-2 exponent (``exp2`` for the
    Gaussian kernel; ``tilax.rbf.profiles``); the signature of
    ``tilax.rbf.triton.kernel_matmul`` (``backend``, ``scale``, ``num_warps`` and
    ``num_stages`` are not used: one backend, no residual scale, three warpgroups,
    ``KEY_STAGES``)."""
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
            """The kernel values (``exp2(t)`` for the Gaussian kernel) in bfloat16 for the
            values dot; in the last tile, keys at or beyond ``valid_l`` masked by index. No
            clamp at 0 (a float32 ``min`` per pair costs 4% of the kernel): within the default
            fast budget an exponent's rounding error leaves ``exp2(t)`` below ``1 + 2^-8``,
            which bfloat16 rounds to 1 (``numerics.FAST_DISTANCE_BUDGET``); a Matérn value
            is at most 1 up to the exp unit's rounding, which bfloat16 rounds away too (no
            clamp at 1: ``clamp=False``)."""
            p = profiles.kernel_values(profile, t, clamp=False, fast=True)
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
            plgpu.SMEM((COMPUTE_WARPGROUPS, rows, width), jnp.float32,
                       transforms=swizzled(width, 4)),
            plgpu.SMEM((steps, block_l, width), jnp.float32, transforms=swizzled(width, 4)),
            plgpu.SMEM((steps, block_l, block_o), jnp.bfloat16, transforms=swizzled(block_o, 2)),
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
