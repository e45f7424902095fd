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
    # float32 products on every device (a GPU's default TF32 would blur the 1e-3 check).
    shift = np.asarray(router.router_logits(skewed, w) - router.router_logits(x, w))
    # Every token's logits move by the same ramp: 0, -s, -2s, ... with s = 9 sigma.
    np.testing.assert_allclose(shift - shift[:1], 0, atol=1e-3)
    sigma = float(jnp.std(router.router_logits(x, w)))
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


def test_bf16_pieces_add_up_to_the_float32_exactly():
    a = jax.random.normal(jax.random.key(0), (257, 9)) * jnp.logspace(-20, 20, 9)
    pieces = jax.jit(router.bf16_pieces)(a)  # compiled: XLA must keep every rounding
    assert all(p.dtype == jnp.bfloat16 for p in pieces)
    total = (pieces[2].astype(jnp.float32) + pieces[1]) + pieces[0]
    np.testing.assert_array_equal(total, a)


@pytest.mark.parametrize("num_experts", [8, 64])
def test_bf16_router_logits_and_grads_match_a_float32_matmul(num_experts):
    x = jax.random.normal(jax.random.key(1), (300, 96), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (96, num_experts)) * 0.1
    cot = jax.random.normal(jax.random.key(3), (300, num_experts))

    def float32_logits(x, w):
        return jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)

    # Compiled as in the layer (XLA's GPU passes once erased two of the three pieces).
    logits = jax.jit(router.router_logits)(x, w)
    want = float32_logits(x, w)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(want))))
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(router.router_logits(x, w) * cot), (0, 1)))(
        x, w
    )
    x32 = x.astype(jnp.float32)
    want_dx, want_dw = jax.grad(lambda x, w: jnp.sum(float32_logits(x, w) * cot), (0, 1))(x32, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    np.testing.assert_allclose(dw, want_dw, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(want_dw))))
    # d_x is bfloat16: the float32 gradient rounded once (half a unit in the last place), plus
    # the three-piece products' error (~2**-16 of the terms) where the terms cancel.
    np.testing.assert_allclose(
        np.float32(dx), want_dx, rtol=2**-8, atol=2**-14 * float(jnp.max(jnp.abs(want_dx)))
    )


@pytest.mark.parametrize("top_k", [1, 2, 3, 8, router.ARGMAX_TOP_K_MAX + 1])
def test_top_k_experts_matches_lax_top_k_with_ties(top_k):
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(4), (200, 16)), axis=-1)
    probs = probs.at[:20].set(1.0 / 16).at[20:30, 3:9].set(0.0)  # ties: lower index first
    got_probs, got_ids = router.top_k_experts(probs, top_k)
    want_probs, want_ids = jax.lax.top_k(probs, top_k)
    assert got_ids.dtype == jnp.int32
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_probs, want_probs)
    cot = jax.random.normal(jax.random.key(5), (200, top_k))
    np.testing.assert_array_equal(
        jax.grad(lambda p: jnp.sum(router.top_k_experts(p, top_k)[0] * cot))(probs),
        jax.grad(lambda p: jnp.sum(jax.lax.top_k(p, top_k)[0] * cot))(probs),
    )
