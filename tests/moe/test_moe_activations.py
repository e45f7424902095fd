"""The experts' activations (``MoEConfig.activation``: ``"swiglu"``, ``"geglu"``, ``"gelu"``)
against a float64 oracle written here from the textbook formulas (``tanh`` for gelu, not the
sigmoid form the kernels use): the layer's output and its gradients with respect to ``x``,
every weight and the router, on every impl (the XLA ones, the Pallas path on Triton in
interpret mode, its recompute path, Mosaic GPU in JAX's GPU interpreter); the kernels'
epilogues alone; the parameters ``moe_init`` makes; the errors.

The Pallas-interpreter cases of the whole layer are marked ``kernels`` (``nox -s
tests_kernels``); the Triton kernels' epilogues run unmarked on small tiles.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import peak_rel_err
from moe_testing import gmm_oracle, interpreted_marked, on_cpu_devices
from mosaic_interpret import available, gpu_interpreter

import tilax
from tilax import _pallas
from tilax.moe import activations, dispatch, reference, triton
from tilax.moe.mosaic import common as mosaic_common

# float32 tolerances of a CPU's matmuls and the kernels in interpret mode: the GPU checks of
# the activations are test_moe_gpu.py's and test_moe_mosaic_gpu.py's (``-k activation``)
pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="CPU tests; the GPU files check the activations"
)

ACTIVATIONS = ("swiglu", "geglu", "gelu")
DIMS = dict(d_model=32, d_hidden=48, num_experts=4, top_k=2, shared_hidden=32)
TOKENS = 37

# ----------------------------------------------------------------------------------------------
# The float64 oracle


def _gelu(x):
    return 0.5 * x * (1.0 + jnp.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _silu(x):
    return x / (1.0 + jnp.exp(-x))


def _expert(activation, x, weights, spec):
    """The hidden activation ``act(x)`` for one set of weights (``spec``: the input product)."""
    up = jnp.einsum(spec, x, weights["w_up"])
    if activation == "gelu":
        hidden = _gelu(up)
    else:
        gate = jnp.einsum(spec, x, weights["w_gate"])
        hidden = (_silu(gate) if activation == "swiglu" else _gelu(gate)) * up
    return hidden


def oracle(params, x, config):
    """The layer in float64 (dense routing, renormalised top-k of the softmax)."""
    logits = x @ params["router"]
    probs = jax.nn.softmax(logits, axis=-1)
    top, ids = jax.lax.top_k(probs, config.top_k)
    top = top / jnp.sum(top, axis=-1, keepdims=True)
    weights = jnp.sum(jax.nn.one_hot(ids, config.num_experts, dtype=x.dtype) * top[..., None], 1)
    hidden = _expert(config.activation, x, params, "td,edh->teh")
    every = jnp.einsum("teh,ehd->ted", hidden, params["w_down"])
    y = jnp.einsum("ted,te->td", every, weights)
    if config.shared_hidden:
        shared = params["shared"]
        y = y + _expert(config.activation, x, shared, "td,ds->ts") @ shared["w_down"]
    return y


def oracle_train_step(params, x, cotangent, config):
    """``(y, (d_params, d_x))`` of ``sum(y * cotangent)`` in float64."""
    with jax.enable_x64(True):
        as64 = jax.tree.map(
            lambda a: jnp.asarray(np.asarray(a, np.float64)), (params, x, cotangent)
        )
        params64, x64, cotangent64 = as64

        def loss(p, x):
            y = oracle(p, x, config)
            return jnp.sum(y * cotangent64), y

        # jitted: one compile instead of one per operation of the eager oracle
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        (_, y), grads = step(params64, x64)
        return jax.tree.map(np.asarray, (y, grads))


def layer_train_step(params, x, cotangent, config):
    def loss(p, x):
        y = tilax.moe_apply(p, x, config)[0]
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, grads


def check_against_oracle(config, tol, tokens=TOKENS):
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (tokens, config.d_model)).astype(config.dtype)
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    y, grads = layer_train_step(params, x, cotangent, config)
    y_ref, grads_ref = oracle_train_step(params, x, cotangent, config)
    assert peak_rel_err(y, y_ref) < tol, "output"
    flat_ref = jax.tree_util.tree_flatten_with_path(grads_ref)[0]
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    assert [path for path, _ in flat] == [path for path, _ in flat_ref]
    for (path, expected), (_, actual) in zip(flat_ref, flat, strict=True):
        assert peak_rel_err(actual, expected) < tol, f"gradient {jax.tree_util.keystr(path)}"


# ----------------------------------------------------------------------------------------------
# The layer on every impl


XLA_CASES = [
    ("blocked", {}),
    ("ragged_dot", {}),
    ("blocked", dict(routing="dense")),  # dense routing: every expert on every token
    ("blocked", dict(recompute=True)),  # the XLA impls under jax.checkpoint
]


def _one_activation_each_beyond_blocked():
    """Every activation on ``blocked``; each other XLA case with one activation in everyday
    runs (a different one each), the rest of the cross marked ``kernels``."""
    cases, rotation = [], iter(["geglu", "gelu", "geglu"])
    for impl, options in XLA_CASES:
        everyday = ACTIVATIONS if impl == "blocked" and not options else [next(rotation)]
        for activation in ACTIVATIONS:
            marks = () if activation in everyday else pytest.mark.kernels
            cases.append(pytest.param(impl, options, activation, marks=marks))
    return cases


@pytest.mark.parametrize(("impl", "options", "activation"), _one_activation_each_beyond_blocked())
def test_xla_impls_match_the_float64_oracle(impl, options, activation):
    config = tilax.MoEConfig(**DIMS, activation=activation, impl=impl, dtype=jnp.float32, **options)
    check_against_oracle(config, 1e-5)


PALLAS_CASES = [
    ("pallas", "fused", {}),
    ("pallas", "sorted", {}),
    ("pallas", "gather", dict(routing="capacity", capacity_factor=0.8)),
    ("pallas", "fused_gsum", {}),
    ("pallas", "fused", dict(recompute=True, recompute_rows=32)),  # the recompute path
    ("pallas", "sorted", dict(recompute=True, recompute_rows=32)),
]


@pytest.mark.parametrize("activation", ["geglu", "gelu"])
@pytest.mark.parametrize(("impl", "dispatch_name", "options"), interpreted_marked(PALLAS_CASES))
def test_pallas_matches_the_float64_oracle(activation, impl, dispatch_name, options):
    # Triton in interpret mode, 16-row tiles (d_hidden 48: three column tiles).
    config = tilax.MoEConfig(
        **DIMS,
        activation=activation,
        impl=impl,
        dispatch=dispatch_name,
        dtype=jnp.float32,
        block_m=16,
        block_n=16,
        block_k=16,
        **options,
    )
    if config.routing == "dropless":
        check_against_oracle(config, 1e-5)
    else:  # capacity drops: against the same layer on XLA (checked against the oracle above)
        check_same_as_blocked(config, 1e-5)


def check_same_as_blocked(config, tol):
    blocked = tilax.MoEConfig(**{**_fields(config), "impl": "blocked", "dispatch": "sorted"})
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (TOKENS, config.d_model)).astype(config.dtype)
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    y, grads = layer_train_step(params, x, cotangent, config)
    y_ref, grads_ref = layer_train_step(params, x, cotangent, blocked)
    assert peak_rel_err(y, y_ref) < tol, "output"
    for expected, actual in zip(jax.tree.leaves(grads_ref), jax.tree.leaves(grads), strict=True):
        assert peak_rel_err(actual, expected) < tol


def _fields(config):
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


@pytest.mark.parametrize("activation", ["geglu", "gelu"])
def test_capacity_routing_on_xla(activation):
    # The dropped copies: ragged_dot against blocked (both checked against the oracle above
    # without drops), where copies are dropped.
    config = tilax.MoEConfig(
        **DIMS,
        activation=activation,
        impl="ragged_dot",
        dtype=jnp.float32,
        routing="capacity",
        capacity_factor=0.5,
    )
    check_same_as_blocked(config, 1e-5)
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (TOKENS, config.d_model))
    assert float(jax.jit(tilax.moe_apply)(params, x, config)[1]["dropped_frac"]) > 0.2


needs_interpreter = pytest.mark.skipif(available() is not None, reason=str(available()))


@pytest.mark.kernels
@needs_interpreter
@pytest.mark.parametrize("activation", ["geglu", "gelu"])
@pytest.mark.parametrize(("dispatch_name", "options"), [
    ("fused", {}),
    ("sorted", dict(recompute=True, recompute_rows=128)),
])  # fmt: skip
def test_mosaic_matches_the_float64_oracle(activation, dispatch_name, options):
    # Mosaic GPU in JAX's GPU interpreter: bfloat16, 64-wide features, the shared expert's
    # kernels (256 tokens, S = 128: whole tiles).
    dims = dict(d_model=64, d_hidden=128, num_experts=4, top_k=2, shared_hidden=128)
    config = tilax.MoEConfig(
        **dims,
        activation=activation,
        impl="mosaic",
        dispatch=dispatch_name,
        dtype=jnp.bfloat16,
        **options,
    )
    with _pallas.assume_device(mosaic_unavailable_reason=None, sm_count=2), gpu_interpreter():
        check_against_oracle(config, 3e-2, tokens=256)


@pytest.mark.kernels  # a train step on a mesh of CPU devices (a child process in a full run)
@pytest.mark.parametrize("activation", ["geglu", "gelu"])
@pytest.mark.parametrize(("impl", "dispatch_name", "exchange"), [
    ("blocked", "sorted", "all_gather"),
    ("pallas", "fused", "all_to_all"),
    ("blocked", "sorted", "dense"),
])  # fmt: skip
def test_expert_parallel_matches_one_device(activation, impl, dispatch_name, exchange):
    from test_moe_ep import LAYER, check_matches_one_device

    options = dict(LAYER, impl=impl, dispatch=dispatch_name, activation=activation)
    if exchange == "dense":
        options["routing"] = "dense"
    else:
        options["exchange"] = exchange
    on_cpu_devices(check_matches_one_device, (4,), ("expert",), options)


# ----------------------------------------------------------------------------------------------
# With the other options: DeepSeek-style routing and deterministic sums

# sigmoid scores, a balance bias, 2 groups of 2 experts with 1 kept, a routed scale
DEEPSEEK = dict(
    score_func="sigmoid", balance_bias=True, expert_groups=2, group_top_k=1, routed_scale=2.5
)


def _deepseek_inputs(config):
    params = tilax.moe_init(jax.random.key(0), config)
    # a bias that changes choices (moe_init's zeros would not)
    params["router_bias"] = jnp.asarray([0.3, -0.2, 0.1, -0.4], jnp.float32)
    x = jax.random.normal(jax.random.key(1), (TOKENS, config.d_model)).astype(config.dtype)
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    return params, x, cotangent


# One activation per impl every day, the other two in the kernels run.
@pytest.mark.parametrize(("impl", "activation"), [
    ("blocked", "gelu"), ("ragged_dot", "geglu"),
    pytest.param("blocked", "geglu", marks=pytest.mark.kernels),
    pytest.param("ragged_dot", "gelu", marks=pytest.mark.kernels),
])  # fmt: skip
def test_deepseek_routing_with_deterministic_sums_on_xla(impl, activation):
    """The activation with the router's options and fixed-order sums: the float32 reference
    layer's output (reference.moe_oracle: routing and activation from their definitions)."""
    config = tilax.MoEConfig(
        **DIMS, activation=activation, impl=impl, dtype=jnp.float32, deterministic=True, **DEEPSEEK
    )
    params, x, _ = _deepseek_inputs(config)
    y, _ = jax.jit(tilax.moe_apply)(params, x, config)
    assert peak_rel_err(y, reference.moe_oracle(params, x, config)) < 1e-5


@pytest.mark.kernels
@pytest.mark.parametrize("activation", ["geglu", "gelu"])
@pytest.mark.parametrize("dispatch_name", ["fused_gsum", "sorted"])
def test_deepseek_routing_with_deterministic_sums_on_pallas(activation, dispatch_name):
    """The Triton kernels (interpret mode) of the activation under DeepSeek-style routing with
    fixed-order sums (``fused_gsum`` combining as ``fused``; the deterministic backward): the
    output and every gradient of the same layer on XLA."""
    options = dict(**DIMS, activation=activation, dtype=jnp.float32, deterministic=True, **DEEPSEEK)
    config = tilax.MoEConfig(
        **options, impl="pallas", dispatch=dispatch_name, block_m=16, block_n=16, block_k=16
    )
    params, x, cotangent = _deepseek_inputs(config)
    y, grads = layer_train_step(params, x, cotangent, config)
    y_ref, grads_ref = layer_train_step(
        params, x, cotangent, tilax.MoEConfig(**options, impl="blocked")
    )
    assert peak_rel_err(y, y_ref) < 1e-5, "output"
    flat_ref = jax.tree_util.tree_flatten_with_path(grads_ref)[0]
    flat = jax.tree.leaves(grads)
    for (path, expected), actual in zip(flat_ref, flat, strict=True):
        assert peak_rel_err(actual, expected) < 1e-5, f"gradient {jax.tree_util.keystr(path)}"


# ----------------------------------------------------------------------------------------------
# The activation functions and the kernels' epilogues


def _reference_f64(activation, x):
    """``(f(x), f'(x))`` in float64 from the tanh formula."""
    x = np.asarray(x, np.float64)
    if activation == "swiglu":
        s = 1.0 / (1.0 + np.exp(-x))
        return x * s, s * (1.0 + x * (1.0 - s))
    c = np.sqrt(2.0 / np.pi)
    t = np.tanh(c * (x + 0.044715 * x**3))
    return 0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (
        1.0 + 3 * 0.044715 * x * x
    )


@pytest.mark.parametrize(
    "sigmoid", [jax.nn.sigmoid, mosaic_common.sigmoid], ids=["jax", "mosaic_approx"]
)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_and_its_derivative(activation, sigmoid):
    x = jnp.asarray(
        np.concatenate([np.linspace(-12.0, 12.0, 241), [-200.0, 200.0, 0.0]]), jnp.float32
    )
    up = jnp.cos(x)
    value, slope = _reference_f64(activation, x)
    gate = None if activation == "gelu" else x
    act = activations.hidden(activation, gate, x if gate is None else up, sigmoid)
    dz = jnp.sin(3 * x) + 2.0
    weight = jnp.full(x.shape, 0.7, jnp.float32)
    stored = dict(
        activations.hidden_backward(
            activation, gate, x if gate is None else up, dz, weight, sigmoid
        )
    )
    assert sorted(stored) == (["act", "up"] if gate is None else ["act", "gate", "up"])
    d_act = 0.7 * np.asarray(dz, np.float64)
    up64 = np.asarray(up, np.float64)
    if gate is None:
        np.testing.assert_allclose(act, value, rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(stored["act"], value, rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(stored["up"], d_act * slope, rtol=2e-5, atol=1e-6)
    else:
        np.testing.assert_allclose(act, value * up64, rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(stored["act"], value * up64, rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(stored["up"], d_act * value, rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(stored["gate"], d_act * up64 * slope, rtol=2e-5, atol=1e-6)
    # the derivative is the one JAX finds for the forward
    grad = jax.vmap(jax.grad(lambda v: activations.nonlinearity(activation, v)))(x)
    np.testing.assert_allclose(grad, slope, rtol=2e-5, atol=1e-6)


TRITON_TILES = triton.Tiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
# Expert 1 and 4 get no rows, expert 0 ends mid-tile, expert 2 spans three tiles.
GROUP_SIZES = np.array([7, 0, 37, 5, 0, 9])
PADDED_ROWS = 64


def _triton_schedule():
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(GROUP_SIZES)]), jnp.int32)
    return dispatch.gmm_schedule(offsets, PADDED_ROWS, TRITON_TILES.block_m)


def check_kernels(
    kernels, activation, schedule, group_sizes, padded_rows, tiles, dtype, tol, d_dim, h_dim, tokens
):
    """``kernels.gmm_activation`` (scaled, with its pre-activations) and
    ``kernels.gmm_activation_bwd`` against float64 numpy."""
    rng = np.random.default_rng(0)
    gated = activation != "gelu"
    x = jnp.asarray(rng.standard_normal((tokens, d_dim)), dtype)
    index = rng.integers(0, tokens, padded_rows).astype(np.int32)
    w_gate = jnp.asarray(0.3 * rng.standard_normal((len(group_sizes), d_dim, h_dim)), dtype)
    w_up = jnp.asarray(0.3 * rng.standard_normal((len(group_sizes), d_dim, h_dim)), dtype)
    w_down = jnp.asarray(0.3 * rng.standard_normal((len(group_sizes), h_dim, d_dim)), dtype)
    scale = rng.standard_normal(padded_rows).astype(np.float32)
    dy = jnp.asarray(rng.standard_normal((tokens, d_dim)), dtype)
    common = dict(
        tiles=tiles,
        backend="interpret" if kernels is triton else "mosaic",
        index=jnp.asarray(index),
        activation=activation,
    )
    act, gate, up = kernels.gmm_activation(
        x,
        w_gate if gated else None,
        w_up,
        schedule,
        row_scale=jnp.asarray(scale),
        save_preactivations=True,
        **common,
    )
    x_rows = np.asarray(x, np.float64)[index]
    up_ref = gmm_oracle(x_rows, w_up, group_sizes)
    assert peak_rel_err(up, up_ref) < tol
    if gated:
        gate_ref = gmm_oracle(x_rows, w_gate, group_sizes)
        assert peak_rel_err(gate, gate_ref) < tol
        act_ref = _reference_f64(activation, gate_ref)[0] * up_ref
    else:
        assert gate is None
        act_ref = _reference_f64(activation, up_ref)[0]
    assert peak_rel_err(act, scale[:, None] * act_ref) < tol

    d_gate, d_up, dw_partial = kernels.gmm_activation_bwd(
        dy, w_down, gate, up, jnp.asarray(scale), schedule, **common
    )
    dz = gmm_oracle(np.asarray(dy, np.float64)[index], w_down, group_sizes, transpose=True)
    d_act = scale[:, None] * dz
    up_in = np.asarray(up, np.float64)
    if gated:
        gate_in = np.asarray(gate, np.float64)
        f, slope = _reference_f64(activation, gate_in)
        assert peak_rel_err(d_up, d_act * f) < tol
        assert peak_rel_err(d_gate, d_act * up_in * slope) < tol
        row_sums = np.sum(dz * f * up_in, axis=1)
    else:
        assert d_gate is None
        f, slope = _reference_f64(activation, up_in)
        assert peak_rel_err(d_up, d_act * slope) < tol
        row_sums = np.sum(dz * f, axis=1)
    assert dw_partial.dtype == jnp.float32
    assert peak_rel_err(dw_partial.sum(0), row_sums) < 1e-5


@pytest.mark.parametrize("activation", ["geglu", "gelu"])
def test_triton_epilogues(activation):
    check_kernels(
        triton,
        activation,
        _triton_schedule(),
        GROUP_SIZES,
        PADDED_ROWS,
        TRITON_TILES,
        jnp.float32,
        1e-5,
        d_dim=32,
        h_dim=32,
        tokens=13,
    )


@pytest.mark.kernels
@needs_interpreter
@pytest.mark.parametrize("activation", ["geglu", "gelu"])
def test_mosaic_epilogues(activation):
    from tilax.moe.mosaic import gmm as mosaic_gmm

    tiles = mosaic_common.Config(block_m=64, block_n=64, block_k=64, num_stages=2)
    group_sizes = np.array([7, 0, 137, 5, 0, 90])
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(group_sizes)]), jnp.int32)
    schedule = dispatch.gmm_schedule(offsets, 256, tiles.block_m)
    with _pallas.assume_device(sm_count=2), gpu_interpreter():
        check_kernels(
            mosaic_gmm,
            activation,
            schedule,
            group_sizes,
            256,
            tiles,
            jnp.bfloat16,
            1e-2,
            d_dim=64,
            h_dim=128,
            tokens=13,
        )


@pytest.mark.kernels
@needs_interpreter
@pytest.mark.parametrize("activation", ["geglu", "gelu"])
def test_mosaic_shared_expert_kernels(activation):
    from tilax.moe import reference
    from tilax.moe.mosaic import shared as mosaic_shared

    # 256 tokens and S = 256: two row tiles by two column tiles over two programs
    rng = np.random.default_rng(1)
    tokens, d_dim, s_dim = 256, 128, 256
    names = activations.expert_weight_names(activation)
    fan_in = {"w_gate": d_dim, "w_up": d_dim, "w_down": s_dim}
    shapes = {"w_gate": (d_dim, s_dim), "w_up": (d_dim, s_dim), "w_down": (s_dim, d_dim)}
    shared = {
        n: jnp.asarray(rng.standard_normal(shapes[n]) * fan_in[n] ** -0.5, jnp.bfloat16)
        for n in names
    }
    x = jnp.asarray(rng.standard_normal((tokens, d_dim)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((tokens, d_dim)), jnp.bfloat16)
    assert mosaic_shared.applies(x, shared)
    weights = [shared[n] for n in names]

    def on_kernels(x, *weights):
        w_gate, w_up, w_down = weights if len(weights) == 3 else (None, *weights)
        return mosaic_shared.shared_expert(activation, x, w_gate, w_up, w_down)

    def on_xla(x, *weights):
        return reference.shared_expert(x, dict(zip(names, weights, strict=True)), activation)

    f32 = [a.astype(jnp.float32) for a in (x, *weights)]
    y_ref, vjp_ref = jax.vjp(on_xla, *f32)
    with _pallas.assume_device(sm_count=2), gpu_interpreter():
        y, vjp = jax.vjp(on_kernels, x, *weights)
        grads = vjp(dy)
    assert y.dtype == jnp.bfloat16 and peak_rel_err(y, y_ref) < 1e-2
    for name, grad, expected in zip(
        ("x", *names), grads, vjp_ref(dy.astype(jnp.float32)), strict=True
    ):
        assert grad.dtype == jnp.bfloat16 and peak_rel_err(grad, expected) < 1e-2, name


@pytest.mark.kernels  # lowers a whole train step (5-10 s a case on two cores)
@pytest.mark.parametrize("activation", ["geglu", "gelu"])
@pytest.mark.parametrize("dispatch_name", ["sorted", "fused", "fused_gsum"])
def test_triton_train_step_lowers(activation, dispatch_name):
    # The Pallas Triton lowering itself (interpret mode skips it): supported primitives and
    # shapes in the activation's epilogues.
    from jax import export

    triton_call = "__gpu$xla.gpu.triton"
    config = tilax.MoEConfig(
        d_model=256,
        d_hidden=512,
        num_experts=8,
        top_k=2,
        shared_hidden=256,
        impl="triton",
        dispatch=dispatch_name,
        activation=activation,
    )
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.ShapeDtypeStruct((1000, config.d_model), config.dtype)

    def loss(params, x):
        return jnp.sum(tilax.moe_apply(params, x, config)[0].astype(jnp.float32))

    with _pallas.assume_device(
        platform="gpu", compute_capability=(9, 0), device_kind="NVIDIA H200"
    ):
        try:
            module = export.export(
                jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), platforms=["cuda"],
                disabled_checks=[export.DisabledSafetyCheck.custom_call(triton_call)],
            )(params, x).mlir_module()  # fmt: skip
        except RuntimeError as err:
            if "No supported GPU devices found" in str(err):
                pytest.skip(f"jax {jax.__version__} lowers Pallas Triton only with a GPU")
            raise
    # forward: activation + down (+ gate and up apart for sorted); backward: the activation's
    # backward, dx, the gate/up and down weight gradients
    gated = activation != "gelu"
    forward = 3 if dispatch_name == "sorted" and gated else 2
    assert module.count(triton_call) == forward + 4
    assert module.count(f"moe_gmm_{activation}_bwd") >= 1


# ----------------------------------------------------------------------------------------------
# Parameters and errors


@pytest.mark.parametrize("shared_hidden", [0, 16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_moe_init_makes_the_activations_parameters(activation, shared_hidden):
    config = tilax.MoEConfig(
        d_model=8,
        d_hidden=12,
        num_experts=3,
        top_k=2,
        shared_hidden=shared_hidden,
        activation=activation,
    )
    params = tilax.moe_init(jax.random.key(0), config)
    experts = {"w_up": (3, 8, 12), "w_down": (3, 12, 8)}
    shared = {"w_up": (8, 16), "w_down": (16, 8)}
    if activation != "gelu":
        experts["w_gate"], shared["w_gate"] = (3, 8, 12), (8, 16)
    expected = {"router": (8, 3), **experts}
    if shared_hidden:
        expected["shared"] = shared
    assert jax.tree.map(jnp.shape, params) == expected
    assert params["router"].dtype == jnp.float32
    assert all(
        leaf.dtype == jnp.bfloat16
        for name, leaf in params.items()
        if name not in ("router", "shared")
    )
    assert activations.expert_weight_names(activation) == tuple(
        n for n in ("w_gate", "w_up", "w_down") if n in params
    )


def test_default_is_swiglu():
    config = tilax.MoEConfig(d_model=8, d_hidden=12, num_experts=3, top_k=2)
    assert config.activation == "swiglu"
    assert "w_gate" in tilax.moe_init(jax.random.key(0), config)


@pytest.mark.parametrize("activation", ["relu", "SwiGLU", "", None, 1])
def test_unknown_activation_is_an_error(activation):
    with pytest.raises(ValueError, match="activation must be one of"):
        tilax.MoEConfig(d_model=8, d_hidden=12, num_experts=3, top_k=2, activation=activation)


def _params_and_x(activation, shared_hidden=8):
    config = tilax.MoEConfig(
        d_model=8,
        d_hidden=12,
        num_experts=3,
        top_k=2,
        shared_hidden=shared_hidden,
        activation=activation,
        impl="blocked",
        dtype=jnp.float32,
    )
    return tilax.moe_init(jax.random.key(0), config), jnp.ones((5, 8)), config


def test_gelu_params_with_a_gate_are_an_error():
    params, x, config = _params_and_x("gelu")
    gate = jnp.zeros((3, 8, 12))
    with pytest.raises(ValueError, match=r"params has 'w_gate', but activation='gelu' is not"):
        tilax.moe_apply({**params, "w_gate": gate}, x, config)
    shared = {**params["shared"], "w_gate": jnp.zeros((8, 8))}
    with pytest.raises(ValueError, match=r"params\['shared'\] has 'w_gate', but activation="):
        tilax.moe_apply({**params, "shared": shared}, x, config)


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_gated_params_without_a_gate_are_an_error(activation):
    params, x, config = _params_and_x(activation)
    no_gate = {k: v for k, v in params.items() if k != "w_gate"}
    with pytest.raises(ValueError, match=rf"params is missing 'w_gate': activation='{activation}'"):
        tilax.moe_apply(no_gate, x, config)
    shared = {k: v for k, v in params["shared"].items() if k != "w_gate"}
    with pytest.raises(ValueError, match=r"params\['shared'\] is missing 'w_gate'"):
        tilax.moe_apply({**params, "shared": shared}, x, config)


def test_params_of_one_activation_run_another_of_the_same_shape():
    # geglu and swiglu have the same parameters: the activation is the config's
    params, x, config = _params_and_x("geglu")
    swiglu = tilax.MoEConfig(**{**_fields(config), "activation": "swiglu"})
    apply = jax.jit(tilax.moe_apply)
    y_geglu = apply(params, x, config)[0]
    y_swiglu = apply(params, x, swiglu)[0]
    assert not np.allclose(y_geglu, y_swiglu)


def test_kernels_check_the_gate_operand():
    schedule = _triton_schedule()
    x = jnp.ones((PADDED_ROWS, 16))
    w = jnp.ones((len(GROUP_SIZES), 16, 16))
    with pytest.raises(ValueError, match="activation='gelu' takes w_gate None"):
        triton.gmm_activation(
            x, w, w, schedule, tiles=TRITON_TILES, backend="interpret", activation="gelu"
        )
    with pytest.raises(ValueError, match="activation='geglu' takes w_gate an array"):
        triton.gmm_activation(
            x, None, w, schedule, tiles=TRITON_TILES, backend="interpret", activation="geglu"
        )
