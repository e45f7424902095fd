"""Plain-XLA MoE implementations: the benchmark baselines and the tests' oracle.

The baselines compute the same math as the Pallas layer from the same router decisions and row
layout (``dispatch.py``):

- :func:`experts_blocked`: padded expert blocks, ``[E, B, d]`` with ``B = T`` (dropless: one
  expert may receive every token) or ``min(T, C)`` under capacity routing; batched matmuls.
- :func:`experts_ragged_dot`: the sorted rows through ``jax.lax.ragged_dot``. JAX cannot
  batch ``ragged_dot`` (under ``jax.vmap`` its rule takes neither an unbatched right operand
  nor batched group sizes), so it runs through :func:`ragged_matmul`: a custom VJP whose
  forward and backward run each batch element in turn (``jax.lax.map``) under ``jax.vmap``.
- :func:`experts_dense`: dense routing, every expert on every token, weighted by the combine
  weights (zero for experts a token did not choose).

``routed_blocked``, ``routed_ragged_dot`` and ``routed_dense`` wrap them as entries of the
layer's implementation registry (``base.RoutedExperts``); with ``MoEConfig.recompute`` they
run under ``jax.checkpoint`` (the backward recomputes the forward instead of saving it).

:func:`moe_oracle` is written straight from the layer's definition in float32 at the highest
matmul precision, sharing no code with the implementations: the tests compare everything to it.
All baselines take bfloat16 or float32 operands and accumulate in float32; intermediate
activations are rounded to the operand dtype, as the kernels do.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import custom_batching

from tilax.moe import activations, dispatch
from tilax.moe.base import RoutedCopies
from tilax.moe.dispatch import RowLayout

F32 = jnp.float32


def _mm(a: jax.Array, b: jax.Array, spec: str) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=F32)


def expert_activation(
    activation: str, gate: jax.Array | None, up: jax.Array,
    row_scale: jax.Array | None = None,
) -> jax.Array:
    """The hidden activation (``activations.hidden``: ``f(gate) * up``, or ``f(up)`` with
    ``gate=None`` for the not-gated ``"gelu"``), times ``row_scale[:, None]`` when given,
    computed in float32 and returned in ``up.dtype``."""
    gate32 = None if gate is None else gate.astype(F32)
    act = activations.hidden(activation, gate32, up.astype(F32))
    if row_scale is not None:
        act = act * row_scale[:, None]
    return act.astype(up.dtype)


def shared_expert(x: jax.Array, shared: dict, activation: str = "swiglu") -> jax.Array:
    """The shared expert: a dense expert ``[T, d] -> [T, d]`` of ``activation`` in
    ``x.dtype`` (``shared`` has no ``w_gate`` for the not-gated ``"gelu"``).

    Each product gives ``x.dtype`` straight from the matmul (which accumulates in float32), so
    that autodiff's transposed products multiply 16-bit cotangents too: from float32 outputs
    they would multiply float32 cotangents, and XLA upcasts the 16-bit operands (on the H200
    the E64 decoder's shared-expert products took about 4.8 ms of its 131k-token train step
    that way, against 1.6 ms as 16-bit products). Gate and up are two products, not one
    against the two weights side by side: that one product's backward concatenates the two
    halves' gradients for the input gradient, a pass over ``[T, 2 * hidden]`` that cost the
    E64 decoder's train step on the H200 more than the second product saves.
    """
    gate = None
    if activations.is_gated(activation):
        gate = jnp.einsum("td,dh->th", x, shared["w_gate"], preferred_element_type=x.dtype)
    up = jnp.einsum("td,dh->th", x, shared["w_up"], preferred_element_type=x.dtype)
    return jnp.einsum("th,hd->td", expert_activation(activation, gate, up), shared["w_down"],
                      preferred_element_type=x.dtype)


def _experts_batched(activation, x_blocks, w_gate, w_up, w_down):
    """Every expert on its own block of rows: ``[E, B, d] -> [E, B, d]``."""
    gate = None
    if w_gate is not None:
        gate = _mm(x_blocks, w_gate, "ebd,edh->ebh").astype(x_blocks.dtype)
    up = _mm(x_blocks, w_up, "ebd,edh->ebh").astype(x_blocks.dtype)
    act = expert_activation(activation, gate, up)
    return _mm(act, w_down, "ebh,ehd->ebd").astype(x_blocks.dtype)


def experts_dense(
    x: jax.Array,
    w_gate: jax.Array | None,
    w_up: jax.Array,
    w_down: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    activation: str = "swiglu",
) -> jax.Array:
    """Dense routing: ``y[t] = sum_e c[t, e] * expert_e(x[t])`` with every expert on every token.

    ``c[t, e]`` is the combine weight of expert ``e`` for token ``t`` (zero unless chosen).
    Memory ``E * T * d_hidden``; no sort, no gather. ``w_gate`` is ``None`` for the
    not-gated ``activation="gelu"`` (likewise in the other implementations).
    """
    return experts_dense_float32(x, w_gate, w_up, w_down, expert_ids, weights,
                                 activation).astype(x.dtype)


def experts_dense_float32(x, w_gate, w_up, w_down, expert_ids, weights,
                          activation: str = "swiglu") -> jax.Array:
    """:func:`experts_dense` before the final cast: the float32 sum. Experts outside
    ``[0, E)`` contribute nothing (expert parallelism passes one device's share of experts)."""
    num_experts = w_up.shape[0]
    one_hot = jax.nn.one_hot(expert_ids, num_experts, dtype=F32)
    coefficients = jnp.einsum("tk,tke->te", weights.astype(F32), one_hot)
    x_blocks = jnp.broadcast_to(x, (num_experts,) + x.shape)
    outputs = _experts_batched(activation, x_blocks, w_gate, w_up, w_down)
    return jnp.einsum("etd,te->td", outputs.astype(F32), coefficients)


def _row_experts(layout: RowLayout, num_rows: int) -> jax.Array:
    """``[num_rows]`` expert owning each row (the last expert for rows past every group)."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    num_experts = layout.group_sizes.shape[0]
    owner = jnp.searchsorted(layout.group_offsets[1:], rows, side="right", method="compare_all")
    return jnp.minimum(owner, num_experts - 1).astype(jnp.int32)


def experts_blocked(
    x: jax.Array,
    w_gate: jax.Array | None,
    w_up: jax.Array,
    w_down: jax.Array,
    weights: jax.Array,
    layout: RowLayout,
    block_rows: int,
    activation: str = "swiglu",
    deterministic: bool = False,
) -> jax.Array:
    """Padded expert blocks in plain XLA.

    Expert ``e``'s rows are copied into slot block ``[e, :group_sizes[e]]`` of an
    ``[E, block_rows, d]`` buffer (the rest zero), the experts run as batched matmuls and each
    copy reads its output back from its slot. ``block_rows`` must bound every group size
    (``T`` for dropless routing, ``min(T, C)`` with capacity ``C``). ``deterministic``: the
    gathers' gradients are gathers summing in a fixed order (``dispatch.take_fixed_order``)
    instead of scatter-adds (a token's ``k`` copies would be added by GPU atomics).
    """
    num_experts = w_up.shape[0]
    slots = jnp.arange(block_rows, dtype=jnp.int32)
    slot_rows = layout.group_offsets[:-1, None] + slots[None, :]
    slot_used = slots[None, :] < layout.group_sizes[:, None]
    slot_rows = jnp.where(slot_used, slot_rows, 0)
    tokens = jnp.take(layout.row_token, slot_rows)
    num_rows = layout.row_token.shape[0]
    row_expert = _row_experts(layout, num_rows)
    row_slot = jnp.arange(num_rows, dtype=jnp.int32) - layout.group_offsets[row_expert]
    row_slot = jnp.clip(row_slot, 0, block_rows - 1)
    row_block_slot = row_expert * block_rows + row_slot
    if deterministic:
        # Each token is read by its kept copies' slots (a kept copy's slot is its row's), and
        # each used slot by its row.
        copy_slot = jnp.take(row_block_slot, layout.copy_row)
        x_slots = dispatch.take_fixed_order(x, tokens, copy_slot, layout.copy_kept)
    else:
        x_slots = jnp.take(x, tokens, axis=0)
    x_blocks = jnp.where(slot_used[..., None], x_slots, 0).astype(x.dtype)
    out_blocks = _experts_batched(activation, x_blocks, w_gate, w_up, w_down)
    out_slots = out_blocks.reshape(num_experts * block_rows, -1)
    if deterministic:
        rows = dispatch.take_fixed_order(out_slots, row_block_slot, slot_rows.reshape(-1, 1),
                                         slot_used.reshape(-1, 1))
    else:
        rows = out_slots[row_block_slot]
    return dispatch.combine(rows, weights, layout, deterministic)


def experts_ragged_dot(
    x: jax.Array,
    w_gate: jax.Array | None,
    w_up: jax.Array,
    w_down: jax.Array,
    weights: jax.Array,
    layout: RowLayout,
    activation: str = "swiglu",
    deterministic: bool = False,
) -> jax.Array:
    """Sorted rows through ``jax.lax.ragged_dot`` for the three projections.

    Rows past ``sum(group_sizes)`` (dropped copies) belong to no group: ``ragged_dot`` leaves
    them zero, and the combine skips them. ``deterministic``: the combine's gradient is a
    gather (``dispatch.combine``); the permutation's is one already, and XLA's GPU backend
    runs ``ragged_dot`` and its gradients as dense products of masked operands.
    """
    xs = dispatch.permute(x, layout)
    sizes = layout.group_sizes

    def ragged(lhs, rhs):
        return ragged_matmul(lhs, rhs, sizes).astype(x.dtype)

    gate = None if w_gate is None else ragged(xs, w_gate)
    act = expert_activation(activation, gate, ragged(xs, w_up))
    return dispatch.combine(ragged(act, w_down), weights, layout, deterministic)


def _one_at_a_time(fn: Callable) -> Callable:
    """``fn`` under ``jax.vmap``: each batch element in turn (``jax.lax.map``), the unbatched
    arguments shared. For the ``ragged_dot`` calls, which JAX cannot batch."""
    mapped = custom_batching.custom_vmap(fn)

    @mapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        del axis_size
        batched = [arg for arg, is_batched in zip(args, in_batched, strict=True) if is_batched]

        def one(slices):
            remaining = iter(slices)
            return mapped(*[next(remaining) if is_batched else arg
                            for arg, is_batched in zip(args, in_batched, strict=True)])

        out = jax.lax.map(one, batched)
        return out, jax.tree.map(lambda _: True, out)

    return mapped


@_one_at_a_time
def _ragged_forward(lhs, rhs, group_sizes):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=F32)


@_one_at_a_time
def _ragged_backward(lhs, rhs, group_sizes, d_out):
    _, pullback = jax.vjp(lambda a, b: _ragged_forward.fun(a, b, group_sizes), lhs, rhs)
    return pullback(d_out)


@jax.custom_vjp
def ragged_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` in float32 that ``jax.vmap`` batches
    (each element in turn), differentiable in reverse mode w.r.t. ``lhs`` and ``rhs``."""
    return _ragged_forward(lhs, rhs, group_sizes)


def _ragged_matmul_fwd(lhs, rhs, group_sizes):
    return _ragged_forward(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _ragged_matmul_bwd(residuals, d_out):
    lhs, rhs, group_sizes = residuals
    d_lhs, d_rhs = _ragged_backward(lhs, rhs, group_sizes, d_out)
    return d_lhs, d_rhs, None


ragged_matmul.defvjp(_ragged_matmul_fwd, _ragged_matmul_bwd)


def _checkpointed(config, fn):
    return jax.checkpoint(fn) if config.recompute else fn


def _layout(copies: RoutedCopies, num_experts: int) -> RowLayout:
    return dispatch.sort_by_expert(
        copies.expert_ids, num_experts, capacity=copies.capacity, kept=copies.kept
    )


def _kept_count(copies: RoutedCopies, layout: RowLayout):
    return None if copies.capacity is None and copies.kept is None else layout.group_offsets[-1]


def routed_blocked(config, x, w_gate, w_up, w_down, copies: RoutedCopies):
    """:func:`experts_blocked` as a registry entry: blocks of ``min(T, C)`` rows."""
    layout = _layout(copies, w_up.shape[0])
    num_tokens = x.shape[0]
    rows = num_tokens if copies.capacity is None else min(num_tokens, copies.capacity)

    def run(x, w_gate, w_up, w_down, weights, layout):
        return experts_blocked(x, w_gate, w_up, w_down, weights, layout, rows,
                               activation=config.activation,
                               deterministic=config.deterministic)

    y = _checkpointed(config, run)(x, w_gate, w_up, w_down, copies.weights, layout)
    return y, _kept_count(copies, layout)


def routed_ragged_dot(config, x, w_gate, w_up, w_down, copies: RoutedCopies):
    """:func:`experts_ragged_dot` as a registry entry."""
    layout = _layout(copies, w_up.shape[0])

    def run(x, w_gate, w_up, w_down, weights, layout):
        return experts_ragged_dot(x, w_gate, w_up, w_down, weights, layout,
                                  activation=config.activation,
                                  deterministic=config.deterministic)

    y = _checkpointed(config, run)(x, w_gate, w_up, w_down, copies.weights, layout)
    return y, _kept_count(copies, layout)


def routed_dense(config, x, w_gate, w_up, w_down, copies: RoutedCopies):
    """:func:`experts_dense` as a registry entry (dense routing keeps every copy)."""
    def run(x, w_gate, w_up, w_down, expert_ids, weights):
        return experts_dense(x, w_gate, w_up, w_down, expert_ids, weights, config.activation)

    return _checkpointed(config, run)(x, w_gate, w_up, w_down, copies.expert_ids,
                                      copies.weights), None


def moe_oracle(params: dict, x: jax.Array, config) -> jax.Array:
    """float32 reference of ``moe_apply``'s output, straight from the math (the config's
    activation from ``jax.nn.silu``/``jax.nn.gelu(approximate=True)``).

    Every expert runs on every token at ``Precision.HIGHEST``; the router's scores, balance
    bias, expert groups and scale as ``MoEConfig`` defines them; capacity routing keeps copy
    ``(t, j)`` when fewer than ``C`` earlier tokens chose the same expert. Returns float32 with
    the shape of ``x``.
    """
    highest = jax.lax.Precision.HIGHEST
    d_model, num_experts, top_k = config.d_model, config.num_experts, config.top_k
    x32 = x.reshape(-1, d_model).astype(F32)
    num_tokens = x32.shape[0]

    def mm(spec, a, b):
        return jnp.einsum(spec, a.astype(F32), b.astype(F32), precision=highest)

    logits = mm("td,de->te", x32, params["router"])
    if config.score_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    selection = scores
    if config.balance_bias:
        selection = scores + jax.lax.stop_gradient(params["router_bias"].astype(F32))
    groups = config.expert_groups
    if groups > 1:
        # keep each token's group_top_k groups by the sum of their two best selection scores
        grouped = selection.reshape(num_tokens, groups, num_experts // groups)
        group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0], -1)
        best_groups = jax.lax.top_k(group_scores, config.group_top_k)[1]
        kept = jnp.sum(jax.nn.one_hot(best_groups, groups), axis=1) > 0
        selection = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(selection.shape)
    _, expert_ids = jax.lax.top_k(selection, top_k)
    top_probs = jnp.take_along_axis(scores, expert_ids, axis=1)
    if config.renormalize:
        top_probs = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
    top_probs = top_probs * config.routed_scale
    activation = config.activation

    def hidden(x32, weights, spec):
        """The activation from the definition: jax.nn's functions, not the kernels' form."""
        up = mm(spec, x32, weights["w_up"])
        if activation == "gelu":
            return jax.nn.gelu(up, approximate=True)
        gate = mm(spec, x32, weights["w_gate"])
        if activation == "geglu":
            return jax.nn.gelu(gate, approximate=True) * up
        return jax.nn.silu(gate) * up

    every_expert = mm("teh,ehd->ted", hidden(x32, params, "td,edh->teh"), params["w_down"])
    chosen = jnp.take_along_axis(every_expert, expert_ids[:, :, None], axis=1)
    keep = jnp.ones(expert_ids.shape, bool)
    if config.routing == "capacity":
        capacity = math.ceil(config.capacity_factor * num_tokens * top_k / num_experts)
        picks = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.int32).sum(axis=1)
        earlier = jnp.cumsum(picks, axis=0) - picks
        keep = jnp.take_along_axis(earlier, expert_ids, axis=1) < capacity
    y = jnp.sum(jnp.where(keep, top_probs, 0.0)[:, :, None] * chosen, axis=1)
    shared = params.get("shared")
    if config.shared_hidden and shared is not None:
        y = y + mm("ts,sd->td", hidden(x32, shared, "td,ds->ts"), shared["w_down"])
    return y.reshape(x.shape)
