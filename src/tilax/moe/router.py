"""The router: float32 logits, scores, expert choice, combine weights and the router's aux.

Scores are ``softmax(logits)`` or, with ``score_func="sigmoid"``, ``sigmoid(logits)`` per
expert. Experts are *selected* by the scores plus an optional balance bias (DeepSeek-V3's
auxiliary-loss-free balancing: the bias moves the choice, never the weights, and gets no
gradient), optionally only inside each token's best groups of experts (group-limited routing,
:func:`keep_best_groups`); the combine weights are the unbiased scores of the chosen experts,
renormalised to sum 1 when asked, times ``routed_scale``.

The router always runs in float32 whatever the layer's dtype: a bfloat16 logit is too coarse to
rank experts reliably. The matmul is small (``[T, d_model] x [d_model, E]``) but reads every
token, so its speed matters: for bfloat16 tokens :func:`router_logits` computes the float32
products exactly on the tensor cores (the router split into three bfloat16 pieces) instead of
a float32 matmul, and :func:`top_k_experts` picks a few experts by repeated ``argmax`` rather
than a sort. For ``impl="mosaic"`` on Hopper the softmax, the top-k and their gradient run as
two Mosaic GPU kernels instead of XLA's chain of small ones (``mosaic.router``).

:func:`skew_tokens` is the benchmark/test knob that makes routing skewed. It moves the *inputs*
along a direction the router maps onto a fixed per-expert bias, so the layer itself and its
router weights are untouched: the same parameters and the same math, only a different batch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tilax.moe import dispatch, rules

# The router's matmul decides which experts run: keep it at full float32 precision on every
# device (GPUs would otherwise use TF32 and may flip near-ties between implementations).
ROUTER_PRECISION = jax.lax.Precision.HIGHEST


SCORE_FUNCS = ("softmax", "sigmoid")


class RouterOutput(NamedTuple):
    """What the router decides for ``T`` tokens and ``E`` experts (all float32 / int32).

    Attributes:
        logits: ``[T, E]`` float32, ``x @ router``.
        probs: ``[T, E]`` float32, each token's distribution over the experts that the aux
            loss reads: ``softmax(logits)``, or with sigmoid scores the scores normalised to
            sum 1 (``s / sum(s)``, DeepSeek-V3's balance loss).
        expert_ids: ``[T, k]`` int32, the top-k experts of each token, best first (by the
            selection scores: the scores plus the balance bias, inside the kept groups).
        weights: ``[T, k]`` float32, their combine weights: the chosen experts' scores
            (without the bias), divided by their sum when ``renormalize``, times
            ``routed_scale``.
    """

    logits: jax.Array
    probs: jax.Array
    expert_ids: jax.Array
    weights: jax.Array


def route(
    x: jax.Array,
    router: jax.Array,
    top_k: int,
    renormalize: bool,
    backend: str | None = None,
    *,
    score_func: str = "softmax",
    bias: jax.Array | None = None,
    expert_groups: int = 1,
    group_top_k: int = 1,
    routed_scale: float = 1.0,
    deterministic: bool = False,
) -> RouterOutput:
    """Route tokens ``x: [T, d_model]`` with ``router: [d_model, E]`` to their top-k experts.

    Scores ``s`` are ``softmax(logits)`` or ``sigmoid(logits)`` (``score_func``). Experts are
    ranked by ``s + bias`` (``bias: [E]``, or none), among the experts of each token's
    ``group_top_k`` best groups when ``expert_groups > 1`` (:func:`keep_best_groups`); the
    weights are the chosen experts' ``s``, divided by their sum when ``renormalize``, times
    ``routed_scale``. Ties go to the lower expert (and the lower group) index, as in
    ``jax.lax.top_k``. Differentiable with respect to ``x`` and ``router`` through the
    logits, the probabilities and the weights; ``bias`` only moves the choice and gets a zero
    gradient. ``backend`` ``"mosaic"`` takes the Mosaic GPU kernels of ``mosaic.router`` for
    bfloat16 ``x`` where they apply (``mosaic.router.block_tokens``: no bias, no groups; the
    same math, with the GPU's approximate ``exp`` and division, so the scores may differ from
    XLA's in their last bits); otherwise XLA routes. ``deterministic`` picks the top scores so
    that their gradient has no scatter-add (:func:`select_experts`); the Mosaic GPU kernels'
    gradient has none either way.
    """
    ranked = None
    if (backend == "mosaic" and x.dtype == jnp.bfloat16
            and rules.variant("router") == "kernels"):  # the router rule of tilax.moe.rules
        from tilax.moe.mosaic import router as router_mosaic  # a GPU backend: imported here

        if router_mosaic.block_tokens(x.shape[0], router.shape[1], top_k,
                                      biased=bias is not None,
                                      expert_groups=expert_groups) is not None:
            ranked = _ranked_on_mosaic(top_k, score_func, x, router.astype(jnp.float32))
    if ranked is None:
        logits = router_logits(x, router)
        scores = expert_scores(logits, score_func)
        if bias is None and expert_groups == 1:
            top_scores, expert_ids = top_k_experts(scores, top_k, deterministic)
        else:
            selection = scores
            if bias is not None:  # moves the choice only: no gradient reaches the bias
                selection = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
            if expert_groups > 1:
                selection = keep_best_groups(selection, expert_groups, group_top_k)
            expert_ids = top_k_experts(selection, top_k)[1]
            top_scores = (select_experts(scores, expert_ids) if deterministic
                          else jnp.take_along_axis(scores, expert_ids, axis=-1))
    else:
        logits, scores, expert_ids, top_scores = ranked
    if renormalize:
        top_scores = top_scores / jnp.sum(top_scores, axis=-1, keepdims=True)
    if routed_scale != 1.0:
        top_scores = top_scores * jnp.float32(routed_scale)
    probs = scores
    if score_func == "sigmoid":  # the aux loss's distribution: the scores normalised
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    return RouterOutput(logits, probs, expert_ids, top_scores)


def route_layer(
    x: jax.Array, params: dict, config, backend: str | None = None
) -> RouterOutput:
    """:func:`route` with the router weights (and ``router_bias`` when
    ``config.balance_bias``) of the layer's ``params`` and the routing fields of its
    ``MoEConfig`` ``config``."""
    return route(
        x, params["router"], config.top_k, config.renormalize, backend=backend,
        score_func=config.score_func,
        bias=params["router_bias"] if config.balance_bias else None,
        expert_groups=config.expert_groups, group_top_k=config.group_top_k,
        routed_scale=config.routed_scale, deterministic=config.deterministic,
    )


def expert_scores(logits: jax.Array, score_func: str) -> jax.Array:
    """``[T, E]`` float32 scores of the logits: ``softmax`` over the experts or a ``sigmoid``
    of each logit."""
    if score_func == "sigmoid":
        return jax.nn.sigmoid(logits)
    if score_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")


def keep_best_groups(selection: jax.Array, expert_groups: int, group_top_k: int) -> jax.Array:
    """Group-limited routing: ``selection: [T, E]`` with every expert outside each token's
    ``group_top_k`` best groups set to ``-inf``.

    The experts form ``expert_groups`` contiguous groups of ``E / expert_groups``; a group's
    score is the sum of its two largest selection scores (its one score for groups of one
    expert); ties between groups go to the lower group index.
    """
    num_tokens, num_experts = selection.shape
    size = num_experts // expert_groups
    grouped = selection.reshape(num_tokens, expert_groups, size)
    if size == 1:
        group_scores = grouped[..., 0]
    else:
        # the best, then the best of the rest (one copy of a tied best stays in the rest)
        members = jnp.arange(size, dtype=jnp.int32)
        first = jnp.argmax(grouped, axis=-1).astype(jnp.int32)
        second = jnp.max(jnp.where(members == first[..., None], -jnp.inf, grouped), axis=-1)
        group_scores = jnp.max(grouped, axis=-1) + second
    best_groups = top_k_experts(group_scores, group_top_k)[1]  # [T, group_top_k]
    groups = jnp.arange(expert_groups, dtype=jnp.int32)
    kept = jnp.any(best_groups[..., None] == groups, axis=-2)  # [T, G]
    return jnp.where(kept[..., None], grouped, -jnp.inf).reshape(num_tokens, num_experts)


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
    """float32 ``x @ router`` for ``x: [T, d_model]`` and ``router: [d_model, E]``.

    bfloat16 ``x`` takes :func:`_bf16_logits`: the same float32 products, on the tensor cores
    (the float32 matmuls of the E8 layer's router, forward and backward, took 0.42 ms of a
    6.5 ms train step on the H200). Other dtypes take a float32 matmul at
    :data:`ROUTER_PRECISION`.
    """
    router32 = router.astype(jnp.float32)
    if x.dtype == jnp.bfloat16:
        return _bf16_logits(x, router32)
    return jnp.dot(x.astype(jnp.float32), router32, precision=ROUTER_PRECISION)


def bf16_pieces(a: jax.Array) -> list[jax.Array]:
    """Three bfloat16 arrays that add up to float32 ``a`` exactly (8 significant bits each,
    and each rounding's remainder is exact in float32)."""
    pieces = []
    for _ in range(3):
        # Round with reduce_precision, not a float32 -> bfloat16 -> float32 round trip: XLA's
        # GPU compiler may drop such a pair (excess precision allowed), making the remainder 0.
        piece = jax.lax.reduce_precision(a, exponent_bits=8, mantissa_bits=7)
        pieces.append(piece.astype(jnp.bfloat16))
        a = a - piece
    return pieces


def sum_thirds(parts: jax.Array) -> jax.Array:
    """``[..., 3n] -> [..., n]``: the three pieces' partial results, smallest first."""
    n = parts.shape[-1] // 3
    return (parts[..., 2 * n :] + parts[..., n : 2 * n]) + parts[..., :n]


@jax.custom_vjp
def _bf16_logits(x: jax.Array, router32: jax.Array) -> jax.Array:
    """``x @ router32`` for bfloat16 ``x``: a product of a bfloat16 and a bfloat16 piece of the
    router is exact in float32, so one bfloat16 matmul against the three pieces side by side
    (float32 accumulation) gives float32 logits; only the sums round, as in a float32 matmul."""
    return sum_thirds(_logit_parts(x, router32))


def _logit_parts(x: jax.Array, router32: jax.Array) -> jax.Array:
    """``[T, 3E]`` float32: bfloat16 ``x`` times the router's three pieces side by side, one
    matmul; its thirds add up to the logits."""
    pieces = jnp.concatenate(bf16_pieces(router32), axis=1)
    return jnp.dot(x, pieces, preferred_element_type=jnp.float32)


def _bf16_logits_fwd(x, router32):
    return _bf16_logits(x, router32), (x, router32)


def _bf16_logits_bwd(residuals, d_logits):
    x, router32 = residuals
    d0, d1, d2 = bf16_pieces(d_logits)
    return _logits_grads(x, router32, jnp.concatenate([d0, d1, d2], axis=1),
                         jnp.concatenate([d0, d0, d1], axis=1))


def _logits_grads(x, router32, d_pieces, dx_pieces):
    """The gradients of ``x @ router32`` (bfloat16 ``x``) from the logits' gradient as its
    bfloat16 pieces ``d_pieces = [g0 | g1 | g2]`` and ``dx_pieces = [g0 | g0 | g1]``."""
    # d_router = x^T @ d_logits: exact products again (x is bfloat16).
    d_router = sum_thirds(
        jax.lax.dot_general(
            x, d_pieces, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
    )
    # d_x = d_logits @ router^T, rounded to bfloat16: the three largest of the nine piece
    # products, g0 r0 + g0 r1 + g1 r0 (relative error ~2**-16), are far more than its 8 bits
    # need.
    r_pieces = bf16_pieces(router32.T)
    d_x = jnp.dot(
        dx_pieces,
        jnp.concatenate([r_pieces[0], r_pieces[1], r_pieces[0]], axis=0),
        preferred_element_type=jnp.float32,
    )
    return d_x.astype(x.dtype), d_router


_bf16_logits.defvjp(_bf16_logits_fwd, _bf16_logits_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ranked_on_mosaic(top_k, score_func, x, router32):
    """``(logits, scores, expert_ids, top_scores)`` of bfloat16 ``x`` by the kernels of
    ``mosaic.router``: the logits' pieces by one bfloat16 matmul (:func:`_logit_parts`), the
    rest by one kernel forward and one backward."""
    return _ranked_on_mosaic_fwd(top_k, score_func, x, router32)[0]


def _ranked_on_mosaic_fwd(top_k, score_func, x, router32):
    from tilax.moe.mosaic import router as router_mosaic

    parts = _logit_parts(x, router32)
    logits, scores, expert_ids, top_scores = router_mosaic.rank(parts, top_k, score_func)
    outputs = (logits, scores, expert_ids.T, top_scores.T)
    return outputs, (x, router32, scores, expert_ids)


def _ranked_on_mosaic_bwd(top_k, score_func, residuals, cotangents):
    from tilax.moe.mosaic import router as router_mosaic

    del top_k
    x, router32, scores, expert_ids = residuals
    d_logits, d_scores, _, d_top = cotangents
    # Dense gradients of the logits and scores come only from aux losses.
    dense = [None if _zero(g) else g for g in (d_scores, d_logits)]
    d_top = jnp.zeros(expert_ids.shape, jnp.float32) if _zero(d_top) else d_top.T
    d_pieces, dx_pieces = router_mosaic.logit_grad_pieces(scores, expert_ids, d_top, *dense,
                                                          score_func=score_func)
    return _logits_grads(x, router32, d_pieces, dx_pieces)


def _zero(cotangent) -> bool:
    return isinstance(cotangent, jax.custom_derivatives.SymbolicZero)


def _ranked_on_mosaic_fwd_symbolic(top_k, score_func, x, router32):
    return _ranked_on_mosaic_fwd(top_k, score_func, x.value, router32.value)


_ranked_on_mosaic.defvjp(_ranked_on_mosaic_fwd_symbolic, _ranked_on_mosaic_bwd,
                         symbolic_zeros=True)

# Up to this many experts per token, top_k_experts takes that many argmax passes over the
# probabilities instead of XLA's sort of every row (0.08 ms for [131072, 8] on the H200; at
# E64 top-8 the decoder's train step took 12.15 against 12.35 ms with the passes).
ARGMAX_TOP_K_MAX = 8


def top_k_experts(
    probs: jax.Array, top_k: int, deterministic: bool = False
) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(probs, top_k)`` with int32 ids, for router scores (selection scores
    too: any value above ``-inf``; at least ``top_k`` of them a row).

    The same result, ties to the lower expert index: for ``top_k <= ARGMAX_TOP_K_MAX`` each
    pass takes the first maximum and masks it out (cheap elementwise work where the sort of
    a ``[T, E]`` array is not). With ``deterministic`` the top probabilities are picked by
    :func:`select_experts` (a select and a sum), whose gradient is a select: the gather's
    gradient is a scatter-add, which XLA's GPU backend runs with atomics.
    """
    if top_k > ARGMAX_TOP_K_MAX:
        top_probs, expert_ids = jax.lax.top_k(probs, top_k)
        expert_ids = expert_ids.astype(jnp.int32)
        if deterministic:
            top_probs = select_experts(probs, expert_ids)
        return top_probs, expert_ids
    experts = jnp.arange(probs.shape[-1], dtype=jnp.int32)
    remaining, chosen = probs, []
    for _ in range(top_k):
        best = jnp.argmax(remaining, axis=-1).astype(jnp.int32)
        chosen.append(best)
        # -inf ranks a chosen expert below every other one (the ranked values are above it).
        remaining = jnp.where(experts == best[..., None], -jnp.inf, remaining)
    expert_ids = jnp.stack(chosen, axis=-1)
    if deterministic:
        return select_experts(probs, expert_ids), expert_ids
    return jnp.take_along_axis(probs, expert_ids, axis=-1), expert_ids


def select_experts(values: jax.Array, expert_ids: jax.Array) -> jax.Array:
    """``take_along_axis(values, expert_ids, -1)`` for ``values: [T, E]``, ``expert_ids:
    [T, k]``, as a select of each chosen expert's value and a sum over the experts: exact
    (one term is nonzero), and its gradient is a select, with no scatter."""
    experts = jnp.arange(values.shape[-1], dtype=expert_ids.dtype)
    chosen = expert_ids[..., None] == experts
    return jnp.sum(jnp.where(chosen, values[..., None, :], 0.0), axis=-1)


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
