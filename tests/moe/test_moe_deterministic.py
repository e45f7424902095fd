"""``MoEConfig.deterministic``: the same results as the default up to float rounding, for every
impl, and a train step with no order-dependent sum: no scatter-add (XLA's GPU backend runs one
with atomics where indices repeat) and no float atomics in the Pallas kernels it launches.

Bitwise repeatability itself shows only on a GPU: tests/moe/test_moe_gpu.py runs the train
step three times at a realistic size (``test_deterministic_train_step_is_bitwise_repeatable``).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import peak_rel_err
from moe_testing import interpreted_marked, order_dependent_ops
from mosaic_interpret import available, gpu_interpreter

import tilax
from tilax import _pallas
from tilax.moe import router, rules, skew_tokens
from tilax.moe.mosaic import gmm as mosaic_gmm

SMALL_TILES = dict(block_m=16, block_n=16, block_k=16)
# top-3: three copies of a token meet in every sum over a token's copies (with two, a sum
# from zero is the same in either order).
DIMS = dict(d_model=32, d_hidden=48, num_experts=5, top_k=3, shared_hidden=16)


def _inputs(config, tokens=37, skew=0.0):
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (tokens, config.d_model))
    if skew:
        x = skew_tokens(x, params["router"], skew)
    return params, x.astype(config.dtype)


def _loss(config):
    def loss(params, x):
        y, aux = tilax.moe_apply(params, x, config)
        cotangent = jax.random.normal(jax.random.key(2), y.shape)
        value = jnp.sum(y.astype(jnp.float32) * cotangent) + aux["load_balance_loss"]
        return value + 0.1 * aux["router_z_loss"], y

    return loss


def _train_step(config):
    return jax.jit(jax.value_and_grad(_loss(config), argnums=(0, 1), has_aux=True))


def _check_same_as_default(tol, tokens=37, skew=0.0, **config_kwargs):
    default = tilax.MoEConfig(**config_kwargs)
    deterministic = tilax.MoEConfig(**config_kwargs, deterministic=True)
    params, x = _inputs(default, tokens, skew)
    (_, y), grads = _train_step(default)(params, x)
    (_, y_det), grads_det = _train_step(deterministic)(params, x)
    assert y_det.dtype == y.dtype and y_det.shape == y.shape
    assert peak_rel_err(y_det, y) < tol, "output"
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, expected), actual in zip(flat, jax.tree.leaves(grads_det), strict=True):
        assert peak_rel_err(actual, expected) < tol, f"gradient {jax.tree_util.keystr(path)}"


XLA_CASES = [
    ("blocked", "dropless"),
    ("blocked", "capacity"),
    ("ragged_dot", "capacity"),
    ("auto", "dense"),
]


@pytest.mark.parametrize("impl,routing", XLA_CASES)
def test_xla_impls_match_default(impl, routing):
    _check_same_as_default(
        1e-5, impl=impl, routing=routing, capacity_factor=0.8, dtype=jnp.float32, **DIMS
    )


def test_skewed_blocked_matches_default_in_bfloat16():
    # one expert takes most tokens; bfloat16: the default adds a token's three copies'
    # gradients in bfloat16, the deterministic gather in float32
    _check_same_as_default(2e-2, skew=0.9, impl="blocked", dtype=jnp.bfloat16, **DIMS)


def test_top_k_above_argmax_passes_matches_default():
    # top-10 of 12 experts: the router takes lax.top_k's ids and selects their probabilities
    dims = dict(DIMS, num_experts=12, top_k=10)
    _check_same_as_default(1e-5, impl="ragged_dot", dtype=jnp.float32, **dims)


def test_one_pallas_layer_in_the_interpreter():
    """The everyday Pallas case: fused_gsum's atomic combine replaced by the gathering one."""
    _check_same_as_default(
        1e-5, impl="pallas", dispatch="fused_gsum", dtype=jnp.float32, **DIMS, **SMALL_TILES
    )


@pytest.mark.parametrize("impl,dispatch,routing,recompute", interpreted_marked([
    ("pallas", "sorted", "dropless", False),
    ("pallas", "gather", "capacity", False),
    ("pallas", "fused", "dropless", False),
    ("pallas", "fused_gsum", "capacity", False),
    ("pallas", "sorted", "dropless", True),
]))  # fmt: skip
def test_pallas_dispatches_match_default(impl, dispatch, routing, recompute):
    _check_same_as_default(
        1e-5,
        impl=impl,
        dispatch=dispatch,
        routing=routing,
        capacity_factor=0.8,
        recompute=recompute,
        recompute_rows=48,
        dtype=jnp.float32,
        **DIMS,
        **SMALL_TILES,
    )


def test_select_experts_is_the_gather():
    rng = np.random.default_rng(0)
    probs = jnp.asarray(rng.random((50, 7)), jnp.float32)
    ids = jnp.asarray(np.argsort(rng.random((50, 7)), axis=1)[:, :3], jnp.int32)
    expected = jnp.take_along_axis(probs, ids, axis=-1)
    np.testing.assert_array_equal(
        np.asarray(router.select_experts(probs, ids)), np.asarray(expected)
    )
    for top_k in (3, 9):  # argmax passes, lax.top_k
        wide = jnp.asarray(rng.random((20, 12)), jnp.float32)
        default = router.top_k_experts(wide, top_k)
        deterministic = router.top_k_experts(wide, top_k, deterministic=True)
        for a, b in zip(default, deterministic, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------------------------
# No order-dependent sum in the train step


def _scatter_combiners(hlo_text: str) -> list[str]:
    """The body of every ``stablehlo.scatter`` region of a lowered module's text."""
    bodies = []
    for match in re.finditer(r'"stablehlo\.scatter"\(.*?\}\)', hlo_text, re.DOTALL):
        bodies.append(match.group(0))
    return bodies


def _trace_step(config, tokens=64):
    params, x = _inputs(config, tokens)
    return jax.jit(jax.grad(lambda p, x: _loss(config)(p, x)[0], argnums=(0, 1))).trace(params, x)


@pytest.mark.parametrize("impl,dispatch,routing", [
    ("blocked", "sorted", "dropless"), ("blocked", "sorted", "capacity"),
    ("ragged_dot", "sorted", "dropless"), ("auto", "sorted", "dense"),
    ("pallas", "sorted", "dropless"), ("pallas", "fused_gsum", "dropless"),
    ("pallas", "fused_gsum", "capacity"),
])  # fmt: skip
def test_train_step_has_no_order_dependent_sum(impl, dispatch, routing):
    common = dict(
        **DIMS,
        impl=impl,
        dispatch=dispatch,
        routing=routing,
        capacity_factor=0.8,
        dtype=jnp.bfloat16,
        **(SMALL_TILES if impl == "pallas" else {}),
    )
    default = _trace_step(tilax.MoEConfig(**common))
    deterministic = _trace_step(tilax.MoEConfig(**common, deterministic=True))
    # the check finds what the default has: the router's gather gradient at least
    assert "scatter-add" in order_dependent_ops(default.jaxpr.jaxpr)
    if dispatch == "fused_gsum":
        assert "atomic_rmw" in order_dependent_ops(default.jaxpr.jaxpr)
    assert order_dependent_ops(deterministic.jaxpr.jaxpr) == []
    # and in the lowered module: no scatter region adds
    default_bodies = _scatter_combiners(default.lower().as_text())
    assert any("stablehlo.add" in body for body in default_bodies)
    for body in _scatter_combiners(deterministic.lower().as_text()):
        assert "stablehlo.add" not in body, body[:300]


def test_auto_picks_the_deterministic_kernels():
    """``impl="auto"`` runs the same backend with the flag; for ``fused_gsum`` it takes the
    rule of the kernels that then run (``fused``'s), whose row names the H200 measurements."""
    e8 = dict(d_model=512, d_hidden=1024, num_experts=8, top_k=2)
    with _pallas.assume_device(platform="gpu", device_kind="NVIDIA H200"):
        for dispatch in ("sorted", "fused"):
            default = rules.matching_rule(tilax.MoEConfig(**e8, dispatch=dispatch))
            assert (
                rules.matching_rule(tilax.MoEConfig(**e8, dispatch=dispatch, deterministic=True))
                == default
            )
        gsum = tilax.MoEConfig(**e8, dispatch="fused_gsum", deterministic=True)
        fused = rules.matching_rule(tilax.MoEConfig(**e8, dispatch="fused"))
        assert rules.matching_rule(gsum) == fused
        e64 = dict(d_model=512, d_hidden=256, num_experts=64, top_k=8)
        assert rules.matching_rule(tilax.MoEConfig(**e64, dispatch="fused_gsum")) is None
        assert (
            rules.matching_rule(
                tilax.MoEConfig(**e64, dispatch="fused_gsum", deterministic=True)
            ).backend
            == "mosaic"
        )
    # on a CPU auto is the platform rule's XLA impl, deterministic with the flag too
    config = tilax.MoEConfig(**DIMS, deterministic=True)
    assert tilax.moe.resolve_impl(config) == "blocked"
    assert order_dependent_ops(_trace_step(config).jaxpr.jaxpr) == []


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_deterministic_must_be_a_bool(value):
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        tilax.MoEConfig(**DIMS, deterministic=value)


def test_deterministic_is_part_of_the_static_config():
    a = tilax.MoEConfig(**DIMS)
    b = tilax.MoEConfig(**DIMS, deterministic=True)
    assert a != b and hash(a) != hash(b) and not a.deterministic and b.deterministic


# ----------------------------------------------------------------------------------------------
# Mosaic GPU in JAX's GPU interpreter


def needs_interpreter(test):
    skip = pytest.mark.skipif(available() is not None, reason=str(available()))
    return pytest.mark.kernels(skip(test))


@needs_interpreter
@pytest.mark.parametrize("dispatch,routing", [("sorted", "dropless"), ("fused_gsum", "capacity")])
def test_mosaic_matches_default_without_scatter_add(dispatch, routing):
    common = dict(
        d_model=64,
        d_hidden=128,
        num_experts=4,
        top_k=3,
        impl="mosaic",
        dispatch=dispatch,
        routing=routing,
        capacity_factor=0.8,
        dtype=jnp.bfloat16,
    )
    default = tilax.MoEConfig(**common)
    deterministic = tilax.MoEConfig(**common, deterministic=True)
    params, x = _inputs(default, 128)
    with _pallas.assume_device(mosaic_unavailable_reason=None, sm_count=2), gpu_interpreter():
        traced = [_train_step(c).trace(params, x) for c in (default, deterministic)]
        (_, y), grads = traced[0].lower().compile()(params, x)
        (_, y_det), grads_det = traced[1].lower().compile()(params, x)
    assert "scatter-add" in order_dependent_ops(traced[0].jaxpr.jaxpr)
    assert order_dependent_ops(traced[1].jaxpr.jaxpr) == []
    # the same kernels in the same order: the values agree bitwise but for the sums that the
    # deterministic mode orders (the combine, the router's gather gradient)
    assert peak_rel_err(y_det, y) < 1e-2, "output"
    for (path, expected), actual in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(grads_det), strict=True
    ):
        assert peak_rel_err(actual, expected) < 1e-2, f"gradient {jax.tree_util.keystr(path)}"


@needs_interpreter
def test_mosaic_swiglu_backward_row_sums_are_the_scatter_adds():
    """The combine weights' gradient gathered from the item owning each row equals the
    scatter-add of every item's rows, bitwise: empty experts, tiles shared by three experts,
    padding rows."""
    from tilax.moe import dispatch as row_dispatch

    rng = np.random.default_rng(0)
    tiles = mosaic_gmm.Config(block_m=64, block_n=64, block_k=64, num_stages=2, programs_per_sm=2)
    sizes = np.array([7, 0, 30, 5, 0, 90, 1])
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
    rows, d_dim, h_dim = 192, 64, 128
    schedule = row_dispatch.gmm_schedule(offsets, rows, tiles.block_m)
    dy = jnp.asarray(rng.standard_normal((rows, d_dim)), jnp.bfloat16)
    w_down = jnp.asarray(rng.standard_normal((len(sizes), h_dim, d_dim)) / 8, jnp.bfloat16)
    gate, up = (jnp.asarray(rng.standard_normal((rows, h_dim)), jnp.bfloat16) for _ in "gu")
    scale = jnp.asarray(rng.random(rows), jnp.float32)
    with _pallas.assume_device(sm_count=2), gpu_interpreter():
        outs = [
            mosaic_gmm.gmm_activation_bwd(
                dy,
                w_down,
                gate,
                up,
                scale,
                schedule,
                tiles=tiles,
                backend="mosaic",
                deterministic=flag,
            )
            for flag in (False, True)
        ]
    for default, deterministic in zip(*outs, strict=True):
        np.testing.assert_array_equal(np.asarray(deterministic), np.asarray(default))
