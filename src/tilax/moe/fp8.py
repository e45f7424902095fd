"""The routed experts of ``MoEConfig(quantize="fp8")`` in plain XLA, with their FP8 backward.

Every expert matmul of the forward, the input gradient and the weight gradient runs on e4m3
operands with fine-grained scales (``quantize.py`` says which operand is quantised along which
axis and how the products are promoted); everything between the matmuls (the
``MoEConfig.activation`` and its derivative, ``tilax.moe.activations``; the combine and its
weights' gradient; the gather and sum of token copies) runs on the bfloat16 values in float32
math, as in the bfloat16 layer. The not-gated ``"gelu"`` has no ``w_gate`` (``None`` here) and
one product fewer each way. Master weights, the router and
the shared expert stay outside: the layer casts its weights to bfloat16 and quantises them here.

The custom VJP saves the forward's bfloat16 inputs, its pre-activations, its output rows and
its quantised weights (the input gradients reuse their blocks, transposed); the backward
quantises ``dy`` and the activation's gradients along their contraction for the input gradients,
and the activations and gradients again along the tokens for the weight gradients.

``routed_blocked``, ``routed_ragged_dot`` and ``routed_mosaic`` are the registry entries
(``base.RoutedExperts``) for ``impl="blocked"``, ``"ragged_dot"`` and ``"mosaic"``: the same
sums, each chunk's product as padded expert blocks or as ``jax.lax.ragged_dot``
(``quantize.grouped_matmul``, ``quantize.grouped_matmul_t``), or every product on e4m3 tensor
cores by the Mosaic GPU kernels (``tilax.moe.mosaic.gmm_fp8``, Hopper). The kernels read the
weights K-major: the forward's ``[E, h, d]``/``[E, d, h]`` copies of the quantised weights are
made once per step in XLA (a transpose of the e4m3 blocks), and the input gradients read the
quantised weights as stored; their rows come in tiles of the kernels' ``block_m`` (the row
layout is padded to it).
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from tilax.moe import activations, dispatch, quantize
from tilax.moe.base import RoutedCopies
from tilax.moe.dispatch import RowLayout
from tilax.moe.reference import expert_activation

F32 = jnp.float32


def _rows(x: jax.Array, layout: RowLayout) -> jax.Array:
    """``x`` in the row space, zero on padding and dropped rows."""
    rows = dispatch.take_rows(x, layout.row_token)
    return jnp.where(layout.row_valid[:, None], rows, jnp.zeros((), x.dtype))


def _mosaic_kernels():
    """``tilax.moe.mosaic.gmm_fp8``, imported when a kernel first runs (``import tilax`` loads
    no GPU backend, as ``pallas.kernels``)."""
    return importlib.import_module("tilax.moe.mosaic.gmm_fp8")


def _product(impl, rows, weight, group_sizes, out_dtype=jnp.bfloat16):
    """``rows @ weight[e]`` on FP8 operands: ``weight`` is a quantised ``(q, scales)`` pair
    (``q: [E, K, N]``). ``impl``: an XLA impl's name, or the Mosaic GPU kernels' tiles, which
    read ``q`` K-major (its transpose; XLA cancels the two transposes of the input gradients'
    ``quantize.transpose_blocks``, so only the forward's are copies)."""
    q, scales = quantize.quantize_rows(rows)
    if isinstance(impl, str):
        return quantize.grouped_matmul(
            q, scales, *weight, group_sizes, impl=impl, out_dtype=out_dtype
        )
    w_q, w_scales = weight
    return _mosaic_kernels().grouped_matmul_fp8(
        q,
        scales,
        jnp.swapaxes(w_q, -1, -2),
        w_scales,
        group_sizes,
        tiles=impl,
        out_dtype=out_dtype,
    )


def _weight_grad(impl, lhs_rows, rhs_rows, tiles, num_experts, dtype):
    """``lhs[rows of e].T @ rhs[rows of e]`` on operands quantised along the tokens."""
    lhs = quantize.quantize_token_tiles(lhs_rows, tiles)
    rhs = quantize.quantize_token_tiles(rhs_rows, tiles)
    if isinstance(impl, str):
        return quantize.grouped_matmul_t(*lhs, *rhs, tiles, num_experts, out_dtype=dtype)
    return _mosaic_kernels().grouped_matmul_t_fp8(
        *lhs, *rhs, tiles, num_experts, tiles=impl, out_dtype=dtype
    )


def _forward(impl, activation, x, w_gate, w_up, w_down, weights, layout):
    q_gate = None if w_gate is None else quantize.quantize_blocks(w_gate)
    q_up, q_down = quantize.quantize_blocks(w_up), quantize.quantize_blocks(w_down)
    sizes = layout.group_sizes
    xs = _rows(x, layout)
    gate = None if q_gate is None else _product(impl, xs, q_gate, sizes, x.dtype)
    up = _product(impl, xs, q_up, sizes, x.dtype)
    act = expert_activation(activation, gate, up)
    out_rows = _product(impl, act, q_down, sizes, x.dtype)
    y = dispatch.combine(out_rows, weights, layout)
    return y, (x, weights, layout, gate, up, out_rows, (q_gate, q_up, q_down))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def experts_fp8(impl, activation, x, w_gate, w_up, w_down, weights, layout):
    """``y[t] = sum_j weights[t, j] * expert_e(x[t])`` over the kept copies of ``layout``
    (``expert_e(x) = act(x) @ w_down[e]``, ``act`` the ``activation``), every expert matmul
    (and each of its gradients) on FP8 operands.

    Args:
        impl: ``"ragged_dot"`` or ``"blocked"`` (static): how the grouped products run in
            XLA; or a ``tilax.moe.mosaic.common.Config``: the Mosaic GPU FP8 kernels with
            these tiles (the layout's rows a multiple of its ``block_m``).
        activation: ``MoEConfig.activation`` (static; ``tilax.moe.activations``).
        x: ``[T, d]`` bfloat16 tokens; w_gate, w_up: ``[E, d, h]`` (``w_gate`` ``None`` for
            the not-gated ``"gelu"``); w_down: ``[E, h, d]``.
        weights: ``[T, k]`` float32 combine weights.
        layout: the copies' ``dispatch.RowLayout``.

    Returns:
        ``[T, d]`` in ``x.dtype``; differentiable in reverse mode w.r.t. ``x``, the expert
        weights and ``weights``.
    """
    return _forward(impl, activation, x, w_gate, w_up, w_down, weights, layout)[0]


def _experts_fp8_fwd(impl, activation, x, w_gate, w_up, w_down, weights, layout):
    return _forward(impl, activation, x, w_gate, w_up, w_down, weights, layout)


def _activation_grads(activation, d_act, gate, up):
    """``(d_gate, d_up)`` of the activation (``activations.hidden_backward``) in float32,
    returned in ``up.dtype``; ``d_gate`` is ``None`` when not gated."""
    gate32 = None if gate is None else gate.astype(F32)
    grads = dict(activations.hidden_backward(activation, gate32, up.astype(F32), d_act.astype(F32)))
    d_gate = None if gate is None else grads["gate"].astype(up.dtype)
    return d_gate, grads["up"].astype(up.dtype)


def _experts_fp8_bwd(impl, activation, residuals, dy):
    x, weights, layout, gate, up, out_rows, quantized = residuals
    q_gate, q_up, q_down = quantized
    dtype = x.dtype
    sizes = layout.group_sizes
    num_experts = sizes.shape[0]
    dy = dy.astype(dtype)

    # The combine: each row's cotangent is its weight times its token's dy; the weights'
    # gradient is dy . the row's output.
    row_weight = dispatch.row_weights(weights, layout)
    d_out = (row_weight[:, None] * _rows(dy, layout).astype(F32)).astype(dtype)
    copy_out = dispatch.copy_values(out_rows, layout).astype(F32)
    d_weights = jnp.einsum("tkd,td->tk", copy_out, dy.astype(F32))

    tiles = quantize.token_tiles(sizes, out_rows.shape[0])
    act = expert_activation(activation, gate, up)
    d_act = _product(impl, d_out, quantize.transpose_blocks(*q_down), sizes, dtype)
    d_w_down = _weight_grad(impl, act, d_out, tiles, num_experts, dtype)
    d_gate, d_up = _activation_grads(activation, d_act, gate, up)
    dx_rows = _product(impl, d_up, quantize.transpose_blocks(*q_up), sizes, F32)
    if d_gate is not None:
        dx_rows = dx_rows + _product(impl, d_gate, quantize.transpose_blocks(*q_gate), sizes, F32)
    d_x = dispatch.sum_copies(dx_rows.astype(dtype), layout)
    xs = _rows(x, layout)
    d_w_gate = None if d_gate is None else _weight_grad(impl, xs, d_gate, tiles, num_experts, dtype)
    d_w_up = _weight_grad(impl, xs, d_up, tiles, num_experts, dtype)
    return d_x, d_w_gate, d_w_up, d_w_down, d_weights.astype(weights.dtype), None


experts_fp8.defvjp(_experts_fp8_fwd, _experts_fp8_bwd)


def _routed(impl):
    def routed(config, x, w_gate, w_up, w_down, copies: RoutedCopies):
        products, row_multiple = impl, 1
        if impl == "mosaic":
            products = _mosaic_kernels().tiles_for(config)
            row_multiple = products.block_m
        layout = dispatch.sort_by_expert(
            copies.expert_ids,
            w_up.shape[0],
            capacity=copies.capacity,
            kept=copies.kept,
            row_multiple=row_multiple,
        )
        run = functools.partial(experts_fp8, products, config.activation)
        if config.recompute:
            run = jax.checkpoint(run)
        y = run(x, w_gate, w_up, w_down, copies.weights, layout)
        dropless = copies.capacity is None and copies.kept is None
        return y, None if dropless else layout.group_offsets[-1]

    routed.__name__ = routed.__qualname__ = f"routed_{impl}"
    routed.__doc__ = (
        f"The FP8 experts with each chunk's product as ``{impl}`` (a "
        "``base.RoutedExperts``; under ``jax.checkpoint`` with ``recompute``)."
    )
    return routed


routed_blocked = _routed("blocked")
routed_ragged_dot = _routed("ragged_dot")
routed_mosaic = _routed("mosaic")
