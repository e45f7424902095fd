"""Top-k softmax router: float32 logits, expert choice, combine weights and the router's aux.

The router always runs in float32 whatever the layer's dtype: a bfloat16 logit is too coarse to
rank experts reliably, and the matmul is tiny (``[T, d_model] x [d_model, E]``).

:func:`skew_tokens` is the benchmark/test knob that makes routing skewed. It moves the *inputs*
along a direction the router maps onto a fixed per-expert bias, so the layer itself and its
router weights are untouched: the same parameters and the same math, only a different batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tilax.moe import dispatch

# The router's matmul decides which experts run: keep it at full float32 precision on every
# device (GPUs would otherwise use TF32 and may flip near-ties between implementations).
ROUTER_PRECISION = jax.lax.Precision.HIGHEST


class RouterOutput(NamedTuple):
    """What the router decides for ``T`` tokens and ``E`` experts (all float32 / int32).

    Attributes:
        logits: ``[T, E]`` float32, ``x @ router``.
        probs: ``[T, E]`` float32, ``softmax(logits)``.
        expert_ids: ``[T, k]`` int32, the top-k experts of each token, best first.
        weights: ``[T, k]`` float32, their combine weights: the top-k probabilities, divided by
            their sum when ``renormalize``.
    """

    logits: jax.Array
    probs: jax.Array
    expert_ids: jax.Array
    weights: jax.Array


def route(x: jax.Array, router: jax.Array, top_k: int, renormalize: bool) -> RouterOutput:
    """Route tokens ``x: [T, d_model]`` with ``router: [d_model, E]`` to their top-k experts.

    Ties between equal probabilities go to the lower expert index (``jax.lax.top_k``).
    Differentiable with respect to ``x`` and ``router`` through the weights.
    """
    logits = jnp.dot(
        x.astype(jnp.float32), router.astype(jnp.float32), precision=ROUTER_PRECISION
    )
    probs = jax.nn.softmax(logits, axis=-1)
    top_probs, expert_ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        top_probs = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
    return RouterOutput(logits, probs, expert_ids.astype(jnp.int32), top_probs)


def router_aux(
    routed: RouterOutput, num_experts: int, kept_copies: jax.Array | int | None = None
) -> dict[str, jax.Array]:
    """The layer's ``aux`` dict, computed from the router's decisions.

    Args:
        routed: the router's output for ``T`` tokens.
        num_experts: ``E``.
        kept_copies: token copies that capacity routing kept (``None``: all were kept).

    Returns:
        ``expert_counts`` ([E] int32, copies per expert before any drop), ``max_expert_frac``
        (largest count / ``T*k``), ``empty_experts`` (int32, experts with no copy),
        ``dropped_frac`` (dropped copies / ``T*k``), ``router_z_loss`` (mean over tokens of
        ``logsumexp(logits)**2``) and ``load_balance_loss`` (``E * sum_e f_e * P_e`` with
        ``f_e = counts_e / (T*k)`` and ``P_e`` the mean router probability of expert ``e``).
        The two losses are differentiable float32 scalars; the counts carry no gradient.
    """
    num_tokens, top_k = routed.expert_ids.shape
    z = jax.nn.logsumexp(routed.logits, axis=-1)
    return aux_from_sums(
        counts=dispatch.expert_counts(routed.expert_ids, num_experts),
        prob_sums=jnp.sum(routed.probs, axis=0),
        z_squared_sum=jnp.sum(z * z),
        num_tokens=num_tokens,
        top_k=top_k,
        kept_copies=kept_copies,
    )


def aux_from_sums(
    *, counts, prob_sums, z_squared_sum, num_tokens: int, top_k: int, kept_copies=None
) -> dict[str, jax.Array]:
    """The ``aux`` dict from sums over the tokens (see :func:`router_aux`): the expert
    counts, the router probabilities summed per expert, the sum of ``logsumexp(logits)**2``
    and the kept copies. Expert parallelism adds these up over the devices first."""
    copies = num_tokens * top_k
    fractions = counts.astype(jnp.float32) / copies
    mean_probs = prob_sums / num_tokens
    if kept_copies is None:
        dropped = jnp.zeros((), jnp.float32)
    else:
        dropped = (copies - jnp.asarray(kept_copies, jnp.float32)) / copies
    return {
        "expert_counts": counts,
        "max_expert_frac": jnp.max(fractions),
        "empty_experts": jnp.sum(counts == 0).astype(jnp.int32),
        "dropped_frac": dropped,
        "router_z_loss": z_squared_sum / num_tokens,
        "load_balance_loss": counts.shape[0] * jnp.sum(fractions * mean_probs),
    }


def skew_tokens(x: jax.Array, router: jax.Array, skew: float) -> jax.Array:
    """Shift tokens so that routing them with ``router`` is skewed towards the first experts.

    The benchmark and test knob for skewed routing (the stored results' ``skew``). It returns
    ``x + o`` with one offset ``o`` for all tokens, chosen (least squares) so that
    ``o @ router = b`` with the bias ramp ``b_e = -skew / (1 - skew) * sigma * e``, where
    ``sigma`` is the standard deviation of the unshifted logits. Expert 0 is favoured most;
    each later expert sits ``skew / (1 - skew)`` logit standard deviations lower.
    ``skew = 0`` returns ``x`` unchanged; ``0.5`` is a moderate imbalance; ``0.9`` sends nearly
    every token to the first ``top_k`` experts and leaves the others empty. The layer, its
    parameters and its math are untouched: only the batch changes. The shift is exact when
    ``router`` has full column rank ``E <= d_model``, approximate otherwise.

    Args:
        x: ``[..., d_model]`` tokens (any float dtype; the result keeps it).
        router: ``[d_model, E]`` router weights.
        skew: in ``[0, 1)``.

    Raises:
        ValueError: ``skew`` outside ``[0, 1)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from tilax.moe.router import skew_tokens
        >>> router = jax.random.normal(jax.random.key(0), (16, 4))
        >>> x = jax.random.normal(jax.random.key(1), (64, 16))
        >>> skew_tokens(x, router, 0.9).shape
        (64, 16)
    """
    if not 0.0 <= skew < 1.0:
        raise ValueError(f"skew must be in [0, 1), got {skew!r}")
    if skew == 0.0:
        return x
    router32 = router.astype(jnp.float32)
    logits = jnp.dot(
        x.reshape(-1, x.shape[-1]).astype(jnp.float32), router32, precision=ROUTER_PRECISION
    )
    sigma = jnp.maximum(jnp.std(logits), 1e-6)
    num_experts = router.shape[1]
    bias = -(skew / (1.0 - skew)) * sigma * jnp.arange(num_experts, dtype=jnp.float32)
    offset = jnp.linalg.pinv(router32.T) @ bias
    return (x.astype(jnp.float32) + offset).astype(x.dtype)
