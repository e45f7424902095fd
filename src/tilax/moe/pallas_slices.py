"""The Pallas expert path in row slices: the memory-saving variant (``MoEConfig.recompute``).

The one-pass path keeps, per token copy, the gate and up pre-activations and the scaled
activation from the forward to the backward and, in the backward, the pre-activations'
gradients next to them: five ``[rows, d_hidden]`` arrays at once, most of a train step's
memory. Here the forward and the backward loop (``lax.fori_loop``) over slices of
``plan.slice_rows`` rows of the row space; the hidden activations exist for one slice at a
time, and the backward recomputes the gate and up projections of its slice and the scaled
activation (one more pair of grouped matmuls). What stays is of size ``[rows, d_model]``:
the down projection's output rows and the input gradient's rows.

Every slice runs the backend's kernels on its own schedule: the expert group offsets clipped
to the slice. The weight gradients are summed over slices in float32. The forward combines in
XLA for every dispatch (``fused_gsum``'s in-kernel combine would need its float32 token
accumulator to outlive the loop).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tilax.moe import dispatch, reference


def _slice(plan, layout, number):
    """Slice ``number``'s first row, sort index, clipped group offsets and schedule."""
    rows = plan.slice_rows
    start = number * rows
    index = lax.dynamic_slice_in_dim(layout.row_token, start, rows)
    offsets = jnp.clip(layout.group_offsets - start, 0, rows)
    return start, index, offsets, plan.schedule(offsets, rows)


def _sources(plan, x, index):
    """The left operand and row index the kernels read a slice's rows of ``x`` through:
    a permuted copy for ``sorted``, the sort index for the gathering dispatches."""
    if plan.dispatch == "sorted":
        return dispatch.take_rows(x, index), None
    return x, index


def _hidden(plan, x_src, index, w_gate, w_up, w_slice, schedule, *, preactivations: bool):
    """The slice's activation scaled by the combine weights ``w_slice``, and with
    ``preactivations`` the gate and up pre-activations after it (gate ``None`` when not
    gated)."""
    kernels, kw = plan.kernels, dict(tiles=plan.tiles, backend=plan.backend)
    if plan.dispatch in ("sorted", "gather"):
        gate = None
        if w_gate is not None:
            gate = kernels.gmm(x_src, w_gate, schedule, index=index, **kw)
        up = kernels.gmm(x_src, w_up, schedule, index=index, **kw)
        act = reference.expert_activation(plan.activation, gate, up, w_slice)
        return (act, gate, up) if preactivations else act
    out = kernels.gmm_activation(
        x_src, w_gate, w_up, schedule, index=index, row_scale=w_slice,
        save_preactivations=preactivations, activation=plan.activation, **kw,
    )
    return out if preactivations else out[0]


def forward(plan, x, w_gate, w_up, w_down, weights, layout):
    """``y[t] = sum_j weights[t, j] * expert_{e(t, j)}(x[t])``, slice by slice."""
    num_rows, rows = layout.row_token.shape[0], plan.slice_rows
    kernels, kw = plan.kernels, dict(tiles=plan.tiles, backend=plan.backend)
    w_rows = dispatch.row_weights(weights, layout)

    def body(number, out_rows):
        start, index, _, schedule = _slice(plan, layout, number)
        x_src, src_index = _sources(plan, x, index)
        w_slice = lax.dynamic_slice_in_dim(w_rows, start, rows)
        act = _hidden(plan, x_src, src_index, w_gate, w_up, w_slice, schedule,
                      preactivations=False)
        out = kernels.gmm(act, w_down, schedule, **kw)
        return lax.dynamic_update_slice_in_dim(out_rows, out, start, axis=0)

    out_rows = jnp.zeros((num_rows, w_down.shape[2]), x.dtype)
    out_rows = lax.fori_loop(0, num_rows // rows, body, out_rows)
    return dispatch.sum_copies(out_rows, layout)


def backward(plan, inputs, dy):
    """Cotangents of ``(x, w_gate, w_up, w_down, weights)``; the gate and up pre-activations
    of each slice are recomputed, then the slice's part of every gradient is computed as the
    one-pass backward does."""
    x, w_gate, w_up, w_down, weights, layout = inputs
    num_rows, rows = layout.row_token.shape[0], plan.slice_rows
    kernels, kw = plan.kernels, dict(tiles=plan.tiles, backend=plan.backend)
    w_rows = dispatch.row_weights(weights, layout)
    f32 = jnp.float32

    def body(number, carry):
        dx_rows, dw_row_sums, dw_gate, dw_up, dw_down = carry
        start, index, offsets, schedule = _slice(plan, layout, number)
        x_src, src_index = _sources(plan, x, index)
        dy_src, _ = _sources(plan, dy, index)
        w_slice = lax.dynamic_slice_in_dim(w_rows, start, rows)
        act_scaled, gate, up = _hidden(plan, x_src, src_index, w_gate, w_up, w_slice,
                                       schedule, preactivations=True)
        d_gate, d_up, dw_partial = kernels.gmm_activation_bwd(
            dy_src, w_down, gate, up, w_slice, schedule, index=src_index,
            activation=plan.activation, deterministic=plan.deterministic, **kw,
        )
        dx_slice, d_gate_w, d_up_w = input_grads(
            kernels, x_src, src_index, d_gate, d_up, w_gate, w_up, schedule, offsets,
            x.dtype, f32, kw,
        )
        (d_down_w,) = kernels.tgmm(
            act_scaled, dy_src, offsets, rhs_index=src_index, out_dtype=f32, **kw
        )
        return (
            lax.dynamic_update_slice_in_dim(dx_rows, dx_slice, start, axis=0),
            lax.dynamic_update_slice_in_dim(dw_row_sums, jnp.sum(dw_partial, axis=0), start, 0),
            None if dw_gate is None else dw_gate + d_gate_w,
            dw_up + d_up_w,
            dw_down + d_down_w,
        )

    carry = (
        jnp.zeros((num_rows, x.shape[1]), x.dtype),
        jnp.zeros((num_rows,), f32),
        None if w_gate is None else jnp.zeros(w_gate.shape, f32),
        jnp.zeros(w_up.shape, f32),
        jnp.zeros(w_down.shape, f32),
    )
    dx_rows, dw_row_sums, dw_gate, dw_up, dw_down = lax.fori_loop(
        0, num_rows // rows, body, carry
    )
    dx = dispatch.sum_copies(dx_rows, layout)
    d_weights = dispatch.copy_values(dw_row_sums, layout).astype(weights.dtype)
    dw_gate = None if dw_gate is None else dw_gate.astype(w_gate.dtype)
    return (dx, dw_gate, dw_up.astype(w_up.dtype), dw_down.astype(w_down.dtype), d_weights)


def input_grads(kernels, x_src, index, d_gate, d_up, w_gate, w_up, schedule, offsets,
                dx_dtype, dw_dtype, kw):
    """``(dx_rows, dw_gate, dw_up)`` from the pre-activations' gradients: ``dx`` rows by one
    grouped matmul against the transposed weights (both products summed in it when gated),
    the weight gradients by the transposed grouped matmul sharing the loads of ``x``
    (``dw_gate`` is ``None`` when not gated). Shared with the one-pass backward
    (``pallas.py``)."""
    if w_gate is None:
        dx_rows = kernels.gmm(d_up, w_up, schedule, transpose_rhs=True, out_dtype=dx_dtype, **kw)
        (dw_up,) = kernels.tgmm(x_src, d_up, offsets, lhs_index=index, out_dtype=dw_dtype, **kw)
        return dx_rows, None, dw_up
    dx_rows = kernels.gmm(
        d_gate, w_gate, schedule, transpose_rhs=True, lhs2=d_up, rhs2=w_up,
        out_dtype=dx_dtype, **kw,
    )
    dw_gate, dw_up = kernels.tgmm(
        x_src, d_gate, offsets, lhs_index=index, rhs2=d_up, out_dtype=dw_dtype, **kw
    )
    return dx_rows, dw_gate, dw_up
