"""Router decisions, the aux dict against hand computations, and the routing skew knob."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tilax
from tilax.moe import router

# Token t routes with logits LOGITS[t] (x = identity rows, router = LOGITS^T's rows).
LOGITS = np.array(
    [
        [2.0, 1.0, 0.0, -1.0],
        [0.0, 3.0, 0.5, 0.0],
        [1.0, 0.0, 0.0, 4.0],
        [5.0, 0.0, 1.0, 0.0],
        [0.2, 0.1, 0.0, 0.3],
    ],
    np.float32,
)


def _softmax(v):
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_route_top2_renormalised():
    x = jnp.eye(5, dtype=jnp.float32)
    routed = router.route(x, jnp.asarray(LOGITS), top_k=2, renormalize=True)
    np.testing.assert_array_equal(routed.expert_ids, [[0, 1], [1, 2], [3, 0], [0, 2], [3, 0]])
    probs = _softmax(LOGITS.astype(np.float64))
    top = np.take_along_axis(probs, np.asarray(routed.expert_ids), axis=1)
    np.testing.assert_allclose(routed.weights, top / top.sum(1, keepdims=True), rtol=1e-6)
    raw = router.route(x, jnp.asarray(LOGITS), top_k=2, renormalize=False)
    np.testing.assert_allclose(raw.weights, top, rtol=1e-6)


def test_aux_matches_hand_computation():
    x = jnp.eye(5, dtype=jnp.float32)
    routed = router.route(x, jnp.asarray(LOGITS), top_k=2, renormalize=True)
    aux = router.router_aux(routed, 4, kept_copies=7)
    # Copies per expert: e0 {t0, t2, t3, t4}, e1 {t0, t1}, e2 {t1, t3}, e3 {t2, t4}.
    np.testing.assert_array_equal(aux["expert_counts"], [4, 2, 2, 2])
    assert float(aux["max_expert_frac"]) == pytest.approx(4 / 10)
    assert int(aux["empty_experts"]) == 0
    assert float(aux["dropped_frac"]) == pytest.approx(3 / 10)
    lse = np.log(np.exp(LOGITS.astype(np.float64)).sum(axis=1))
    assert float(aux["router_z_loss"]) == pytest.approx(np.mean(lse**2), rel=1e-6)
    fractions = np.array([4, 2, 2, 2]) / 10
    mean_probs = _softmax(LOGITS.astype(np.float64)).mean(axis=0)
    assert float(aux["load_balance_loss"]) == pytest.approx(
        4 * np.sum(fractions * mean_probs), rel=1e-6
    )


def test_aux_counts_empty_experts_and_no_drop():
    x = jnp.eye(5, dtype=jnp.float32)
    routed = router.route(x, jnp.asarray(LOGITS), top_k=1, renormalize=True)
    aux = router.router_aux(routed, 4)
    np.testing.assert_array_equal(aux["expert_counts"], [2, 1, 0, 2])  # t0,t3 | t1 | - | t2,t4
    assert int(aux["empty_experts"]) == 1
    assert float(aux["max_expert_frac"]) == pytest.approx(0.4)
    assert float(aux["dropped_frac"]) == 0.0


def test_layer_aux_uses_capacity_drops():
    config = tilax.MoEConfig(
        d_model=16, d_hidden=16, num_experts=2, top_k=1, routing="capacity",
        capacity_factor=0.5, impl="ragged_dot", dtype=jnp.float32,
    )
    params = tilax.moe_init(jax.random.key(0), config)
    # Tokens 0..5 pick experts 0,0,1,0,0,1: C = 2 drops tokens 3 and 4.
    choice = np.array([0, 0, 1, 0, 0, 1])
    router_w = np.zeros((16, 2), np.float32)
    router_w[np.arange(6), choice] = 5.0
    params["router"] = jnp.asarray(router_w)
    x = jnp.eye(16, dtype=jnp.float32)[:6]
    _, aux = tilax.moe_apply(params, x, config)
    np.testing.assert_array_equal(aux["expert_counts"], [4, 2])
    assert float(aux["dropped_frac"]) == pytest.approx(2 / 6)


def test_aux_losses_are_differentiable():
    x = jax.random.normal(jax.random.key(0), (8, 6))
    w = jax.random.normal(jax.random.key(1), (6, 3))

    def losses(w):
        aux = router.router_aux(router.route(x, w, 2, True), 3)
        return aux["router_z_loss"] + aux["load_balance_loss"]

    grad = jax.grad(losses)(w)
    assert grad.shape == w.shape and bool(jnp.all(jnp.isfinite(grad)))
    assert float(jnp.abs(grad).sum()) > 0


def test_skew_tokens_shifts_logits_by_a_ramp_and_empties_experts():
    key_w, key_x = jax.random.split(jax.random.key(3))
    w = jax.random.normal(key_w, (32, 8)) / np.sqrt(32)
    x = jax.random.normal(key_x, (512, 32))
    assert router.skew_tokens(x, w, 0.0) is x
    skewed = router.skew_tokens(x, w, 0.9)
    shift = np.asarray(skewed @ w - x @ w)
    # Every token's logits move by the same ramp: 0, -s, -2s, ... with s = 9 sigma.
    np.testing.assert_allclose(shift - shift[:1], 0, atol=1e-3)
    sigma = float(jnp.std(x @ w))
    np.testing.assert_allclose(np.diff(shift[0]), -9 * sigma, rtol=1e-3)
    aux_plain = router.router_aux(router.route(x, w, 2, True), 8)
    aux_skewed = router.router_aux(router.route(skewed, w, 2, True), 8)
    assert int(aux_plain["empty_experts"]) == 0
    assert int(aux_skewed["empty_experts"]) >= 4
    assert float(aux_skewed["max_expert_frac"]) > 0.45
    moderate = router.router_aux(router.route(router.skew_tokens(x, w, 0.5), w, 2, True), 8)
    assert aux_plain["max_expert_frac"] < moderate["max_expert_frac"]
    assert moderate["max_expert_frac"] < aux_skewed["max_expert_frac"]


@pytest.mark.parametrize("skew", [-0.1, 1.0])
def test_skew_tokens_rejects_out_of_range(skew):
    with pytest.raises(ValueError, match="skew"):
        router.skew_tokens(jnp.ones((2, 4)), jnp.ones((4, 2)), skew)
