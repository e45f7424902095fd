"""The FP8 Mosaic GPU kernels (``tilax.moe.mosaic.gmm_fp8``) in JAX's GPU interpreter
(mosaic_interpret.py) against the XLA FP8 products of ``tilax.moe.quantize``, and the layer
with ``quantize="fp8", impl="mosaic"`` against the XLA FP8 path.

The kernels and ``quantize.py`` add the same exact partial products (e4m3 values multiplied
and summed in float32 per 128-step) and promote them in the same order, so they differ only
by the order of the float32 additions inside a step (the interpreter's NumPy matmul against
XLA's dot): relative differences near float32's 2**-24 per addition, a few 1e-7 at these
contractions; the tolerance 1e-5 leaves room for cancellation in small outputs, and is far
below what a wrong scale (a factor of 2 at least) or a missed step would give.

The interpreter checks indices, scales and stored rows, not layouts, swizzles or timing:
test_moe_fp8_gpu.py runs the kernels on Hopper.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import peak_rel_err
from mosaic_interpret import available, gpu_interpreter

import tilax
from tilax import _pallas
from tilax.moe import api, fp8, quantize, rules
from tilax.moe.mosaic import gmm_fp8
from tilax.moe.mosaic.common import Config

TILES = Config(block_m=64, block_n=64, block_k=64, num_stages=2, programs_per_sm=2)
# Expert 1 gets no rows, expert 0 ends mid-tile, expert 2 spans two row tiles and a part.
GROUP_SIZES = np.array([7, 0, 137, 5])
NUM_ROWS = int(GROUP_SIZES.sum())  # 149
PADDED_ROWS = 192
TOLERANCE = 1e-5

needs_interpreter = pytest.mark.skipif(available() is not None, reason=str(available()))


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def few_sms():
    """Two SMs (four programs): the interpreter runs each program."""
    with _pallas.assume_device(sm_count=2):
        yield


def _rows(rng, num_rows, width, valid_rows=None):
    x = rng.standard_normal((num_rows, width)).astype(np.float32)
    x *= np.exp(rng.uniform(-3, 3, (num_rows, 1))).astype(np.float32)  # row scales differ
    if valid_rows is not None:
        x[valid_rows:] = 0.0  # the layer's padding rows are zero
    return jnp.asarray(x, jnp.bfloat16)


def _weights(rng, *shape):
    w = rng.standard_normal(shape).astype(np.float32)
    w *= np.exp(rng.uniform(-2, 2, shape[:-2] + (1, shape[-1]))).astype(np.float32)
    return jnp.asarray(w, jnp.bfloat16)


def _forward_operands(rng, k_dim, n_dim):
    xq, xs = quantize.quantize_rows(_rows(rng, PADDED_ROWS, k_dim, NUM_ROWS))
    wq, ws = quantize.quantize_blocks(_weights(rng, len(GROUP_SIZES), k_dim, n_dim))
    return xq, xs, wq, ws, jnp.asarray(GROUP_SIZES, jnp.int32)


# The XLA FP8 product the kernels must match, jitted: one compile, not one per operation.
_xla_product = jax.jit(functools.partial(quantize.grouped_matmul, out_dtype=jnp.float32))


@needs_interpreter
def test_grouped_matmul_fp8_matches_the_xla_product(rng, few_sms):
    """K = 256: two promotion steps; N = 192: the last 64 columns are half a weight block."""
    n_dim = 192
    xq, xs, wq, ws, sizes = _forward_operands(rng, 256, n_dim)
    expected = _xla_product(xq, xs, wq, ws, sizes)
    with gpu_interpreter():
        out = gmm_fp8.grouped_matmul_fp8(
            xq, xs, jnp.swapaxes(wq, 1, 2), ws, sizes, tiles=TILES, out_dtype=jnp.float32
        )
    assert out.shape == (PADDED_ROWS, n_dim) and out.dtype == jnp.float32
    assert peak_rel_err(out[:NUM_ROWS], expected[:NUM_ROWS]) < TOLERANCE
    np.testing.assert_array_equal(np.asarray(out[NUM_ROWS:]), 0.0)  # zero rows stay zero
    # A scale per row and step: scaling one row's second tile scales its second partial.
    xs2 = xs.at[3, 1].multiply(4.0)
    with gpu_interpreter():
        out2 = gmm_fp8.grouped_matmul_fp8(
            xq, xs2, jnp.swapaxes(wq, 1, 2), ws, sizes, tiles=TILES, out_dtype=jnp.float32
        )
    expected2 = _xla_product(xq, xs2, wq, ws, sizes)
    assert peak_rel_err(out2[:NUM_ROWS], expected2[:NUM_ROWS]) < TOLERANCE
    assert not np.allclose(np.asarray(out2[3]), np.asarray(out[3]))


@needs_interpreter
def test_grouped_matmul_fp8_rounds_once_to_bfloat16(rng, few_sms):
    xq, xs, wq, ws, sizes = _forward_operands(rng, 128, 64)
    expected = _xla_product(xq, xs, wq, ws, sizes)
    with gpu_interpreter():
        out = gmm_fp8.grouped_matmul_fp8(xq, xs, jnp.swapaxes(wq, 1, 2), ws, sizes, tiles=TILES)
    assert out.dtype == jnp.bfloat16
    # one bfloat16 rounding of a sum within TOLERANCE: at most half a bfloat16 ulp (2**-9)
    assert peak_rel_err(out[:NUM_ROWS], expected[:NUM_ROWS]) < 2.0**-8


@needs_interpreter
def test_grouped_matmul_t_fp8_matches_the_xla_product(rng, few_sms):
    """Two tiles for expert 2 (137 rows), one each for experts 0 and 3, none for expert 1:
    K = 128 rows of the output, N = 192 columns (three 64-column tiles)."""
    k_dim, n_dim = 128, 192
    token_tiles = quantize.token_tiles(jnp.asarray(GROUP_SIZES, jnp.int32), PADDED_ROWS)
    lhs = quantize.quantize_token_tiles(_rows(rng, PADDED_ROWS, k_dim, NUM_ROWS), token_tiles)
    rhs = quantize.quantize_token_tiles(_rows(rng, PADDED_ROWS, n_dim, NUM_ROWS), token_tiles)
    expected = quantize.grouped_matmul_t(
        *lhs, *rhs, token_tiles, len(GROUP_SIZES), out_dtype=jnp.float32
    )
    with gpu_interpreter():
        out = gmm_fp8.grouped_matmul_t_fp8(
            *lhs, *rhs, token_tiles, len(GROUP_SIZES), tiles=TILES, out_dtype=jnp.float32
        )
    assert out.shape == (len(GROUP_SIZES), k_dim, n_dim)
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)  # the expert without rows
    assert peak_rel_err(out, expected) < TOLERANCE


def test_tile_offsets_follow_the_token_tiles():
    token_tiles = quantize.token_tiles(jnp.asarray(GROUP_SIZES, jnp.int32), PADDED_ROWS)
    offsets = gmm_fp8.tile_offsets(token_tiles, len(GROUP_SIZES))
    np.testing.assert_array_equal(np.asarray(offsets), [0, 1, 1, 3, 4])
    expert = np.asarray(token_tiles.expert)
    for e in range(len(GROUP_SIZES)):
        assert set(expert[offsets[e] : offsets[e + 1]]) <= {e}


def test_token_major_transposes_each_tile():
    tiles = jnp.arange(2 * 128 * 64, dtype=jnp.float32).reshape(2, 128, 64)
    out = gmm_fp8.token_major(tiles)
    assert out.shape == (128, 128)
    np.testing.assert_array_equal(np.asarray(out[64 + 5]), np.asarray(tiles[1, :, 5]))


@pytest.mark.parametrize(("k_dim", "n_dim", "match"), [
    (192, 64, "multiple of 128"),
    (128, 96, "multiples of 64"),
])  # fmt: skip
def test_unsupported_widths_raise(k_dim, n_dim, match):
    xq = jnp.zeros((128, k_dim), jnp.float8_e4m3fn)
    xs = jnp.ones((128, -(-k_dim // 128)), jnp.float32)
    w = jnp.zeros((2, n_dim, k_dim), jnp.float8_e4m3fn)
    ws = jnp.ones((2, -(-k_dim // 128), -(-n_dim // 128)), jnp.float32)
    with pytest.raises(ValueError, match=match):
        gmm_fp8.grouped_matmul_fp8(xq, xs, w, ws, jnp.array([64, 64]), tiles=TILES)
    lhs = jnp.zeros((3, 128, k_dim), jnp.float8_e4m3fn)
    rhs = jnp.zeros((3, 128, n_dim), jnp.float8_e4m3fn)
    token_tiles = quantize.token_tiles(jnp.array([64, 64]), 128)
    with pytest.raises(ValueError, match=match):
        gmm_fp8.grouped_matmul_t_fp8(
            lhs, jnp.ones((3, k_dim)), rhs, jnp.ones((3, n_dim)), token_tiles, 2, tiles=TILES
        )


def test_bad_operands_raise():
    xq = jnp.zeros((128, 128), jnp.float8_e4m3fn)
    xs = jnp.ones((128, 1), jnp.float32)
    w = jnp.zeros((2, 64, 128), jnp.float8_e4m3fn)
    ws = jnp.ones((2, 1, 1), jnp.float32)
    sizes = jnp.array([64, 64])
    with pytest.raises(ValueError, match="lhs must be a 2-D float8_e4m3fn"):
        gmm_fp8.grouped_matmul_fp8(xq.astype(jnp.bfloat16), xs, w, ws, sizes, tiles=TILES)
    with pytest.raises(ValueError, match="rhs_scales must have shape"):
        gmm_fp8.grouped_matmul_fp8(xq, xs, w, ws[:, :, :0], sizes, tiles=TILES)
    with pytest.raises(ValueError, match="not a multiple of the row tile"):
        gmm_fp8.grouped_matmul_fp8(xq[:96], xs[:96], w, ws, sizes, tiles=TILES)


# ----------------------------------------------------------------------------------------------
# The layer


def _layer_config(**overrides):
    base = dict(d_model=128, d_hidden=128, num_experts=4, top_k=2, quantize="fp8", block_m=64)
    return tilax.MoEConfig(**{**base, **overrides})


def test_mosaic_fp8_config_and_errors():
    assert _layer_config(impl="mosaic").impl == "mosaic"
    with pytest.raises(ValueError, match="multiples of 128"):
        _layer_config(impl="mosaic", d_model=192)
    with pytest.raises(ValueError, match="multiples of 128"):
        _layer_config(impl="mosaic", d_hidden=64)
    with pytest.raises(ValueError, match="impl='triton'"):
        _layer_config(impl="triton")
    with _pallas.assume_device(mosaic_unavailable_reason=None):
        assert api.routed_experts(_layer_config(impl="mosaic")) is fp8.routed_mosaic
    with _pallas.assume_device(mosaic_unavailable_reason="no Hopper GPU here"):
        with pytest.raises(ValueError, match="impl='mosaic' cannot run.*no Hopper GPU"):
            api.resolve_impl(_layer_config(impl="mosaic"))


def test_auto_keeps_the_xla_fp8_path_until_measured():
    """The gpu row stays on the XLA impl (no stored H200 run of the FP8 kernels yet)."""
    row = rules.quantize_rule("fp8", "gpu")
    assert row.impl == "ragged_dot" and "impl='mosaic'" in row.unmeasured


@needs_interpreter
@pytest.mark.kernels
@pytest.mark.parametrize(
    "options",
    [dict(), dict(activation="gelu", routing="capacity", capacity_factor=0.7)],
)
def test_layer_forward_and_gradients_match_the_xla_fp8_path(rng, few_sms, options):
    """SwiGLU dropless; and the not-gated gelu (no gate product) with capacity routing (dropped
    copies: rows past the groups). Not ``recompute``: the interpreter's callbacks carry effects
    that ``jax.checkpoint`` refuses (test_moe_fp8_gpu.py runs it)."""
    config = _layer_config(impl="mosaic", **options)
    params = tilax.moe_init(jax.random.key(0), config)
    x = jnp.asarray(rng.standard_normal((48, 128)), jnp.bfloat16)

    def loss(params, x, config):
        y, _ = tilax.moe_apply(params, x, config)
        return jnp.sum(y.astype(jnp.float32) * jnp.linspace(-1, 1, y.size).reshape(y.shape))

    with _pallas.assume_device(mosaic_unavailable_reason=None):
        traced = str(
            jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(params, x, config)
        )
        with gpu_interpreter():
            y, _ = tilax.moe_apply(params, x, config)
            grads = jax.grad(loss, argnums=(0, 1))(params, x, config)
    # the kernels ran (the products of rows and the weight gradients), and no XLA FP8 product
    assert "moe_gmm_fp8_mosaic" in traced and "moe_tgmm_fp8_mosaic" in traced
    assert "ragged_dot" not in traced
    reference = _layer_config(impl="ragged_dot", **options)
    y_ref, _ = tilax.moe_apply(params, x, reference)
    grads_ref = jax.grad(loss, argnums=(0, 1))(params, x, reference)
    # bfloat16 outputs of equal float32 sums (up to order): a bfloat16 ulp where the sums
    # straddle a rounding boundary, and what follows from that in the backward.
    assert peak_rel_err(y, y_ref) < 2.0**-7
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
        assert peak_rel_err(got, want) < 2.0**-6
