"""The GPU tests' oracle comparison (a plain module shared by test_moe_gpu.py and
test_moe_mosaic_gpu.py): a layer's jitted train step against the float32 dense oracle, output
and every gradient. The oracle's outputs and gradients depend on the inputs and the routing
only, so each input set's oracle is computed once per process and shared by the impls and
dispatches checked against it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from helpers import peak_rel_err

import tilax
from tilax.moe import reference, skew_tokens

TOLERANCE = {"bfloat16": 3e-2, "float16": 1e-2, "float32": 1e-2}
# MoEConfig's routing fields: part of the math, so the oracle takes them too.
ROUTER_FIELDS = ("score_func", "balance_bias", "expert_groups", "group_top_k", "routed_scale")
LAYER = dict(d_model=256, d_hidden=512, num_experts=8, top_k=2, shared_hidden=256)
DECODER = dict(d_model=256, d_hidden=128, num_experts=64, top_k=8, shared_hidden=512)


def loss_step(apply, cotangent):
    def loss(params, x):
        y = apply(params, x)
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@functools.cache
def inputs(config, tokens, skew):
    params = tilax.moe_init(jax.random.key(0), config)
    if config.balance_bias:  # a bias that moves the choice of experts
        params["router_bias"] = jax.random.normal(jax.random.key(3), (config.num_experts,)) * 0.3
    x = jax.random.normal(jax.random.key(1), (tokens, config.d_model))
    if skew:
        x = skew_tokens(x, params["router"], skew)
    x = x.astype(config.dtype)
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    return params, x, cotangent


@functools.cache
def oracle(config, tokens, skew):
    """(y, grads) of the float32 oracle; ``config`` carries only what the oracle reads."""
    params, x, cotangent = inputs(config, tokens, skew)
    (_, y), grads = loss_step(
        lambda p, x: reference.moe_oracle(p, x, config), cotangent)(params, x)
    return y, grads


def check_deterministic(**config_kwargs):
    """The layer's output is bitwise the same over repeated calls (top-2: at most two float32
    atomic adds per output element, whose order cannot change a sum from zero)."""
    config = tilax.MoEConfig(**LAYER, **config_kwargs)
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (4097, config.d_model)).astype(config.dtype)
    apply = jax.jit(lambda p, x: tilax.moe_apply(p, x, config)[0])
    first = np.asarray(apply(params, x))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(apply(params, x)), first)


def compare_forward(dims, tokens, dtype, skew=0.0, **config_kwargs):
    """The layer's forward alone (no gradient: the kernels an inference call runs) against
    the oracle's output."""
    config = tilax.MoEConfig(**dims, dtype=dtype, **config_kwargs)
    math_only = _math_only(config, dims, dtype)
    params, x, _ = inputs(math_only, tokens, skew)
    y = jax.jit(lambda p, x: tilax.moe_apply(p, x, config)[0])(params, x)
    y_ref, _ = oracle(math_only, tokens, skew)
    assert peak_rel_err(y, y_ref) < TOLERANCE[jnp.dtype(dtype).name], "output"


def compare(dims, tokens, dtype, skew=0.0, **config_kwargs):
    config = tilax.MoEConfig(**dims, dtype=dtype, **config_kwargs)
    # the inputs and the oracle depend on the shape, dtype and routing, not on the kernels
    math_only = _math_only(config, dims, dtype)
    params, x, cotangent = inputs(math_only, tokens, skew)
    (_, y), grads = loss_step(lambda p, x: tilax.moe_apply(p, x, config)[0], cotangent)(params, x)
    y_ref, grads_ref = oracle(math_only, tokens, skew)
    tol = TOLERANCE[jnp.dtype(dtype).name]
    assert peak_rel_err(y, y_ref) < tol, "output"
    for (path, expected), actual in zip(
        jax.tree_util.tree_flatten_with_path(grads_ref)[0], jax.tree.leaves(grads), strict=True
    ):
        assert peak_rel_err(actual, expected) < tol, f"gradient {jax.tree_util.keystr(path)}"
    return y


def _math_only(config, dims, dtype):
    """``config`` without its kernel choices: what the inputs and the oracle depend on."""
    router = {name: getattr(config, name) for name in ROUTER_FIELDS}
    return tilax.MoEConfig(**dims, dtype=dtype, routing=config.routing,
                           capacity_factor=config.capacity_factor,
                           activation=config.activation, **router)


DISPATCHES = ["sorted", "gather", "fused", "fused_gsum"]
