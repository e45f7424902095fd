"""GPU checks of every Pallas impl x dispatch against the float32 dense oracle (skipped off GPU).

Run on the GPU host, serially (pytest-xdist workers on one GPU were slower, each paying the
compile of every shape), with XLA's autotuning off: the float32 dense oracle's matmuls are
autotuned at every new shape otherwise (the first test of each shape took 35-50 s), and only
the kernels' results matter here::

    XLA_FLAGS=--xla_gpu_autotune_level=0 PYTHONPATH=src \\
        python -m pytest tests/moe/test_moe_gpu.py -q
    XLA_FLAGS=--xla_gpu_autotune_level=0 PYTHONPATH=src \\
        python -m pytest tests/moe/test_moe_gpu.py -q -k mosaic  # impl="mosaic" only (Hopper)

On the H200 (commit cf11ba3) this file and tests/moe/test_moe_recompute.py (which runs on the
GPU too) passed together, 46 tests, in 177 s; without the flag this file alone took 264 s.
Both timings predate the 20 ``test_mosaic_*`` tests of ``impl="mosaic"``.

Moderate sizes; token counts are not multiples of any tile. float32 operands use the GPU's
default (TF32) matmul precision in the kernels, hence the looser float32 tolerance. The oracle's
outputs and gradients depend on the inputs and the routing only, so each input set's oracle is
computed once and shared by the impls and dispatches checked against it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_testing import rel_err

import tilax
from tilax import _pallas
from tilax.moe import reference, skew_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]

TOLERANCE = {"bfloat16": 3e-2, "float16": 1e-2, "float32": 1e-2}
LAYER = dict(d_model=256, d_hidden=512, num_experts=8, top_k=2, shared_hidden=256)
DECODER = dict(d_model=256, d_hidden=128, num_experts=64, top_k=8, shared_hidden=512)


def _loss(apply, cotangent):
    def loss(params, x):
        y = apply(params, x)
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@functools.cache
def _inputs(config, tokens, skew):
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (tokens, config.d_model))
    if skew:
        x = skew_tokens(x, params["router"], skew)
    x = x.astype(config.dtype)
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    return params, x, cotangent


@functools.cache
def _oracle(config, tokens, skew):
    """(y, grads) of the float32 oracle; ``config`` carries only what the oracle reads."""
    params, x, cotangent = _inputs(config, tokens, skew)
    (_, y), grads = _loss(
        lambda p, x: reference.moe_oracle(p, x, config), cotangent)(params, x)
    return y, grads


def _compare(dims, tokens, dtype, skew=0.0, **config_kwargs):
    config = tilax.MoEConfig(**dims, dtype=dtype, **config_kwargs)
    # the inputs and the oracle depend on the shape, dtype and routing, not on the kernels
    math_only = tilax.MoEConfig(**dims, dtype=dtype, routing=config.routing,
                                capacity_factor=config.capacity_factor)
    params, x, cotangent = _inputs(math_only, tokens, skew)
    (_, y), grads = _loss(lambda p, x: tilax.moe_apply(p, x, config)[0], cotangent)(params, x)
    y_ref, grads_ref = _oracle(math_only, tokens, skew)
    tol = TOLERANCE[jnp.dtype(dtype).name]
    assert rel_err(y, y_ref) < tol, "output"
    for (path, expected), actual in zip(
        jax.tree_util.tree_flatten_with_path(grads_ref)[0], jax.tree.leaves(grads), strict=True
    ):
        assert rel_err(actual, expected) < tol, f"gradient {jax.tree_util.keystr(path)}"
    return y


DISPATCHES = ["sorted", "gather", "fused", "fused_gsum"]


@pytest.mark.parametrize("routing", ["dropless", "capacity"])
@pytest.mark.parametrize("dispatch", DISPATCHES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_layer_matches_oracle(dispatch, routing, dtype):
    _compare(LAYER, 3001, dtype, impl="pallas", dispatch=dispatch, routing=routing,
             capacity_factor=0.8)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_triton_name(dispatch):
    _compare(LAYER, 1001, "bfloat16", impl="triton", dispatch=dispatch)


@pytest.mark.parametrize("dispatch", ["sorted", "fused_gsum"])
def test_skewed_routing(dispatch):
    _compare(LAYER, 2049, "bfloat16", skew=0.9, impl="pallas", dispatch=dispatch)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_fine_grained_decoder(dispatch):
    _compare(DECODER, 1500, "bfloat16", impl="pallas", dispatch=dispatch)


@pytest.mark.parametrize("impl", ["blocked", "ragged_dot"])
def test_xla_baselines(impl):
    _compare(LAYER, 1001, "bfloat16", impl=impl)


@pytest.mark.parametrize("block_m,num_warps", [(64, 4), (128, 8), (64, 8)])
def test_tile_overrides(block_m, num_warps):
    _compare(LAYER, 1001, "bfloat16", impl="pallas", dispatch="fused_gsum",
             block_m=block_m, num_warps=num_warps)


def test_fused_gsum_top2_is_deterministic():
    config = tilax.MoEConfig(**LAYER, dispatch="fused_gsum")
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (4097, config.d_model)).astype(config.dtype)
    apply = jax.jit(lambda p, x: tilax.moe_apply(p, x, config)[0])
    first = np.asarray(apply(params, x))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(apply(params, x)), first)


def test_mosaic_reports_why_it_cannot_run():
    reason = _pallas.mosaic_unavailable_reason()
    if reason is None:
        pytest.skip("this GPU runs Mosaic GPU kernels: the test_mosaic_* tests run them")
    config = tilax.MoEConfig(**LAYER, impl="mosaic")
    params = tilax.moe_init(jax.random.key(0), config)
    x = jnp.ones((8, config.d_model), config.dtype)
    with pytest.raises(ValueError, match="compute capability 9.0"):
        tilax.moe_apply(params, x, config)


# ----------------------------------------------------------------------------------------------
# impl="mosaic": the Mosaic GPU kernels (Hopper and newer), forward and every gradient

needs_mosaic = pytest.mark.skipif(
    _pallas.mosaic_unavailable_reason() is not None,
    reason=str(_pallas.mosaic_unavailable_reason()),
)


@needs_mosaic
@pytest.mark.parametrize("routing", ["dropless", "capacity"])
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_mosaic_matches_oracle(dispatch, routing):
    _compare(LAYER, 3001, "bfloat16", impl="mosaic", dispatch=dispatch, routing=routing,
             capacity_factor=0.8)


@needs_mosaic
@pytest.mark.parametrize("dispatch", ["sorted", "fused_gsum"])
def test_mosaic_skewed_routing(dispatch):
    # the first two experts take nearly every copy; the others are empty
    _compare(LAYER, 2049, "bfloat16", skew=0.9, impl="mosaic", dispatch=dispatch)


@needs_mosaic
def test_mosaic_one_expert_holds_every_token():
    # top-1 without renormalising (renormalised top-1 weights are all 1: no router gradient)
    dims = {**LAYER, "top_k": 1, "renormalize": False}
    _compare(dims, 1999, "bfloat16", skew=0.9, impl="mosaic", dispatch="sorted")


@needs_mosaic
@pytest.mark.parametrize("dispatch", ["sorted", "fused_gsum"])
def test_mosaic_few_tokens(dispatch):
    # 10 copies over 8 experts: empty experts, one partial row tile shared by all the others
    _compare(LAYER, 5, "bfloat16", impl="mosaic", dispatch=dispatch)


@needs_mosaic
@pytest.mark.parametrize("dispatch", ["sorted", "fused_gsum"])
def test_mosaic_fine_grained_decoder(dispatch):
    _compare(DECODER, 1500, "bfloat16", impl="mosaic", dispatch=dispatch)


@needs_mosaic
@pytest.mark.parametrize("overrides", [
    dict(dtype="float16"),
    dict(recompute=True, recompute_rows=1024),
    dict(block_m=64, block_k=128, num_stages=3),
    dict(dims={**LAYER, "d_model": 200, "d_hidden": 352}),  # zero-padded to 256 and 384
])  # fmt: skip
def test_mosaic_variants(overrides):
    overrides = dict(overrides)
    dims = overrides.pop("dims", LAYER)
    dtype = overrides.pop("dtype", "bfloat16")
    _compare(dims, 1001, dtype, impl="mosaic", dispatch="sorted", **overrides)


@needs_mosaic
def test_mosaic_fused_gsum_top2_is_deterministic():
    config = tilax.MoEConfig(**LAYER, impl="mosaic", dispatch="fused_gsum")
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (4097, config.d_model)).astype(config.dtype)
    apply = jax.jit(lambda p, x: tilax.moe_apply(p, x, config)[0])
    first = np.asarray(apply(params, x))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(apply(params, x)), first)
