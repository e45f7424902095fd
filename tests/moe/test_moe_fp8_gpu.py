"""GPU checks of the FP8 Mosaic GPU kernels (``tilax.moe.mosaic.gmm_fp8``, Hopper): the two
products against the XLA FP8 products of ``tilax.moe.quantize`` at the E8 layer's shapes
(d512 h1024, 16,384 tokens top-2), with skewed groups (an empty expert, partial row tiles),
and the layer's jitted train step with ``quantize="fp8", impl="mosaic"`` against the XLA FP8
path (output and every gradient). Skipped without an sm90 GPU that can run Mosaic GPU.

Tolerances: in the interpreter (test_moe_fp8_mosaic.py) the kernels match the XLA products to
float32 summation order. On Hopper the FP8 MMA accumulates a 128-step's 4 instructions with a
narrower accumulator (about 14 bits, DeepSeek-V3 section 3.3.2: the reason for promoting every
128), while XLA's reference sums the same exact products in float32: each partial may be off
by a few 2**-14 of its magnitude, so the products are held to 2e-3 of the peak output. The
layer then differs where such a difference flips a bfloat16 rounding of an intermediate (and
with it an e4m3 rounding, or a tile's amax and so its scale, in the next quantisation),
averaged over the sums: held to 3e-2 of each output's and gradient's peak (the bfloat16 layer's
tolerance against the float32 oracle in test_moe_mosaic_gpu.py). A wrong scale or a missed
step gives errors of order 1.

Run on the GPU host (most of it compiling; spread over three workers)::

    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0 \\
        PYTHONPATH=src:tests python -m pytest tests/moe/test_moe_fp8_gpu.py -q -n 3
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import peak_rel_err

import tilax
from tilax import _pallas
from tilax.moe import quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
    pytest.mark.skipif(
        _pallas.mosaic_unavailable_reason() is not None,
        reason=str(_pallas.mosaic_unavailable_reason()),
    ),
]

D_MODEL, D_HIDDEN, NUM_EXPERTS, TOKENS, TOP_K = 512, 1024, 8, 16384, 2
ROWS = TOKENS * TOP_K
# Skewed: expert 3 empty, expert 0 ends mid-tile, one expert holds a third of the rows; the
# last 49 rows belong to no expert (padding).
GROUP_SIZES = np.array([1001, 2900, 10923, 0, 4095, 6000, 3300, 4500])
assert GROUP_SIZES.sum() == ROWS - 49
PRODUCT_TOLERANCE = 2e-3
LAYER_TOLERANCE = 3e-2


def _gmm_fp8():
    from tilax.moe.mosaic import gmm_fp8

    return gmm_fp8


def _operand(key, shape, row_spread=True):
    x = jax.random.normal(key, shape, jnp.float32)
    if row_spread:  # rows of different magnitudes: their scales differ
        x = x * jnp.exp(
            jax.random.uniform(jax.random.fold_in(key, 1), shape[:-1] + (1,), minval=-3, maxval=3)
        )
    return x.astype(jnp.bfloat16)


@pytest.mark.parametrize(("k_dim", "n_dim"), [(D_MODEL, D_HIDDEN), (D_HIDDEN, D_MODEL)])
def test_grouped_matmul_fp8_matches_the_xla_product(k_dim, n_dim):
    sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
    valid = int(GROUP_SIZES.sum())
    x = _operand(jax.random.key(0), (ROWS, k_dim)).at[valid:].set(0)
    w = _operand(jax.random.key(1), (NUM_EXPERTS, k_dim, n_dim))
    xq, xs = quantize.quantize_rows(x)
    wq, ws = quantize.quantize_blocks(w)
    expected = jax.jit(lambda *a: quantize.grouped_matmul(*a, out_dtype=jnp.float32))(
        xq, xs, wq, ws, sizes
    )
    out = jax.jit(lambda *a: _gmm_fp8().grouped_matmul_fp8(*a, out_dtype=jnp.float32))(
        xq, xs, jnp.swapaxes(wq, 1, 2), ws, sizes
    )
    assert peak_rel_err(out[:valid], expected[:valid]) < PRODUCT_TOLERANCE
    np.testing.assert_array_equal(np.asarray(out[valid:]), 0.0)


def test_grouped_matmul_t_fp8_matches_the_xla_product():
    sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
    tiles = quantize.token_tiles(sizes, ROWS)
    lhs_rows = _operand(jax.random.key(2), (ROWS, D_MODEL), row_spread=False)
    rhs_rows = _operand(jax.random.key(3), (ROWS, D_HIDDEN))

    def operands(lhs_rows, rhs_rows):
        return (
            *quantize.quantize_token_tiles(lhs_rows, tiles),
            *quantize.quantize_token_tiles(rhs_rows, tiles),
        )

    lhs, lhs_s, rhs, rhs_s = jax.jit(operands)(lhs_rows, rhs_rows)
    expected = jax.jit(
        lambda *a: quantize.grouped_matmul_t(*a, tiles, NUM_EXPERTS, out_dtype=jnp.float32)
    )(lhs, lhs_s, rhs, rhs_s)
    out = jax.jit(
        lambda *a: _gmm_fp8().grouped_matmul_t_fp8(*a, tiles, NUM_EXPERTS, out_dtype=jnp.float32)
    )(lhs, lhs_s, rhs, rhs_s)
    np.testing.assert_array_equal(np.asarray(out[3]), 0.0)  # the empty expert
    assert peak_rel_err(out, expected) < PRODUCT_TOLERANCE


def _train_step(config, cotangent):
    def loss(params, x):
        y = tilax.moe_apply(params, x, config)[0]
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@pytest.mark.parametrize(("activation", "recompute"), [("swiglu", False), ("gelu", True)])
def test_fp8_layer_train_step_matches_the_xla_fp8_path(activation, recompute):
    """The train step's output and gradients (routed weights, router, x) with the kernels
    against the XLA FP8 path (``impl="ragged_dot"``); ``"gelu"`` has no gate projection, and
    runs with ``recompute`` (the experts under ``jax.checkpoint``)."""
    dims = dict(
        d_model=D_MODEL,
        d_hidden=D_HIDDEN,
        num_experts=NUM_EXPERTS,
        top_k=TOP_K,
        quantize="fp8",
        activation=activation,
        recompute=recompute,
    )
    config = tilax.MoEConfig(**dims, impl="mosaic")
    reference = tilax.MoEConfig(**dims, impl="ragged_dot")
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (TOKENS, D_MODEL)).astype(jnp.bfloat16)
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    (_, y), grads = _train_step(config, cotangent)(params, x)
    (_, y_ref), grads_ref = _train_step(reference, cotangent)(params, x)
    assert peak_rel_err(y, y_ref) < LAYER_TOLERANCE, "output"
    for (path, expected), actual in zip(
        jax.tree_util.tree_flatten_with_path(grads_ref)[0], jax.tree.leaves(grads), strict=True
    ):
        assert peak_rel_err(actual, expected) < LAYER_TOLERANCE, jax.tree_util.keystr(path)
    traced = str(jax.make_jaxpr(_train_step(config, cotangent))(params, x))
    assert "moe_gmm_fp8_mosaic" in traced and "moe_tgmm_fp8_mosaic" in traced
