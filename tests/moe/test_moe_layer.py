"""The layer against the float32 dense oracle: outputs and gradients w.r.t. every parameter
leaf and ``x``, for every impl x dispatch x routing that applies, on awkward cases.

Pallas runs in interpret mode here, with 16-row tiles so that tiles straddle expert boundaries
and no token count is a multiple of a tile.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import peak_rel_err
from moe_testing import interpreted_marked

import tilax
from tilax.moe import reference, skew_tokens

SMALL_TILES = dict(block_m=16, block_n=16, block_k=16)

# Feature widths that are not multiples of 16 exercise the kernels' zero padding.
CASES = {
    "odd_shared": dict(d_model=24, d_hidden=40, num_experts=4, top_k=2, shared_hidden=16,
                       tokens=37),
    "skewed_empty": dict(d_model=16, d_hidden=32, num_experts=6, top_k=2, tokens=21, skew=0.9),
    "one_expert": dict(d_model=16, d_hidden=16, num_experts=1, top_k=1, tokens=13),
    "top_k_all": dict(d_model=16, d_hidden=32, num_experts=3, top_k=3, tokens=11),
    "top_1": dict(d_model=32, d_hidden=16, num_experts=5, top_k=1, tokens=29,
                  renormalize=False),
    "bf16": dict(d_model=32, d_hidden=48, num_experts=4, top_k=2, shared_hidden=16,
                 tokens=(4, 10)),
}
PALLAS = [("pallas", d) for d in ("sorted", "gather", "fused", "fused_gsum")]
XLA = [("blocked", "sorted"), ("ragged_dot", "sorted")]


def _setup(case, **config_kwargs):
    dims = dict(CASES[case])
    tokens, skew = dims.pop("tokens"), dims.pop("skew", 0.0)
    config = tilax.MoEConfig(**dims, **config_kwargs)
    params = tilax.moe_init(jax.random.key(0), config)
    shape = (tokens,) if isinstance(tokens, int) else tokens
    x = jax.random.normal(jax.random.key(1), shape + (config.d_model,))
    if skew:
        x = skew_tokens(x, params["router"], skew)
    return config, params, x.astype(config.dtype)


def _value_and_grads(apply, params, x, cotangent):
    def loss(params, x):
        y = apply(params, x)
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, grads


@functools.cache
def _oracle(case, routing, capacity_factor, dtype_name):
    """Oracle output and gradients; independent of impl/dispatch/tiles, so shared by tests."""
    config, params, x = _setup(
        case, routing=routing, capacity_factor=capacity_factor, dtype=jnp.dtype(dtype_name)
    )
    y, grads = _value_and_grads(
        lambda p, x: reference.moe_oracle(p, x, config), params, x, _cotangent(x.shape)
    )
    return np.asarray(y), jax.tree.map(np.asarray, grads)


def _cotangent(shape):
    return jax.random.normal(jax.random.key(2), shape)


def check_against_oracle(case, tol, **config_kwargs):
    """Outputs and gradients (every parameter leaf and x) of the layer vs the oracle.

    Errors are max-abs differences relative to the largest reference value of the leaf, with
    a floor of 1e-3 of the largest gradient overall: some leaves are exactly zero in exact
    arithmetic (the router's gradient with one expert or top-1 renormalised weights).
    """
    config, params, x = _setup(case, **config_kwargs)
    y, grads = _value_and_grads(
        lambda p, x: tilax.moe_apply(p, x, config)[0], params, x, _cotangent(x.shape)
    )
    y_ref, grads_ref = _oracle(
        case, config.routing, config.capacity_factor, config.dtype.name
    )
    assert y.shape == x.shape and y.dtype == config.dtype
    assert peak_rel_err(y, y_ref) < tol, "output"
    flat_ref = jax.tree_util.tree_flatten_with_path(grads_ref)[0]
    flat = jax.tree.leaves(grads)
    assert len(flat) == len(flat_ref)
    floor = 1e-3 * max(float(np.max(np.abs(g))) for _, g in flat_ref)
    for (path, expected), actual in zip(flat_ref, flat, strict=True):
        assert actual.shape == expected.shape
        error = np.max(np.abs(np.asarray(actual, np.float64) - expected))
        scale = max(float(np.max(np.abs(expected))), floor)
        assert error / scale < tol, f"gradient {jax.tree_util.keystr(path)}"


@pytest.mark.parametrize("routing", ["dropless", "capacity"])
@pytest.mark.parametrize("impl,dispatch", interpreted_marked(PALLAS + XLA))
def test_every_impl_and_dispatch(impl, dispatch, routing):
    check_against_oracle(
        "odd_shared", 1e-5, impl=impl, dispatch=dispatch, routing=routing,
        capacity_factor=0.75, dtype=jnp.float32, **SMALL_TILES,
    )


def test_one_pallas_layer_in_the_interpreter():
    """The fast suite's Pallas layer (the other interpreted cases are marked ``kernels``):
    padded features, the gathering SwiGLU kernel and the XLA combine, against the oracle."""
    check_against_oracle(
        "odd_shared", 1e-5, impl="pallas", dispatch="fused", routing="dropless",
        dtype=jnp.float32, **SMALL_TILES,
    )


@pytest.mark.parametrize(
    "impl,dispatch,routing,tiles",
    interpreted_marked([
        ("pallas", "sorted", "dense", SMALL_TILES),
        ("triton", "fused_gsum", "dropless", SMALL_TILES),
        ("pallas", "sorted", "dropless", {}),  # the device default tiles
    ]),
)
def test_other_impl_names_and_tiles(impl, dispatch, routing, tiles):
    check_against_oracle(
        "odd_shared", 1e-5, impl=impl, dispatch=dispatch, routing=routing,
        capacity_factor=0.75, dtype=jnp.float32, **tiles,
    )


# Each case runs the dispatches that differ most for it: sorted and fused_gsum share no kernel
# (plain rows vs in-kernel gathers, separate vs fused SwiGLU, XLA vs atomic combine).
AWKWARD = (
    [("skewed_empty", i, d) for i, d in PALLAS + XLA]
    + [("one_expert", *PALLAS[0]), ("one_expert", *PALLAS[3])]
    + [("top_k_all", *PALLAS[1]), ("top_k_all", *PALLAS[2])]
    + [("top_k_all", i, d) for i, d in XLA]
    + [("top_1", *PALLAS[0]), ("top_1", *PALLAS[3])]
)


@pytest.mark.parametrize("case,impl,dispatch", interpreted_marked(AWKWARD))
def test_awkward_routing(case, impl, dispatch):
    check_against_oracle(
        case, 1e-5, impl=impl, dispatch=dispatch, dtype=jnp.float32, **SMALL_TILES
    )


def test_skewed_case_leaves_experts_empty():
    config, params, x = _setup("skewed_empty", dtype=jnp.float32, impl="ragged_dot")
    _, aux = tilax.moe_apply(params, x, config)
    assert int(aux["empty_experts"]) >= 3


@pytest.mark.parametrize(
    "impl,dispatch", interpreted_marked([("pallas", "sorted"), ("pallas", "fused_gsum")] + XLA)
)
def test_capacity_with_skew_drops_most_copies(impl, dispatch):
    kwargs = dict(impl=impl, dispatch=dispatch, routing="capacity", capacity_factor=1.0,
                  dtype=jnp.float32, **SMALL_TILES)
    config, params, x = _setup("skewed_empty", **kwargs)
    _, aux = tilax.moe_apply(params, x, config)
    assert float(aux["dropped_frac"]) > 0.4
    check_against_oracle("skewed_empty", 1e-5, **kwargs)


@pytest.mark.parametrize(
    "impl,dispatch,routing",
    interpreted_marked([(i, d, "dropless") for i, d in PALLAS + XLA]
                       + [("pallas", "sorted", "dense")]),
)
def test_bfloat16(impl, dispatch, routing):
    # bfloat16 activations and weights against the float32 oracle of the same bf16 inputs.
    check_against_oracle(
        "bf16", 3e-2, impl=impl, dispatch=dispatch, routing=routing, dtype=jnp.bfloat16,
        **SMALL_TILES,
    )


@pytest.mark.parametrize("impl,dispatch",
                         interpreted_marked([("pallas", "sorted"), ("pallas", "fused_gsum")] + XLA))
def test_capacity_drops_exactly_the_documented_tokens(impl, dispatch):
    # Tokens 0..5 choose experts 0,0,1,0,0,1 (top-1); C = ceil(0.5 * 6 * 1 / 2) = 2, so expert 0
    # keeps tokens 0 and 1 and drops 3 and 4; expert 1 keeps 2 and 5.
    common = dict(d_model=16, d_hidden=32, num_experts=2, top_k=1, impl=impl,
                  dispatch=dispatch, dtype=jnp.float32, **SMALL_TILES)
    capacity = tilax.MoEConfig(routing="capacity", capacity_factor=0.5, **common)
    dropless = tilax.MoEConfig(**common)
    params = tilax.moe_init(jax.random.key(0), capacity)
    router_w = np.zeros((16, 2), np.float32)
    router_w[np.arange(6), [0, 0, 1, 0, 0, 1]] = 3.0
    params["router"] = jnp.asarray(router_w)
    x = jnp.eye(16, dtype=jnp.float32)[:6] + 0.1
    y_cap, aux = tilax.moe_apply(params, x, capacity)
    y_all, _ = tilax.moe_apply(params, x, dropless)
    y_cap, y_all = np.asarray(y_cap), np.asarray(y_all)
    np.testing.assert_array_equal(y_cap[3:5], 0.0)
    np.testing.assert_allclose(y_cap[[0, 1, 2, 5]], y_all[[0, 1, 2, 5]], rtol=1e-6, atol=1e-7)
    assert np.all(np.abs(y_all[3:5]) > 0)
    assert float(aux["dropped_frac"]) == pytest.approx(2 / 6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_shared_expert_backward_multiplies_16bit_operands(dtype):
    """Every product of the shared expert's train step, the transposed ones included, takes
    16-bit operands: float32 cotangents would make XLA upcast the weights (on the H200 that
    tripled the shared expert's time in the E64 decoder's step). Nothing is concatenated."""
    tokens, d_model, width = 64, 32, 48
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (tokens, d_model), dtype)
    shared = {
        "w_gate": jax.random.normal(keys[1], (d_model, width), dtype),
        "w_up": jax.random.normal(keys[2], (d_model, width), dtype),
        "w_down": jax.random.normal(keys[3], (width, d_model), dtype),
    }

    def loss(x, shared):
        return jnp.sum(reference.shared_expert(x, shared).astype(jnp.float32) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, shared)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) >= 5  # forward gate/up and down, and their transposes
    for eqn in dots:
        assert [v.aval.dtype for v in eqn.invars] == [dtype, dtype], eqn
    # Gate and up as two products: one product against the weights side by side has a
    # backward that concatenates the halves' gradients (a [T, 2 * hidden] pass; on the H200
    # the E64 decoder's train step was about 0.2 ms slower that way).
    primitives = {e.primitive.name for e in jaxpr.eqns}
    assert not primitives & {"concatenate", "pad"}, primitives
