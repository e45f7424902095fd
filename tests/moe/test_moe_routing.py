"""DeepSeek-style routing (``MoEConfig.score_func``, ``balance_bias``, ``expert_groups``,
``group_top_k``, ``routed_scale``) and ``tilax.moe_update_bias``, against a plain-jnp
reference written here from the definitions: the experts chosen on hand-made logits where the
groups and the bias change the choice, the layer's output, ``aux`` counts and every gradient
(zero for ``router_bias``) for the XLA impls, the Pallas path and the Mosaic GPU backend in the
interpreters, the router's Mosaic GPU kernels with sigmoid scores, and the bias update.

The Pallas and Mosaic GPU cases run in JAX's interpreters (seconds each): marked ``kernels``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import peak_rel_err
from moe_testing import interpreted_marked, router_logit_parts
from mosaic_interpret import available, gpu_interpreter

import tilax
from tilax import _pallas
from tilax.moe import reference, router
from tilax.moe.mosaic import router as mosaic_router

HIGHEST = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------------------------
# The reference: the definitions in plain jnp (stable sorts for every choice: ties go to the
# lower index), every expert on every token at the highest precision.


@jax.jit
def reference_route(logits, config, bias=None):
    """``(expert_ids [T, k], weights [T, k], probs [T, E])`` from float32 ``logits``."""
    logits = jnp.asarray(logits, jnp.float32)
    num_tokens, num_experts = logits.shape
    if config.score_func == "sigmoid":
        scores = 1.0 / (1.0 + jnp.exp(-logits))
        probs = scores / jnp.sum(scores, axis=1, keepdims=True)
    else:
        scores = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
        scores = scores / jnp.sum(scores, axis=1, keepdims=True)
        probs = scores
    selection = jax.lax.stop_gradient(scores)
    if bias is not None:
        selection = selection + jax.lax.stop_gradient(jnp.asarray(bias, jnp.float32))
    groups = config.expert_groups
    if groups > 1:
        grouped = selection.reshape(num_tokens, groups, num_experts // groups)
        two_best = -jnp.sort(-grouped, axis=-1)[..., :2]
        group_scores = jnp.sum(two_best, axis=-1)
        order = jnp.argsort(-group_scores, axis=1, stable=True)[:, : config.group_top_k]
        kept = jnp.zeros((num_tokens, groups), bool).at[
            jnp.arange(num_tokens)[:, None], order].set(True)
        selection = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(selection.shape)
    expert_ids = jnp.argsort(-selection, axis=1, stable=True)[:, : config.top_k]
    weights = jnp.take_along_axis(scores, expert_ids, axis=1)
    if config.renormalize:
        weights = weights / jnp.sum(weights, axis=1, keepdims=True)
    return expert_ids, weights * config.routed_scale, probs


def reference_layer(params, x, config):
    """``(y, aux)`` of the layer in float32 from the definitions (dropless routing)."""
    x32 = x.reshape(-1, config.d_model).astype(jnp.float32)

    def mm(spec, a, b):
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32), precision=HIGHEST)

    logits = mm("td,de->te", x32, params["router"])
    ids, weights, probs = reference_route(logits, config, params.get("router_bias"))
    gate = mm("td,edh->teh", x32, params["w_gate"])
    up = mm("td,edh->teh", x32, params["w_up"])
    every = mm("teh,ehd->ted", jax.nn.silu(gate) * up, params["w_down"])
    y = jnp.sum(weights[:, :, None] * jnp.take_along_axis(every, ids[:, :, None], axis=1), 1)
    if config.shared_hidden:
        shared = params["shared"]
        hidden = jax.nn.silu(mm("td,ds->ts", x32, shared["w_gate"]))
        y = y + mm("ts,sd->td", hidden * mm("td,ds->ts", x32, shared["w_up"]),
                   shared["w_down"])
    counts = jnp.sum(jax.nn.one_hot(ids, config.num_experts, dtype=jnp.int32), axis=(0, 1))
    fractions = counts / ids.size
    aux = {"expert_counts": counts,
           "load_balance_loss": config.num_experts * jnp.sum(fractions * probs.mean(0))}
    return y.reshape(x.shape), aux


def _config(**overrides):
    fields = dict(d_model=24, d_hidden=40, num_experts=8, top_k=3, dtype=jnp.float32,
                  impl="blocked", block_m=16, block_n=16, block_k=16)
    return tilax.MoEConfig(**{**fields, **overrides})


# ----------------------------------------------------------------------------------------------
# Expert choice on hand-made logits: x = identity rows, router = the logits' transpose


def _route(logits, config, bias=None):
    """The router's decision for tokens whose logits are ``logits`` (``x @ router`` with
    ``x`` the identity's rows and ``router`` the logits themselves)."""
    logits = jnp.asarray(logits, jnp.float32)
    bias = None if bias is None else jnp.asarray(bias, jnp.float32)
    return _route_jit(jnp.eye(logits.shape[0], dtype=jnp.float32), logits, bias, config)


@jax.jit
def _route_jit(x, logits, bias, config):
    return router.route(
        x, logits, config.top_k, config.renormalize, score_func=config.score_func, bias=bias,
        expert_groups=config.expert_groups, group_top_k=config.group_top_k,
        routed_scale=config.routed_scale)


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-np.asarray(v, np.float64)))


def test_groups_change_the_choice():
    # Four groups of two. Token 0's best expert (0, logit 5) sits beside a poor one: group 1's
    # two good experts (4, 3.5) outscore group 0 (5, -5), and only one group is kept.
    # Token 1 ties every group: the lowest group (0) is kept. Token 2: group 3 is best.
    logits = [[5.0, -5.0, 4.0, 3.5, 0.0, 0.0, 0.0, 0.0],
              [0.0] * 8,
              [-1.0, -1.0, -1.0, -1.0, 0.0, 1.0, 2.0, 2.0]]
    grouped = _config(num_experts=8, top_k=2, score_func="sigmoid", expert_groups=4,
                      group_top_k=1)
    routed = _route(logits, grouped)
    np.testing.assert_array_equal(routed.expert_ids, [[2, 3], [0, 1], [6, 7]])
    s = _sigmoid(logits)
    top = np.take_along_axis(s, np.asarray(routed.expert_ids), axis=1)
    np.testing.assert_allclose(routed.weights, top / top.sum(1, keepdims=True), rtol=1e-6)
    # Without groups expert 0 wins token 0; with two groups kept, groups 0 and 1.
    assert _route(logits, _config(num_experts=8, top_k=2, score_func="sigmoid")
                  ).expert_ids[0].tolist() == [0, 2]
    two_groups = _config(num_experts=8, top_k=2, score_func="sigmoid", expert_groups=4,
                         group_top_k=2)
    assert _route(logits, two_groups).expert_ids[0].tolist() == [0, 2]
    # Groups of one expert: a group's score is its one score (plain top-k inside the kept).
    singles = _config(num_experts=8, top_k=2, expert_groups=8, group_top_k=3)
    np.testing.assert_array_equal(_route(logits, singles).expert_ids, [[0, 2], [0, 1], [6, 7]])
    for config in (grouped, two_groups, singles):
        ids = reference_route(jnp.asarray(logits), config)[0]
        np.testing.assert_array_equal(_route(logits, config).expert_ids, ids)


def test_group_score_is_the_sum_of_the_two_largest():
    # Group 0 holds the best expert (logit 6) and three poor ones; group 1 four good ones:
    # by the best score group 0 wins, by the sum of the two best group 1 does.
    logits = [[6.0, -6.0, -6.0, -6.0, 5.5, 5.5, 5.5, 5.5]]
    config = _config(num_experts=8, top_k=2, score_func="sigmoid", expert_groups=2)
    np.testing.assert_array_equal(_route(logits, config).expert_ids, [[4, 5]])
    # softmax scores: the same rule on the probabilities
    softmax = _config(num_experts=8, top_k=2, expert_groups=2)
    np.testing.assert_array_equal(_route(logits, softmax).expert_ids, [[4, 5]])


def test_bias_selects_and_the_scores_weigh():
    logits = [[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]]
    bias = [0.0, 0.0, 5.0, -0.25]
    for score_func in ("softmax", "sigmoid"):
        config = _config(num_experts=4, top_k=2, score_func=score_func, balance_bias=True,
                         routed_scale=2.5, renormalize=False)
        routed = _route(logits, config, bias)
        # expert 2 selected first by its bias; token 1 ties 0 and 1: the lower index first
        np.testing.assert_array_equal(routed.expert_ids, [[2, 0], [2, 0]])
        v = np.asarray(logits, np.float64)
        s = _sigmoid(v) if score_func == "sigmoid" else np.exp(v) / np.exp(v).sum(1, keepdims=1)
        expected = 2.5 * np.take_along_axis(s, np.asarray(routed.expert_ids), axis=1)
        np.testing.assert_allclose(routed.weights, expected, rtol=1e-6)
        # the aux distribution: softmax probabilities, or the sigmoid scores normalised
        np.testing.assert_allclose(routed.probs, s / s.sum(1, keepdims=True), rtol=1e-6)


def test_bias_is_added_before_the_groups_are_scored():
    # The bias of expert 6 lifts group 3 over group 0 (sums of biased scores).
    logits = [[3.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    config = _config(num_experts=8, top_k=2, score_func="sigmoid", balance_bias=True,
                     expert_groups=4)
    bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0]
    np.testing.assert_array_equal(_route(logits, config, bias).expert_ids, [[6, 7]])
    np.testing.assert_array_equal(_route(logits, config).expert_ids, [[0, 1]])
    np.testing.assert_array_equal(
        reference_route(jnp.asarray(logits), config, jnp.asarray(bias))[0], [[6, 7]])


def test_defaults_are_the_softmax_router_bitwise():
    x = jax.random.normal(jax.random.key(0), (50, 12))
    w = jax.random.normal(jax.random.key(1), (12, 8))
    plain = router.route(x, w, 3, True)
    explicit = router.route(x, w, 3, True, score_func="softmax", bias=None, expert_groups=1,
                            group_top_k=1, routed_scale=1.0)
    for a, b in zip(plain, explicit, strict=True):
        np.testing.assert_array_equal(a, b)
    probs = jax.nn.softmax(router.router_logits(x, w), axis=-1)
    top, ids = jax.lax.top_k(probs, 3)
    np.testing.assert_array_equal(plain.expert_ids, ids)
    np.testing.assert_array_equal(plain.weights, top / jnp.sum(top, -1, keepdims=True))


@pytest.mark.parametrize("top_k", [2, router.ARGMAX_TOP_K_MAX + 1])  # argmax passes and a sort
def test_random_routing_matches_the_reference(top_k):
    logits = jax.random.normal(jax.random.key(2), (300, 16)) * 2
    logits = logits.at[:30].set(jnp.round(logits[:30]))  # ties
    bias = jax.random.normal(jax.random.key(3), (16,)) * 0.2
    config = _config(num_experts=16, top_k=top_k, score_func="sigmoid", balance_bias=True,
                     expert_groups=4, group_top_k=3, routed_scale=1.7)
    routed = router.route(jnp.eye(300, dtype=jnp.float32), logits, top_k, True,
                          score_func="sigmoid", bias=bias, expert_groups=4, group_top_k=3,
                          routed_scale=1.7)
    ids, weights, probs = reference_route(logits, config, bias)
    np.testing.assert_array_equal(routed.expert_ids, ids)
    np.testing.assert_allclose(routed.weights, weights, rtol=2e-6)
    np.testing.assert_allclose(routed.probs, probs, rtol=2e-6)
    # each token's experts lie in at most three groups, and the groups changed some choices
    groups_used = jnp.sum(jnp.sum(jax.nn.one_hot(ids // 4, 4), axis=1) > 0, axis=-1)
    assert int(jnp.max(groups_used)) <= 3
    ungrouped = reference_route(logits, dataclasses.replace(config, expert_groups=1,
                                                            group_top_k=1), bias)[0]
    assert bool(jnp.any(ungrouped != ids))


# ----------------------------------------------------------------------------------------------
# The layer: output, aux counts and every gradient against the reference

ROUTINGS = {
    # DeepSeek-V3's router: sigmoid scores, the balance bias, groups, a scale, a shared expert
    "deepseek": dict(score_func="sigmoid", balance_bias=True, expert_groups=4, group_top_k=2,
                     routed_scale=2.5, shared_hidden=16),
    "sigmoid": dict(score_func="sigmoid"),
    "softmax_groups": dict(expert_groups=2, group_top_k=1, top_k=2),
    "softmax_bias_scaled": dict(balance_bias=True, routed_scale=0.5, renormalize=False),
}
# blocked on every routing; ragged_dot and the Pallas path in the interpreter (kernels) on
# the DeepSeek config; every Pallas dispatch sees the same routed copies.
LAYER_CASES = ([("blocked", "sorted", routing) for routing in ROUTINGS]
               + [("ragged_dot", "sorted", "deepseek")]
               + [("pallas", dispatch, routing) for dispatch in ("sorted", "fused_gsum")
                  for routing in ("deepseek", "softmax_groups")])


def _layer_inputs(config, tokens=37):
    params = tilax.moe_init(jax.random.key(0), config)
    if config.balance_bias:  # a bias that moves the choice
        params["router_bias"] = jax.random.normal(jax.random.key(3), (config.num_experts,)) * 0.3
    x = jax.random.normal(jax.random.key(1), (tokens, config.d_model)).astype(config.dtype)
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    return params, x, cotangent


def _train_step(apply, params, x, cotangent):
    """``(y, aux, grads)`` of a loss using ``y`` and the load-balance loss."""

    def loss(params, x):
        y, aux = apply(params, x)
        value = jnp.sum(y.astype(jnp.float32) * cotangent) + 0.3 * aux["load_balance_loss"]
        return value, (y, aux)

    (_, (y, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x)
    return y, aux, grads


_apply = jax.jit(tilax.moe_apply)


def _check_layer(config, tokens=37, tol=1e-5):
    params, x, cotangent = _layer_inputs(config, tokens)
    y, aux, grads = _train_step(lambda p, x: tilax.moe_apply(p, x, config), params, x,
                                cotangent)
    y_ref, aux_ref, grads_ref = _train_step(lambda p, x: reference_layer(p, x, config), params,
                                            x, cotangent)
    assert peak_rel_err(y, y_ref) < tol, "output"
    np.testing.assert_array_equal(aux["expert_counts"], aux_ref["expert_counts"])
    np.testing.assert_allclose(aux["load_balance_loss"], aux_ref["load_balance_loss"],
                               rtol=1e-5)
    assert set(aux) == {"expert_counts", "max_expert_frac", "empty_experts", "dropped_frac",
                        "router_z_loss", "load_balance_loss"}
    flat_ref = jax.tree_util.tree_flatten_with_path(grads_ref)[0]
    assert jax.tree.structure(grads) == jax.tree.structure(grads_ref)
    for (path, expected), actual in zip(flat_ref, jax.tree.leaves(grads), strict=True):
        name = jax.tree_util.keystr(path)
        if "router_bias" in name:
            np.testing.assert_array_equal(actual, np.zeros(config.num_experts), err_msg=name)
        else:
            assert peak_rel_err(actual, expected) < tol, f"gradient {name}"
    return params, x, aux


@pytest.mark.parametrize("impl,dispatch,routing", interpreted_marked(LAYER_CASES))
def test_layer_matches_the_reference(impl, dispatch, routing):
    config = _config(impl=impl, dispatch=dispatch, **{"top_k": 3, **ROUTINGS[routing]})
    _check_layer(config)


def test_dense_routing():
    _check_layer(_config(routing="dense", **ROUTINGS["deepseek"]), tokens=16)


def test_bfloat16_layer_matches_the_oracle():
    # bf16 experts: against the library's float32 oracle at bf16 tolerance
    config = _config(dtype=jnp.bfloat16, **ROUTINGS["deepseek"])
    params, x, _ = _layer_inputs(config, tokens=64)
    y, _ = _apply(params, x, config)
    y_ref, _ = jax.jit(reference_layer)(params, x, config)
    y_oracle = jax.jit(reference.moe_oracle)(params, x, config)
    assert peak_rel_err(y_oracle, y_ref) < 1e-5
    assert peak_rel_err(y, y_ref) < 3e-2


def test_vmap_routes_each_element_on_its_own():
    config = _config(**ROUTINGS["deepseek"])
    params, x, _ = _layer_inputs(config, tokens=24)
    batch = x.reshape(2, 12, -1)
    y, aux = jax.jit(jax.vmap(tilax.moe_apply, in_axes=(None, 0, None)))(params, batch, config)
    for i in range(2):
        y_i, aux_i = _apply(params, batch[i], config)
        np.testing.assert_allclose(y[i], y_i, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(aux["expert_counts"][i], aux_i["expert_counts"])
    # the bias update sums a vmapped call's counts over its elements
    updated = tilax.moe_update_bias(params, aux, 0.1)["router_bias"]
    counts = np.asarray(aux["expert_counts"]).sum(0)
    np.testing.assert_allclose(updated - params["router_bias"],
                               0.1 * np.sign(counts.mean() - counts), atol=1e-6)


def test_routed_scale_scales_the_routed_output_only():
    base = _config(shared_hidden=16, score_func="sigmoid")
    params, x, _ = _layer_inputs(base)
    shared_only = jax.tree.map(jnp.zeros_like, {k: params[k] for k in
                                                 ("w_gate", "w_up", "w_down")})
    y1, _ = _apply(params, x, base)
    y3, _ = _apply(params, x, _config(shared_hidden=16, score_func="sigmoid", routed_scale=3.0))
    y_shared, _ = _apply({**params, **shared_only}, x, base)
    routed1, routed3 = y1 - y_shared, y3 - y_shared
    np.testing.assert_allclose(routed3, 3.0 * routed1, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(routed1))) > 0.1


def test_init_adds_a_zero_bias_and_keeps_the_matrices():
    plain = _config(score_func="sigmoid")
    biased = _config(score_func="sigmoid", balance_bias=True)
    p_plain = tilax.moe_init(jax.random.key(0), plain)
    p_biased = tilax.moe_init(jax.random.key(0), biased)
    assert set(p_biased) == set(p_plain) | {"router_bias"}
    assert p_biased["router_bias"].dtype == jnp.float32
    np.testing.assert_array_equal(p_biased["router_bias"], np.zeros(8))
    for name in p_plain:
        np.testing.assert_array_equal(p_biased[name], p_plain[name])
    # a zero bias chooses as no bias does
    x = jax.random.normal(jax.random.key(1), (20, 24))
    y_plain, aux_plain = _apply(p_plain, x, plain)
    y_biased, aux_biased = _apply(p_biased, x, biased)
    np.testing.assert_array_equal(y_plain, y_biased)
    np.testing.assert_array_equal(aux_plain["expert_counts"], aux_biased["expert_counts"])


# ----------------------------------------------------------------------------------------------
# moe_update_bias


def test_update_bias_moves_towards_an_even_load():
    config = _config(num_experts=4, top_k=2, score_func="sigmoid", balance_bias=True)
    params = tilax.moe_init(jax.random.key(0), config)
    params["router_bias"] = jnp.asarray([0.5, 0.0, -0.5, 1.0])
    aux = {"expert_counts": jnp.asarray([5, 2, 2, 0], jnp.int32)}  # mean 2.25
    updated = tilax.moe_update_bias(params, aux, 0.1)
    np.testing.assert_allclose(updated["router_bias"], [0.4, 0.1, -0.4, 1.1], rtol=1e-6)
    assert updated["router_bias"].dtype == jnp.float32
    for name in ("router", "w_gate", "w_up", "w_down"):
        assert updated[name] is params[name]
    even = tilax.moe_update_bias(params, {"expert_counts": jnp.full(4, 3)}, 0.1)
    np.testing.assert_array_equal(even["router_bias"], params["router_bias"])
    # jitted, with a traced rate; counts of a vmapped call are summed first
    jitted = jax.jit(tilax.moe_update_bias)(params, aux, jnp.float32(0.1))
    np.testing.assert_allclose(jitted["router_bias"], updated["router_bias"], rtol=1e-6)
    batched = {"expert_counts": jnp.asarray([[5, 0, 0, 0], [0, 2, 2, 0]])}
    np.testing.assert_allclose(tilax.moe_update_bias(params, batched, 0.1)["router_bias"],
                               updated["router_bias"], rtol=1e-6)
    assert tilax.moe.moe_update_bias is tilax.moe_update_bias


def test_update_bias_balances_a_skewed_router():
    # Tokens skewed towards the first experts (one expert takes a third of the copies, an
    # even load an eighth): a hundred bias steps spread them out.
    config = _config(num_experts=8, top_k=2, score_func="sigmoid", balance_bias=True)
    params = tilax.moe_init(jax.random.key(0), config)
    x = tilax.moe.skew_tokens(jax.random.normal(jax.random.key(1), (256, 24)),
                              params["router"], 0.3)

    def step(params, _):
        _, aux = tilax.moe_apply(params, x, config)
        return tilax.moe_update_bias(params, aux, 0.01), aux["max_expert_frac"]

    params, fractions = jax.jit(lambda p: jax.lax.scan(step, p, None, length=100))(params)
    assert float(fractions[0]) > 0.3
    assert float(fractions[-10:].max()) < 0.5 * float(fractions[0])
    # the favoured experts' biases went down, the neglected ones' up
    assert float(params["router_bias"][0]) < 0 < float(params["router_bias"][-1])


# ----------------------------------------------------------------------------------------------
# The router's Mosaic GPU kernels with sigmoid scores, in JAX's GPU interpreter


def needs_interpreter(test):
    skip = pytest.mark.skipif(available() is not None, reason=str(available()))
    return pytest.mark.kernels(skip(test))


@pytest.fixture
def few_sms():
    with _pallas.assume_device(sm_count=2):
        yield


def test_router_kernels_leave_bias_and_groups_to_xla():
    assert mosaic_router.block_tokens(256, 64, 8) == 64
    assert mosaic_router.block_tokens(256, 64, 8, biased=True) is None
    assert mosaic_router.block_tokens(256, 64, 8, expert_groups=8) is None
    with pytest.raises(ValueError, match="score_func must be one of"):
        mosaic_router.rank(jnp.zeros((64, 24)), 2, "tanh")


@needs_interpreter
def test_router_rank_sigmoid_is_xlas(few_sms):
    tokens, experts, top_k = 320, 16, 4
    parts = router_logit_parts(np.random.default_rng(0), tokens, experts)
    with gpu_interpreter():
        logits, scores, ids, top = jax.jit(mosaic_router.rank, static_argnums=(1, 2))(
            parts, top_k, "sigmoid")
    expected_logits = router.sum_thirds(parts)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(expected_logits))
    np.testing.assert_allclose(np.asarray(scores), np.asarray(jax.nn.sigmoid(expected_logits)),
                               rtol=1e-6, atol=1e-7)
    expected_top, expected_ids = router.top_k_experts(scores, top_k)
    np.testing.assert_array_equal(np.asarray(ids).T, np.asarray(expected_ids))
    np.testing.assert_array_equal(np.asarray(top).T, np.asarray(expected_top))


@needs_interpreter
@pytest.mark.parametrize("dense", [(), ("probs", "logits")])
def test_router_logit_grad_pieces_sigmoid(few_sms, dense):
    rng = np.random.default_rng(1)
    tokens, experts, top_k = 320, 16, 4
    logits = jnp.asarray(rng.standard_normal((tokens, experts)) * 2, jnp.float32)
    scores = jax.nn.sigmoid(logits)
    ids = router.top_k_experts(scores, top_k)[1]
    d_top = jnp.asarray(rng.standard_normal((tokens, top_k)), jnp.float32)
    d_dense = {name: jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32)
               for name in dense}

    def loss(logits):
        s = jax.nn.sigmoid(logits)
        value = jnp.sum(jnp.take_along_axis(s, ids, axis=-1) * d_top)
        return value + jnp.sum(s * d_dense.get("probs", 0.0)) + jnp.sum(
            logits * d_dense.get("logits", 0.0))

    expected = jax.grad(loss)(logits)
    with gpu_interpreter():
        d_pieces, dx_pieces = jax.jit(mosaic_router.logit_grad_pieces,
                                      static_argnames="score_func")(
            scores, ids.T, d_top.T, d_dense.get("probs"), d_dense.get("logits"),
            score_func="sigmoid")
    d_pieces = np.asarray(d_pieces, np.float32)
    thirds = [d_pieces[:, i * experts:(i + 1) * experts] for i in range(3)]
    np.testing.assert_allclose((thirds[2] + thirds[1]) + thirds[0], np.asarray(expected),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(dx_pieces, np.float32),
                                  np.concatenate([thirds[0], thirds[0], thirds[1]], 1))


@needs_interpreter
def test_route_sigmoid_on_mosaic_matches_xla(few_sms):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((256, 64)), jnp.bfloat16)
    weights = jnp.asarray(rng.standard_normal((64, 16)) * 0.1, jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((256, 4)), jnp.float32)

    def loss(x, weights, backend):
        routed = router.route(x, weights, 4, True, backend=backend, score_func="sigmoid",
                              routed_scale=2.0)
        aux = router.router_aux(routed, 16)
        value = jnp.sum(routed.weights * cotangent) + aux["load_balance_loss"]
        return value, routed.expert_ids

    step = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    with gpu_interpreter():
        traced = jax.jit(step, static_argnums=2).trace(x, weights, "mosaic")
        (value, ids), grads = traced.lower().compile()(x, weights)
    assert "moe_router_rank_mosaic" in str(traced.jaxpr)  # the kernels ran
    (value_x, ids_x), grads_x = step(x, weights, None)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_x))
    np.testing.assert_allclose(float(value), float(value_x), rtol=1e-6)
    for grad, grad_x in zip(grads, grads_x, strict=True):
        rtol = max(1e-5, float(jnp.finfo(grad.dtype).eps))
        np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(grad_x, np.float32),
                                   rtol=rtol, atol=1e-6)


@needs_interpreter
@pytest.mark.parametrize("routing", ["sigmoid", "deepseek"])
def test_mosaic_layer_matches_the_reference(few_sms, routing):
    # 128 tokens and 8 experts: the router kernels apply to sigmoid scores; the DeepSeek
    # config (bias, groups) routes in XLA. Experts and gradients against the reference.
    fields = {**ROUTINGS[routing], "shared_hidden": 0}
    config = tilax.MoEConfig(d_model=64, d_hidden=128, num_experts=8, top_k=3,
                             dtype=jnp.bfloat16, impl="mosaic", dispatch="fused", **fields)
    params, x, cotangent = _layer_inputs(config, tokens=128)

    def loss(apply):
        def value(p, x):
            y, aux = apply(p, x)
            return jnp.sum(y.astype(jnp.float32) * cotangent), (y, aux)

        return jax.jit(jax.value_and_grad(value, argnums=(0, 1), has_aux=True))

    with _pallas.assume_device(mosaic_unavailable_reason=None), gpu_interpreter():
        traced = loss(lambda p, x: tilax.moe_apply(p, x, config)).trace(params, x)
        (_, (y, aux)), grads = traced.lower().compile()(params, x)
    assert ("moe_router_rank_mosaic" in str(traced.jaxpr)) == (routing == "sigmoid")
    (_, (y_ref, aux_ref)), grads_ref = loss(
        lambda p, x: reference_layer(p, x, config))(params, x)
    np.testing.assert_array_equal(aux["expert_counts"], aux_ref["expert_counts"])
    assert peak_rel_err(y, y_ref) < 3e-2, "output"
    for (path, expected), actual in zip(
        jax.tree_util.tree_flatten_with_path(grads_ref)[0], jax.tree.leaves(grads), strict=True
    ):
        name = jax.tree_util.keystr(path)
        if "router_bias" in name:
            np.testing.assert_array_equal(actual, np.zeros(8), err_msg=name)
        else:
            assert peak_rel_err(actual, expected) < 3e-2, f"gradient {name}"
