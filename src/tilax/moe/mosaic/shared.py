"""The shared expert's products on Mosaic GPU (Hopper): the activation and its backward in the
products' epilogues.

The shared expert is a dense expert over every token (``reference.shared_expert``) of the
layer's activation (``MoEConfig.activation``, from ``tilax.moe.activations``). On XLA its gate
and up products write ``[T, S]`` arrays that an elementwise pass reads back for the
activation, and in the backward the down projection's input gradient is written and read back
by two more passes with the saved products. Here two kernels do those passes in the products'
epilogues:

- :func:`activation_forward`: ``gate = x @ w_gate``, ``up = x @ w_up`` and the activation
  (``silu(gate) * up`` for SwiGLU), the three written from registers (gate and up are the
  backward's residuals);
- :func:`activation_backward`: ``dz = dy @ w_down.T`` with the activation's backward in the
  epilogue, the gate and up tiles landing by TMA while the contraction runs; the gate and up
  gradients leave side by side as one ``[T, 2S]`` array, so that the input gradient and the
  two weight gradients are one XLA product each against the weights side by side.

The not-gated ``"gelu"`` has no ``w_gate``: the same kernels run the up product alone (one
accumulator, one pre-activation written and read back, a ``[T, S]`` gradient).

Both are warp-specialised as ``mosaic.gmm_ws``: one program per SM, a memory warpgroup
streaming every (item, contraction step) of the program's items through one ring of SMEM
slots, and two compute warpgroups, each owning 64 of an item's 128 rows (``wgmma``'s rows per
warpgroup) and all of its columns. An item is a 128-row tile by ``BLOCK_N`` columns of ``S``;
the column tiles of one row tile are neighbours, so its rows meet in L2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.moe import activations
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
    d_dim, s_dim = shared["w_up"].shape
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


def activation_forward(activation: str, x: jax.Array, w_gate: jax.Array | None,
                       w_up: jax.Array):
    """``(a, gate, up)`` with ``gate = x @ w_gate``, ``up = x @ w_up`` and ``a`` the
    activation (``activations.hidden``: ``silu(gate) * up`` for ``"swiglu"``), each ``[T, S]``
    in ``x.dtype`` (the activation from the float32 products); ``gate`` is ``None`` (and
    ``w_gate``) for the not-gated ``"gelu"``."""
    gated = activations.check_gate(activation, w_gate, "w_gate")
    weights = [w_gate, w_up] if gated else [w_up]
    num_w = len(weights)
    num_rows, d_dim = x.shape
    s_dim = w_up.shape[1]
    n_tiles, k_steps = s_dim // BLOCK_N, d_dim // BLOCK_K
    total = (num_rows // BLOCK_M) * n_tiles
    dtype = x.dtype
    stage_bytes = (BLOCK_M + num_w * BLOCK_N) * BLOCK_K * dtype.itemsize
    staging_shape = (COMPUTE_WARPGROUPS, 2, WG_ROWS, EPI_N)
    stages = _stages(stage_bytes, 2 * WG_ROWS * EPI_N * COMPUTE_WARPGROUPS * dtype.itemsize)

    def body(x_g, *refs):
        w_gs, act_g, pre_gs = refs[:num_w], refs[num_w], refs[num_w + 1:]
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
            *[plgpu.BlockSpec((BLOCK_K, BLOCK_N), w_block,
                              transforms=common.mma_transforms(BLOCK_N, dtype))] * num_w,
        ]

        def pipeline(step_fn, context):
            return _pipeline(step_fn, context, specs, my_items * k_steps, stages)

        def scope(allocations, staging):
            wg = lax.axis_index("wg")
            rows = pl.ds(wg * WG_ROWS, WG_ROWS)

            def step_fn(indices, x_smem, *rest):
                *w_smems, accs = rest
                (step,) = indices
                k = step % k_steps

                @pl.when(k == 0)
                def _zero():
                    for acc in accs:
                        acc[...] = jnp.zeros(acc.shape, jnp.float32)

                for acc, w_smem in zip(accs, w_smems, strict=True):
                    plgpu.wgmma(acc, x_smem.at[rows], w_smem)
                # The ring slot is released when this returns: the MMAs must have read it.
                plgpu.wgmma_wait(0)

                @pl.when(k == k_steps - 1)
                def _epilogue():
                    m, n, _ = coords(step)
                    row_start = m * BLOCK_M + wg * WG_ROWS
                    values = [acc[...] for acc in accs]
                    slot = 0
                    for col in range(0, BLOCK_N, EPI_N):
                        pre_c = [value[:, col:col + EPI_N] for value in values]
                        gate_c, up_c = pre_c if gated else (None, *pre_c)
                        act_c = activations.hidden(activation, gate_c, up_c, common.sigmoid)
                        for out_g, value in (*zip(pre_gs, pre_c, strict=True), (act_g, act_c)):
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
                pl.run_scoped(lambda *accs: run(accs),
                              *[plgpu.ACC((WG_ROWS, BLOCK_N))] * num_w)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pipeline(step_fn, context)(x_g, *w_gs, allocations=allocations)

        _run(pipeline, (x_g, *w_gs), scope,
             staging=plgpu.SMEM(staging_shape, dtype,
                                transforms=common.mma_transforms(EPI_N, dtype)))

    out = jax.ShapeDtypeStruct((num_rows, s_dim), dtype)
    kernel = _warp_specialised(body, [out] * (1 + num_w), f"shared_{activation}_fwd_mosaic")
    act, *pre = kernel(x, *weights)
    return (act, *pre) if gated else (act, None, *pre)


def activation_backward(activation: str, dy: jax.Array, w_down: jax.Array,
                        gate: jax.Array | None, up: jax.Array):
    """The gate and up gradients of ``a @ w_down`` (``a`` the activation of ``gate`` and
    ``up``) given ``dy``, side by side: ``[T, 2S]`` in ``up.dtype`` (``[:, :S]`` the gate's,
    ``[:, S:]`` the up's); for the not-gated ``"gelu"`` (``gate`` ``None``) the up's alone,
    ``[T, S]``."""
    gated = activations.check_gate(activation, gate, "gate")
    pre = [gate, up] if gated else [up]
    num_pre = len(pre)
    num_rows, d_dim = dy.shape
    s_dim = w_down.shape[0]
    n_tiles, k_steps = s_dim // BLOCK_N, d_dim // BLOCK_K
    total = (num_rows // BLOCK_M) * n_tiles
    dtype = up.dtype
    stage_bytes = (BLOCK_M + BLOCK_N) * BLOCK_K * dtype.itemsize
    tiles_shape = (COMPUTE_WARPGROUPS, num_pre, WG_ROWS, BLOCK_N)
    stages = _stages(stage_bytes, num_pre * BLOCK_M * BLOCK_N * dtype.itemsize)

    def body(dy_g, w_g, *refs):
        pre_gs, out_g = refs[:num_pre], refs[num_pre]
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
            pre_smems = [tiles.at[wg, i] for i in range(num_pre)]  # gate's and up's, or up's

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
                    for pre_g, pre_smem in zip(pre_gs, pre_smems, strict=True):
                        plgpu.copy_gmem_to_smem(pre_g.at[row_view, pl.ds(col, BLOCK_N)],
                                                pre_smem, landed.at[wg])

                plgpu.wgmma(acc, dy_smem.at[rows], _pallas.transposed_ref(w_smem))
                plgpu.wgmma_wait(0)

                @pl.when(k == k_steps - 1)
                def _epilogue():
                    row_view, col = views(step)
                    dz = acc[...]
                    plgpu.barrier_wait(landed.at[wg])
                    targets = dict(zip(("gate", "up") if gated else ("up",), pre_smems,
                                       strict=True))
                    for c in range(0, BLOCK_N, EPI_N):
                        cols = pl.ds(c, EPI_N)
                        dz_c = dz[:, c:c + EPI_N]
                        pre_c = [smem.at[:, cols][...].astype(jnp.float32) for smem in pre_smems]
                        gate_c, up_c = pre_c if gated else (None, *pre_c)
                        # Each thread rewrites the elements it read: the tiles become the
                        # gradients in place.
                        for name, value in activations.hidden_backward(
                                activation, gate_c, up_c, dz_c, None, common.sigmoid):
                            if name != "act":
                                targets[name].at[:, cols][...] = value.astype(dtype)
                    plgpu.commit_smem()
                    for i, pre_smem in enumerate(pre_smems):  # [:, :S] the gate's if gated
                        plgpu.copy_smem_to_gmem(
                            pre_smem, out_g.at[row_view, pl.ds(i * s_dim + col, BLOCK_N)])

                return acc

            def context(run):
                pl.run_scoped(run, plgpu.ACC((WG_ROWS, BLOCK_N)))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pipeline(step_fn, context)(dy_g, w_g, allocations=allocations)

        _run(pipeline, (dy_g, w_g), scope,
             tiles=plgpu.SMEM(tiles_shape, dtype, transforms=common.mma_transforms(BLOCK_N, dtype)),
             landed=plgpu.Barrier(num_arrivals=num_pre, num_barriers=COMPUTE_WARPGROUPS))

    out = jax.ShapeDtypeStruct((num_rows, num_pre * s_dim), dtype)
    return _warp_specialised(body, out, f"shared_{activation}_bwd_mosaic")(dy, w_down, *pre)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def shared_expert(activation, x, w_gate, w_up, w_down):
    """``a(x) @ w_down`` in ``x.dtype``, ``a`` the ``activation`` (``silu(x @ w_gate) *
    (x @ w_up)`` for ``"swiglu"``; ``w_gate`` ``None`` for the not-gated ``"gelu"``):
    ``reference.shared_expert`` with the activation in the kernels' epilogues."""
    return _forward(activation, x, w_gate, w_up, w_down)[0]


def _product(a, b, spec):
    return jnp.einsum(spec, a, b, preferred_element_type=a.dtype)


def _forward(activation, x, w_gate, w_up, w_down):
    act, gate, up = activation_forward(activation, x, w_gate, w_up)
    return _product(act, w_down, "ts,sd->td"), (x, w_gate, w_up, w_down, act, gate, up)


def _backward(activation, residuals, dy):
    x, w_gate, w_up, w_down, act, gate, up = residuals
    dy = dy.astype(x.dtype)
    d_pre = activation_backward(activation, dy, w_down, gate, up)
    dw_down = _product(act, dy, "ts,td->sd")
    if w_gate is None:
        return (_product(d_pre, w_up, "ts,ds->td"), None, _product(x, d_pre, "td,ts->ds"),
                dw_down)
    w_gate_up = jnp.concatenate([w_gate, w_up], axis=1)
    dx = _product(d_pre, w_gate_up, "ts,ds->td")
    dw_gate_up = _product(x, d_pre, "td,ts->ds")
    s_dim = w_gate.shape[1]
    return dx, dw_gate_up[:, :s_dim], dw_gate_up[:, s_dim:], dw_down


shared_expert.defvjp(_forward, _backward)
