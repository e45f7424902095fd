"""The shared expert's SwiGLU products on Mosaic GPU (Hopper): the activation and its backward
in the products' epilogues.

The shared expert is a dense SwiGLU over every token (``reference.shared_expert``). On XLA its
gate and up products write ``[T, S]`` arrays that an elementwise pass reads back for the
activation, and in the backward the down projection's input gradient is written and read back
by two more passes with the saved products. Here two kernels do those passes in the products'
epilogues:

- :func:`swiglu_forward`: ``gate = x @ w_gate``, ``up = x @ w_up`` and
  ``silu(gate) * up``, the three written from registers (gate and up are the backward's
  residuals);
- :func:`swiglu_backward`: ``dz = dy @ w_down.T`` with the SwiGLU backward in the epilogue,
  the gate and up tiles landing by TMA while the contraction runs; the gate and up
  gradients leave side by side as one ``[T, 2S]`` array, so that the input gradient and the
  two weight gradients are one XLA product each against the weights side by side.

Both are warp-specialised as ``mosaic.gmm_ws``: one program per SM, a memory warpgroup
streaming every (item, contraction step) of the program's items through one ring of SMEM
slots, and two compute warpgroups, each owning 64 of an item's 128 rows (``wgmma``'s rows per
warpgroup) and all of its columns. An item is a 128-row tile by ``BLOCK_N`` columns of ``S``;
the column tiles of one row tile are neighbours, so its rows meet in L2.
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
WG_ROWS = common.WGMMA_ROWS
BLOCK_M = COMPUTE_WARPGROUPS * WG_ROWS
BLOCK_N = 128
BLOCK_K = 64
# The forward's epilogue stores 64-column pieces through two staging slots per warpgroup.
EPI_N = 64
MEMORY_REGISTERS = 40
MAX_STAGES = 4


def applies(x: jax.Array, shared: dict) -> bool:
    """Whether the kernels take these shapes and dtypes: 16-bit, tokens a multiple of 128,
    ``d_model`` of 64 and the hidden width of ``BLOCK_N``."""
    d_dim, s_dim = shared["w_gate"].shape
    return (
        jnp.dtype(x.dtype) in (jnp.bfloat16, jnp.float16)
        and all(w.dtype == x.dtype for w in shared.values())
        and x.shape[0] % BLOCK_M == 0 and d_dim % BLOCK_K == 0 and s_dim % BLOCK_N == 0
    )


def _stages(stage_bytes: int, live_bytes: int) -> int:
    budget = common.whole_block_smem() - live_bytes
    stages = min(MAX_STAGES, budget // stage_bytes)
    if stages < 2:
        raise ValueError(f"no room for two pipeline stages of {stage_bytes} bytes")
    return stages


def _warp_specialised(body, out_type, name: str):
    return plgpu.kernel(
        body, out_type=out_type, grid=(common.sm_count(),), grid_names=("sm",),
        num_threads=COMPUTE_WARPGROUPS + 1, thread_name="wg", kernel_name=name,
        compiler_params=common.compiler_params(),
    )


def _coordinates(total: int, n_tiles: int, k_steps: int):
    """``(items of this program, coords)``: ``coords(step)`` is the (row tile, column tile,
    contraction step) of a pipeline step of this program."""
    program, programs = lax.axis_index("sm"), common.sm_count()
    my_items = (total - program + programs - 1) // programs

    def coords(step):
        flat = program + (step // k_steps) * programs
        return flat // n_tiles, flat % n_tiles, step % k_steps

    return my_items, coords


def _pipeline(step_fn, context, specs, num_steps, stages):
    return plgpu.emit_pipeline_warp_specialized(
        step_fn, grid=(num_steps,), memory_registers=MEMORY_REGISTERS, in_specs=specs,
        max_concurrent_steps=stages, wg_axis="wg", num_compute_wgs=COMPUTE_WARPGROUPS,
        compute_context=context,
    )


def _run(pipeline, refs, scope, **scratch) -> None:
    """Run ``scope(allocations, **scratch)`` with the pipeline's ring allocated once for all
    warpgroups."""

    def ignore(*_, **__):
        return None

    pl.run_scoped(scope, allocations=pipeline(ignore, ignore).get_allocations(*refs),
                  collective_axes="wg", **scratch)


def swiglu_forward(x: jax.Array, w_gate: jax.Array, w_up: jax.Array):
    """``(silu(gate) * up, gate, up)`` with ``gate = x @ w_gate`` and ``up = x @ w_up``, each
    ``[T, S]`` in ``x.dtype`` (the activation from the float32 products)."""
    num_rows, d_dim = x.shape
    s_dim = w_gate.shape[1]
    n_tiles, k_steps = s_dim // BLOCK_N, d_dim // BLOCK_K
    total = (num_rows // BLOCK_M) * n_tiles
    dtype = x.dtype
    stage_bytes = (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * dtype.itemsize
    staging_shape = (COMPUTE_WARPGROUPS, 2, WG_ROWS, EPI_N)
    stages = _stages(stage_bytes, 2 * WG_ROWS * EPI_N * COMPUTE_WARPGROUPS * dtype.itemsize)

    def body(x_g, wg_g, wu_g, act_g, gate_g, up_g):
        my_items, coords = _coordinates(total, n_tiles, k_steps)

        def x_block(step):
            m, _, k = coords(step)
            return m, k

        def w_block(step):
            _, n, k = coords(step)
            return k, n

        specs = [
            plgpu.BlockSpec((BLOCK_M, BLOCK_K), x_block,
                            transforms=common.mma_transforms(BLOCK_K, dtype)),
            plgpu.BlockSpec((BLOCK_K, BLOCK_N), w_block,
                            transforms=common.mma_transforms(BLOCK_N, dtype)),
            plgpu.BlockSpec((BLOCK_K, BLOCK_N), w_block,
                            transforms=common.mma_transforms(BLOCK_N, dtype)),
        ]

        def pipeline(step_fn, context):
            return _pipeline(step_fn, context, specs, my_items * k_steps, stages)

        def scope(allocations, staging):
            wg = lax.axis_index("wg")
            rows = pl.ds(wg * WG_ROWS, WG_ROWS)

            def step_fn(indices, x_smem, wg_smem, wu_smem, accs):
                acc_gate, acc_up = accs
                (step,) = indices
                k = step % k_steps

                @pl.when(k == 0)
                def _zero():
                    acc_gate[...] = jnp.zeros(acc_gate.shape, jnp.float32)
                    acc_up[...] = jnp.zeros(acc_up.shape, jnp.float32)

                plgpu.wgmma(acc_gate, x_smem.at[rows], wg_smem)
                plgpu.wgmma(acc_up, x_smem.at[rows], wu_smem)
                # The ring slot is released when this returns: the MMAs must have read it.
                plgpu.wgmma_wait(0)

                @pl.when(k == k_steps - 1)
                def _epilogue():
                    m, n, _ = coords(step)
                    row_start = m * BLOCK_M + wg * WG_ROWS
                    gate, up = acc_gate[...], acc_up[...]
                    slot = 0
                    for col in range(0, BLOCK_N, EPI_N):
                        gate_c, up_c = gate[:, col:col + EPI_N], up[:, col:col + EPI_N]
                        act_c = common.swiglu_parts(gate_c, up_c)[2]
                        for out_g, value in ((gate_g, gate_c), (up_g, up_c), (act_g, act_c)):
                            # The store two back read this slot.
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            staging.at[wg, slot][...] = value.astype(dtype)
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(
                                staging.at[wg, slot],
                                out_g.at[pl.ds(row_start, WG_ROWS),
                                         pl.ds(n * BLOCK_N + col, EPI_N)],
                            )
                            slot = 1 - slot

                return accs

            def context(run):
                pl.run_scoped(lambda g, u: run((g, u)), plgpu.ACC((WG_ROWS, BLOCK_N)),
                              plgpu.ACC((WG_ROWS, BLOCK_N)))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pipeline(step_fn, context)(x_g, wg_g, wu_g, allocations=allocations)

        _run(pipeline, (x_g, wg_g, wu_g), scope,
             staging=plgpu.SMEM(staging_shape, dtype,
                                transforms=common.mma_transforms(EPI_N, dtype)))

    out = jax.ShapeDtypeStruct((num_rows, s_dim), dtype)
    kernel = _warp_specialised(body, [out, out, out], "shared_swiglu_fwd_mosaic")
    return tuple(kernel(x, w_gate, w_up))


def swiglu_backward(dy: jax.Array, w_down: jax.Array, gate: jax.Array, up: jax.Array):
    """The gate and up gradients of ``(silu(gate) * up) @ w_down`` given ``dy``, side by side:
    ``[T, 2S]`` in ``gate.dtype`` (``[:, :S]`` the gate's, ``[:, S:]`` the up's)."""
    num_rows, d_dim = dy.shape
    s_dim = w_down.shape[0]
    n_tiles, k_steps = s_dim // BLOCK_N, d_dim // BLOCK_K
    total = (num_rows // BLOCK_M) * n_tiles
    dtype = gate.dtype
    stage_bytes = (BLOCK_M + BLOCK_N) * BLOCK_K * dtype.itemsize
    tiles_shape = (COMPUTE_WARPGROUPS, 2, WG_ROWS, BLOCK_N)
    stages = _stages(stage_bytes, 2 * BLOCK_M * BLOCK_N * dtype.itemsize)

    def body(dy_g, w_g, gate_g, up_g, out_g):
        my_items, coords = _coordinates(total, n_tiles, k_steps)

        def dy_block(step):
            m, _, k = coords(step)
            return m, k

        def w_block(step):
            _, n, k = coords(step)
            return n, k

        specs = [
            plgpu.BlockSpec((BLOCK_M, BLOCK_K), dy_block,
                            transforms=common.mma_transforms(BLOCK_K, dtype)),
            plgpu.BlockSpec((BLOCK_N, BLOCK_K), w_block,
                            transforms=common.mma_transforms(BLOCK_K, dtype)),
        ]

        def pipeline(step_fn, context):
            return _pipeline(step_fn, context, specs, my_items * k_steps, stages)

        def scope(allocations, tiles, landed):
            wg = lax.axis_index("wg")
            rows = pl.ds(wg * WG_ROWS, WG_ROWS)
            gate_smem, up_smem = tiles.at[wg, 0], tiles.at[wg, 1]

            def views(step):
                m, n, _ = coords(step)
                row_view = pl.ds(m * BLOCK_M + wg * WG_ROWS, WG_ROWS)
                return row_view, n * BLOCK_N

            def step_fn(indices, dy_smem, w_smem, acc):
                (step,) = indices
                k = step % k_steps

                @pl.when(k == 0)
                def _start():
                    acc[...] = jnp.zeros(acc.shape, jnp.float32)
                    row_view, col = views(step)
                    # The previous item's gradients left from these tiles.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    plgpu.copy_gmem_to_smem(gate_g.at[row_view, pl.ds(col, BLOCK_N)], gate_smem,
                                            landed.at[wg])
                    plgpu.copy_gmem_to_smem(up_g.at[row_view, pl.ds(col, BLOCK_N)], up_smem,
                                            landed.at[wg])

                plgpu.wgmma(acc, dy_smem.at[rows], _pallas.transposed_ref(w_smem))
                plgpu.wgmma_wait(0)

                @pl.when(k == k_steps - 1)
                def _epilogue():
                    row_view, col = views(step)
                    dz = acc[...]
                    plgpu.barrier_wait(landed.at[wg])
                    for c in range(0, BLOCK_N, EPI_N):
                        cols = pl.ds(c, EPI_N)
                        dz_c = dz[:, c:c + EPI_N]
                        gate_c = gate_smem.at[:, cols][...].astype(jnp.float32)
                        up_c = up_smem.at[:, cols][...].astype(jnp.float32)
                        sig, silu, _ = common.swiglu_parts(gate_c, up_c)
                        # Each thread rewrites the elements it read: the tiles become the
                        # gradients in place.
                        up_smem.at[:, cols][...] = (dz_c * silu).astype(dtype)
                        d_gate = dz_c * up_c * (sig * (1.0 + gate_c * (1.0 - sig)))
                        gate_smem.at[:, cols][...] = d_gate.astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(gate_smem,
                                            out_g.at[row_view, pl.ds(col, BLOCK_N)])
                    plgpu.copy_smem_to_gmem(up_smem,
                                            out_g.at[row_view, pl.ds(s_dim + col, BLOCK_N)])

                return acc

            def context(run):
                pl.run_scoped(run, plgpu.ACC((WG_ROWS, BLOCK_N)))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pipeline(step_fn, context)(dy_g, w_g, allocations=allocations)

        _run(pipeline, (dy_g, w_g), scope,
             tiles=plgpu.SMEM(tiles_shape, dtype, transforms=common.mma_transforms(BLOCK_N, dtype)),
             landed=plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WARPGROUPS))

    out = jax.ShapeDtypeStruct((num_rows, 2 * s_dim), dtype)
    return _warp_specialised(body, out, "shared_swiglu_bwd_mosaic")(dy, w_down, gate, up)


@jax.custom_vjp
def shared_expert(x, w_gate, w_up, w_down):
    """``(silu(x @ w_gate) * (x @ w_up)) @ w_down`` in ``x.dtype``: ``reference.shared_expert``
    with the SwiGLU in the kernels' epilogues."""
    return _forward(x, w_gate, w_up, w_down)[0]


def _product(a, b, spec):
    return jnp.einsum(spec, a, b, preferred_element_type=a.dtype)


def _forward(x, w_gate, w_up, w_down):
    act, gate, up = swiglu_forward(x, w_gate, w_up)
    return _product(act, w_down, "ts,sd->td"), (x, w_gate, w_up, w_down, act, gate, up)


def _backward(residuals, dy):
    x, w_gate, w_up, w_down, act, gate, up = residuals
    dy = dy.astype(x.dtype)
    d_gate_up = swiglu_backward(dy, w_down, gate, up)
    w_gate_up = jnp.concatenate([w_gate, w_up], axis=1)
    dx = _product(d_gate_up, w_gate_up, "ts,ds->td")
    dw_gate_up = _product(x, d_gate_up, "td,ts->ds")
    s_dim = w_gate.shape[1]
    return (dx, dw_gate_up[:, :s_dim], dw_gate_up[:, s_dim:],
            _product(act, dy, "ts,td->sd"))


shared_expert.defvjp(_forward, _backward)
