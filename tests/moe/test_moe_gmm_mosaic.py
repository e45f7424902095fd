"""The Mosaic GPU kernels on CPU: tile heuristics, and what the kernels compute, in JAX's GPU
interpreter (mosaic_interpret.py), against numpy and, for the whole layer, the float32 oracle.

The interpreter checks indices, masks, stored rows and epilogues, not the GPU's layouts,
swizzles or timing: test_moe_mosaic_lowering.py lowers the kernels for CUDA, and
test_moe_mosaic_gpu.py runs them on Hopper.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import peak_rel_err
from moe_testing import gmm_oracle, router_logit_parts, row_experts
from mosaic_interpret import available, gpu_interpreter

import tilax
from tilax import _pallas
from tilax.moe import dispatch, reference, router, rules, skew_tokens
from tilax.moe.mosaic import common, gmm_dx, gmm_gather, gmm_rows, gmm_ws
from tilax.moe.mosaic import gmm as mosaic_gmm
from tilax.moe.mosaic import router as mosaic_router
from tilax.moe.mosaic import shared as mosaic_shared
from tilax.moe.mosaic.common import Config

TILES = Config(block_m=64, block_n=64, block_k=64, num_stages=2, programs_per_sm=2)
# Experts 1 and 4 get no rows, expert 0 ends mid-tile, expert 2 spans three tiles.
GROUP_SIZES = np.array([7, 0, 137, 5, 0, 90])
NUM_ROWS = int(GROUP_SIZES.sum())  # 239: not a multiple of the row tile
PADDED_ROWS = 256



def needs_interpreter(test):
    """A kernel run in JAX's GPU interpreter: 5-50 s a case on two cores, so marked
    ``kernels`` (``nox -s tests_kernels``); skipped where the interpreter cannot run."""
    skip = pytest.mark.skipif(available() is not None, reason=str(available()))
    return pytest.mark.kernels(skip(test))


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(autouse=True)
def joined_dx_on():
    """The joined dx kernel is off in the layer until measured on the H200: test it on."""
    with rules.choose(joined_dx="on"):
        yield


@pytest.fixture
def few_sms():
    """Two SMs (four programs) instead of an H100's 132: the interpreter runs each program."""
    with _pallas.assume_device(sm_count=2):
        yield


# ----------------------------------------------------------------------------------------------
# Tiles


def _layer_config(**overrides):
    return tilax.MoEConfig(d_model=512, d_hidden=1024, num_experts=8, top_k=2, **overrides)


def test_default_tiles_and_overrides():
    tiles = mosaic_gmm.tiles_for(_layer_config())
    assert tiles == Config(block_m=128, block_n=128, block_k=64, num_stages=4, programs_per_sm=2)
    assert tiles.row_multiple == 128
    tiles = mosaic_gmm.tiles_for(_layer_config(block_m=64, block_k=128, num_stages=3, num_warps=8))
    assert (tiles.block_m, tiles.block_k, tiles.num_stages) == (64, 128, 3)
    assert tiles.row_multiple == 128


@pytest.mark.parametrize("overrides,match", [
    (dict(block_m=32), "block_m a multiple of 64"),
    (dict(block_n=256), "block_n <= 128"),
])  # fmt: skip
def test_bad_tiles(overrides, match):
    with pytest.raises(ValueError, match=match):
        mosaic_gmm.tiles_for(_layer_config(**overrides))


def test_warp_specialised_layout():
    """Ring slots and contraction steps of the warp-specialised plain grouped matmul, and
    where it does not apply (long contractions, columns that do not split in two tiles)."""
    tiles = mosaic_gmm.default_config(jnp.bfloat16)
    layout = gmm_ws.layout
    # 48 KiB a slot next to two 32 KiB staging tiles: three slots
    assert layout(tiles, 128, 512, 1, jnp.bfloat16) == (64, 128, 3)
    # two operand pairs: 32-wide steps keep three slots
    assert layout(tiles, 128, 512, 2, jnp.bfloat16) == (32, 128, 3)
    # float32 staging tiles (64 KiB each)
    assert layout(tiles, 256, 512, 1, jnp.float32) == (32, 128, 4)
    assert layout(tiles, 128, 384, 1, jnp.bfloat16) is None  # 384 = 1.5 item tiles
    narrow = dataclasses.replace(tiles, block_n=64)
    assert layout(narrow, 128, 384, 1, jnp.bfloat16) == (64, 64, 4)


def test_epilogue_register_cap():
    tiles = Config(block_m=128, block_n=128, block_k=64, num_stages=4)
    # One live float32 tile: 128 x 128 is 128 registers per thread of one warpgroup.
    assert common.capped_block_n(tiles, 1024, 1) == 128
    assert common.capped_block_n(tiles, 1024, 2) == 64
    assert common.capped_block_n(tiles, 1024, 3) == 32
    assert common.capped_block_n(Config(64, 128, 64, 4), 1024, 2) == 128
    assert common.capped_block_n(tiles, 48, 1) == 16  # the largest power of two dividing


def test_pipeline_fits_shared_memory():
    whole_sm = Config(block_m=128, block_n=128, block_k=64, num_stages=4, programs_per_sm=1)
    half_sm = dataclasses.replace(whole_sm, programs_per_sm=2)
    assert common.smem_budget(whole_sm) == 227 * 1024 - 3072
    assert common.smem_budget(half_sm) == 114 * 1024 - 3072
    row = (128 + 128) * 2  # bytes per contraction row of a [128, k] and a [k, 128] tile
    assert common.fit_pipeline(whole_sm, 64, row) == (64, 4)
    assert common.fit_pipeline(half_sm, 64, row) == (64, 3)
    # dx (two products per step): three stages in a whole SM; in half of one, the K step is
    # halved until three fit
    assert common.fit_pipeline(whole_sm, 64, 2 * row) == (64, 3)
    assert common.fit_pipeline(half_sm, 64, 2 * row) == (32, 3)
    # tiles live around the pipeline take their room first
    assert common.fit_pipeline(whole_sm, 64, row, live_bytes=160 * 1024) == (64, 2)
    with pytest.raises(ValueError, match="shared memory"):
        common.fit_pipeline(half_sm, 64, 4096, min_block_k=64)


def test_feature_dimensions_are_multiples_of_64():
    assert mosaic_gmm.tiles_for(_layer_config()).feature_multiple == 64
    schedule = dispatch.gmm_schedule(jnp.array([0, 64], jnp.int32), 64, 64)
    lhs, rhs = jnp.ones((64, 96), jnp.bfloat16), jnp.ones((1, 96, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiples of 64 .the layer pads them., got 96"):
        mosaic_gmm.gmm(lhs, rhs, schedule, tiles=TILES, backend="mosaic")


def test_float32_operands_are_rejected():
    schedule = dispatch.gmm_schedule(jnp.array([0, 64], jnp.int32), 64, 64)
    with pytest.raises(ValueError, match="bfloat16/float16 operands, got float32"):
        mosaic_gmm.gmm(jnp.ones((64, 32)), jnp.ones((1, 32, 32)), schedule, tiles=TILES,
                       backend="mosaic")



def test_epilogue_sigmoid_is_exact_in_float32_and_saturates():
    # rsqrt(1 + exp(-x))**2: exp overflows to inf for x < -88, and rsqrt(inf) is 0.
    x = jnp.asarray([-1e4, -100.0, -20.0, -1.5, 0.0, 0.7, 20.0, 100.0, 1e4], jnp.float32)
    got = np.asarray(common.sigmoid(x))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(jax.nn.sigmoid(x)), rtol=1e-6, atol=0)

# ----------------------------------------------------------------------------------------------
# Kernels in the interpreter


def _offsets():
    return jnp.asarray(np.concatenate([[0], np.cumsum(GROUP_SIZES)]), jnp.int32)


def _schedule(cover_tail=True):
    return dispatch.gmm_schedule(_offsets(), PADDED_ROWS, TILES.block_m, cover_tail=cover_tail)


def _row_experts():
    return row_experts(GROUP_SIZES, PADDED_ROWS)


def _bf16(rng, *shape, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.bfloat16)


def _f32(x):
    return np.asarray(x, np.float32)


def _reference_gmm(lhs_rows, rhs, transpose=False):
    return gmm_oracle(lhs_rows, rhs, GROUP_SIZES, transpose)


@needs_interpreter
@pytest.mark.parametrize("variant", ["plain", "gather", "transposed_dual_scaled"])
def test_gmm(rng, few_sms, variant):
    k_dim, n_dim = 192, 192  # three K steps and three column tiles of 64
    kwargs = dict(out_dtype=jnp.float32)
    if variant == "gather":
        source = _bf16(rng, 11, k_dim)
        index = rng.integers(0, 11, PADDED_ROWS).astype(np.int32)
        lhs, rhs = source, _bf16(rng, len(GROUP_SIZES), k_dim, n_dim)
        kwargs["index"] = jnp.asarray(index)
        expected = _reference_gmm(_f32(source)[index], rhs)
    elif variant == "plain":
        lhs, rhs = _bf16(rng, PADDED_ROWS, k_dim), _bf16(rng, len(GROUP_SIZES), k_dim, n_dim)
        expected = _reference_gmm(lhs, rhs)
    else:
        lhs, lhs2 = _bf16(rng, PADDED_ROWS, k_dim), _bf16(rng, PADDED_ROWS, k_dim)
        rhs = _bf16(rng, len(GROUP_SIZES), n_dim, k_dim)
        rhs2 = _bf16(rng, len(GROUP_SIZES), n_dim, k_dim)
        scale = rng.standard_normal(PADDED_ROWS).astype(np.float32)
        kwargs.update(transpose_rhs=True, lhs2=lhs2, rhs2=rhs2, row_scale=jnp.asarray(scale))
        expected = scale[:, None] * (
            _reference_gmm(lhs, rhs, True) + _reference_gmm(lhs2, rhs2, True)
        )
    with gpu_interpreter():
        out = mosaic_gmm.gmm(lhs, rhs, _schedule(), tiles=TILES, backend="mosaic", **kwargs)
    assert out.shape == (PADDED_ROWS, n_dim) and out.dtype == jnp.float32
    assert peak_rel_err(out, expected) < 1e-5


@needs_interpreter
@pytest.mark.parametrize(("variant", "cover_tail"), [
    ("plain", True), ("transposed_dual", True), ("plain", False)])
def test_gmm_warp_specialised(rng, few_sms, variant, cover_tail):
    # 256 columns: two items of two 64-column warpgroup tiles; every program walks several
    # items through one ring, the accumulator zeroed at each item's first step. Without
    # cover_tail the rows past the groups must keep the interpreter's NaN.
    k_dim, n_dim = (192, 256) if variant == "plain" else (128, 256)
    pairs = 1 if variant == "plain" else 2
    assert gmm_ws.layout(TILES, k_dim, n_dim, pairs, jnp.float32) is not None
    lhs = _bf16(rng, PADDED_ROWS, k_dim)
    if variant == "plain":
        rhs = _bf16(rng, len(GROUP_SIZES), k_dim, n_dim)
        kwargs, expected = {}, _reference_gmm(lhs, rhs)
    else:
        lhs2 = _bf16(rng, PADDED_ROWS, k_dim)
        rhs, rhs2 = (_bf16(rng, len(GROUP_SIZES), n_dim, k_dim) for _ in range(2))
        kwargs = dict(transpose_rhs=True, lhs2=lhs2, rhs2=rhs2)
        expected = _reference_gmm(lhs, rhs, True) + _reference_gmm(lhs2, rhs2, True)
    with gpu_interpreter():
        out = mosaic_gmm.gmm(lhs, rhs, _schedule(cover_tail=cover_tail), tiles=TILES,
                             backend="mosaic", out_dtype=jnp.float32, **kwargs)
    out, rows = np.asarray(out), PADDED_ROWS if cover_tail else NUM_ROWS
    assert np.isnan(out[rows:]).all()
    assert peak_rel_err(out[:rows], expected[:rows]) < 1e-5


@needs_interpreter
def test_gmm_stores_exactly_the_scheduled_rows(rng, few_sms):
    # Without cover_tail the rows past the groups belong to no item: the interpreter's
    # uninitialised memory (NaN) must survive there, and every other row must be right.
    lhs, rhs = _bf16(rng, PADDED_ROWS, 64), _bf16(rng, len(GROUP_SIZES), 64, 64)
    with gpu_interpreter():
        out = mosaic_gmm.gmm(lhs, rhs, _schedule(cover_tail=False), tiles=TILES,
                             backend="mosaic", out_dtype=jnp.float32)
    out = np.asarray(out)
    assert np.isnan(out[NUM_ROWS:]).all()
    assert peak_rel_err(out[:NUM_ROWS], _reference_gmm(lhs, rhs)[:NUM_ROWS]) < 1e-5


@needs_interpreter
def test_gmm_activation_swiglu_and_backward(rng, few_sms):
    d_dim, h_dim, tokens = 64, 128, 13
    x = _bf16(rng, tokens, d_dim)
    index = rng.integers(0, tokens, PADDED_ROWS).astype(np.int32)
    w_gate, w_up = _bf16(rng, 6, d_dim, h_dim, scale=0.2), _bf16(rng, 6, d_dim, h_dim, scale=0.2)
    w_down = _bf16(rng, 6, h_dim, d_dim, scale=0.2)
    with gpu_interpreter():
        act, gate, up = mosaic_gmm.gmm_activation(
            x, w_gate, w_up, _schedule(), tiles=TILES, backend="mosaic",
            index=jnp.asarray(index), save_preactivations=True,
        )
    gate_ref = _reference_gmm(_f32(x)[index], w_gate)
    up_ref = _reference_gmm(_f32(x)[index], w_up)
    silu = gate_ref / (1 + np.exp(-gate_ref))
    tol = 1e-2  # bfloat16 outputs
    assert peak_rel_err(gate, gate_ref) < tol and peak_rel_err(up, up_ref) < tol
    assert peak_rel_err(act, silu * up_ref) < tol

    scale = rng.standard_normal(PADDED_ROWS).astype(np.float32)
    with gpu_interpreter():
        (act_scaled,) = mosaic_gmm.gmm_activation(
            x, w_gate, w_up, _schedule(), tiles=TILES, backend="mosaic",
            index=jnp.asarray(index), row_scale=jnp.asarray(scale),
        )
    assert peak_rel_err(act_scaled, scale[:, None] * silu * up_ref) < tol

    dy = _bf16(rng, tokens, d_dim)
    with gpu_interpreter():
        d_gate, d_up, dw_partial = mosaic_gmm.gmm_activation_bwd(
            dy, w_down, gate, up, jnp.asarray(scale), _schedule(), tiles=TILES,
            backend="mosaic", index=jnp.asarray(index),
        )
    gate_in, up_in = _f32(gate), _f32(up)
    dz = _reference_gmm(_f32(dy)[index], w_down, transpose=True)
    sig = 1 / (1 + np.exp(-gate_in))
    silu_in = gate_in * sig
    d_act = scale[:, None] * dz
    assert peak_rel_err(d_up, d_act * silu_in) < tol
    assert peak_rel_err(d_gate, d_act * up_in * sig * (1 + gate_in * (1 - sig))) < tol
    assert dw_partial.dtype == jnp.float32
    assert peak_rel_err(dw_partial.sum(0), np.sum(dz * silu_in * up_in, axis=1)) < 1e-5


@pytest.mark.parametrize(("d_dim", "h_dim", "dtype", "programs_per_sm", "expected"), [
    (512, 128, jnp.bfloat16, 2, (64, 128, 64, 3, 2)),  # the E64 decoder: 1 column tile
    (512, 128, jnp.float16, 2, (64, 128, 64, 3, 2)),
    (512, 256, jnp.bfloat16, 2, (64, 128, 64, 3, 2)),  # 2 column tiles, each gathers
    (512, 384, jnp.bfloat16, 2, None),  # 3 column tiles: XLA gathers once instead
    (512, 1024, jnp.bfloat16, 2, None),  # the E8 layer (measured slower gathering)
    (200, 128, jnp.bfloat16, 2, None),  # no whole 128-byte steps
    (512, 128, jnp.bfloat16, 3, None),  # two slots of rows do not fit beside the weights
])  # fmt: skip
def test_gathering_tiles(d_dim, h_dim, dtype, programs_per_sm, expected):
    tiles = dataclasses.replace(common.default_config(dtype),
                                programs_per_sm=programs_per_sm)
    max_column_tiles = rules.limit("gather_rows", "max_column_tiles")
    assert gmm_gather.gathering_tiles(tiles, d_dim, h_dim, dtype, max_column_tiles) == expected


@needs_interpreter
def test_gmm_activation_forward_gathers_in_row_sub_tiles(rng, few_sms):
    # An inference forward reading rows through the index works each 128-row item in 64-row
    # sub-tiles of all 128 columns (on a GPU each gathers its rows: gmm_gather; the
    # interpreter reads XLA's copy): every kept row right, rows of no item left unwritten.
    tiles = dataclasses.replace(TILES, block_m=128, block_n=128)
    d_dim, h_dim, tokens = 128, 128, 13
    assert gmm_gather.gathering_tiles(tiles, d_dim, h_dim, jnp.bfloat16, 1)[:2] == (64, 128)
    x = _bf16(rng, tokens, d_dim)
    index = rng.integers(0, tokens, PADDED_ROWS).astype(np.int32)
    w_gate, w_up = _bf16(rng, 6, d_dim, h_dim, scale=0.2), _bf16(rng, 6, d_dim, h_dim, scale=0.2)
    scale = rng.standard_normal(PADDED_ROWS).astype(np.float32)
    schedule = dispatch.gmm_schedule(_offsets(), PADDED_ROWS, 128, cover_tail=False)
    with gpu_interpreter():
        (act,) = mosaic_gmm.gmm_activation(
            x, w_gate, w_up, schedule, tiles=tiles, backend="mosaic",
            index=jnp.asarray(index), row_scale=jnp.asarray(scale),
        )
    gate_ref = _reference_gmm(_f32(x)[index], w_gate)
    up_ref = _reference_gmm(_f32(x)[index], w_up)
    expected = scale[:, None] * gate_ref / (1 + np.exp(-gate_ref)) * up_ref
    out = np.asarray(act, np.float32)
    assert peak_rel_err(out[:NUM_ROWS], expected[:NUM_ROWS]) < 1e-2
    assert np.isnan(out[NUM_ROWS:]).all()


@pytest.mark.parametrize(("tokens", "width", "itemsize", "top_k", "expected"), [
    (131072, 512, 2, 8, 32),  # the E64 decoder: 32 tokens (32 KiB) a slot
    (1000, 512, 2, 3, 8),  # the largest power of two dividing the tokens
    (1024, 2048, 2, 2, 8),  # 4 KiB rows: two programs' slots fit an SM at 8 tokens
    (1024, 4096, 2, 2, None),  # 8 KiB rows: not even at 8 tokens
    (100, 512, 2, 2, None),  # blocks of 4 copy too little a step
    (0, 512, 2, 2, None),  # no tokens: no blocks
])  # fmt: skip
def test_copy_rows_blocks(tokens, width, itemsize, top_k, expected):
    min_block_tokens = rules.limit("copy_rows", "min_block_tokens")
    assert gmm_rows.block_tokens(tokens, width, itemsize, top_k, min_block_tokens) == expected


@needs_interpreter
@pytest.mark.parametrize(("tokens", "top_k", "num_experts", "row_multiple"), [
    (64, 2, 6, 64),  # blocks of 32 over two programs, no padding
    (96, 3, 5, 64),  # 32 padding rows (token 0's, as the gather gives them)
    (40, 2, 4, 16),  # blocks of 8
    (30, 2, 4, 16),  # blocks of 2: XLA's gather
])  # fmt: skip
def test_copy_rows_is_the_gather(rng, few_sms, tokens, top_k, num_experts, row_multiple):
    expert_ids = np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :top_k]
    layout = dispatch.sort_by_expert(jnp.asarray(expert_ids, jnp.int32), num_experts,
                                     row_multiple=row_multiple)
    x = _bf16(rng, tokens, 64)
    with gpu_interpreter():
        copied = jax.jit(mosaic_gmm.copy_rows)(x, layout)
    np.testing.assert_array_equal(_f32(copied), _f32(x)[np.asarray(layout.row_token)])


@pytest.mark.parametrize(("tokens", "experts", "top_k", "expected"), [
    (131072, 64, 8, 64),
    (4160, 64, 8, 64),  # 65 blocks
    (1000, 64, 8, None),  # no block of 64 divides it: XLA routes
    (1024, 6, 2, None),  # experts not a multiple of the register layout's 8 columns
    (1024, 8, 9, None),  # more choices than experts
])  # fmt: skip
def test_router_blocks(tokens, experts, top_k, expected):
    assert mosaic_router.block_tokens(tokens, experts, top_k) == expected


@needs_interpreter
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [
    (256, 64, 8),  # four blocks over four programs
    (320, 16, 4),  # five blocks over four programs: one program takes two
    (192, 8, 8),  # every expert ranked
])  # fmt: skip
def test_router_rank_is_xlas(rng, few_sms, tokens, experts, top_k):
    """The kernel's logits and softmax are XLA's (to rounding), and its experts XLA's argmax
    passes': best first, ties to the lower expert, NaNs ranked first."""
    parts = router_logit_parts(rng, tokens, experts)
    with gpu_interpreter():
        logits, probs, ids, top = jax.jit(mosaic_router.rank, static_argnums=1)(parts, top_k)
    expected_logits = router.sum_thirds(parts)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(expected_logits))
    expected_probs = jax.nn.softmax(expected_logits, axis=-1)
    np.testing.assert_allclose(np.asarray(probs), np.asarray(expected_probs), rtol=1e-6, atol=0)
    expected_top, expected_ids = router.top_k_experts(probs, top_k)
    np.testing.assert_array_equal(np.asarray(ids).T, np.asarray(expected_ids))
    np.testing.assert_array_equal(np.asarray(top).T, np.asarray(expected_top))
    # a NaN logit makes its token's probabilities all NaN: the first k experts, in order
    np.testing.assert_array_equal(np.asarray(ids)[:, tokens // 2], np.arange(top_k))


@needs_interpreter
@pytest.mark.parametrize("dense", [(), ("probs",), ("probs", "logits")])
def test_router_logit_grad_pieces(rng, few_sms, dense):
    """The softmax's backward from the top probabilities' gradient (and dense ones), as three
    bfloat16 pieces that add up to XLA's gradient exactly."""
    tokens, experts, top_k = 320, 16, 4
    probs = jax.nn.softmax(jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32))
    ids = router.top_k_experts(probs, top_k)[1]
    d_top = jnp.asarray(rng.standard_normal((tokens, top_k)), jnp.float32)
    d_dense = {name: jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32)
               for name in dense}

    def loss(probs):
        top = jnp.take_along_axis(probs, ids, axis=-1)
        return jnp.sum(top * d_top) + jnp.sum(probs * d_dense.get("probs", 0.0))

    expected = jax.vjp(jax.nn.softmax, jnp.log(probs))[1](jax.grad(loss)(probs))[0]
    expected = expected + d_dense.get("logits", 0.0)
    with gpu_interpreter():
        d_pieces, dx_pieces = jax.jit(mosaic_router.logit_grad_pieces)(
            probs, ids.T, d_top.T, d_dense.get("probs"), d_dense.get("logits"))
    d_pieces, dx_pieces = _f32(d_pieces), _f32(dx_pieces)
    thirds = [d_pieces[:, i * experts : (i + 1) * experts] for i in range(3)]
    np.testing.assert_allclose((thirds[2] + thirds[1]) + thirds[0], np.asarray(expected),
                               rtol=1e-5, atol=1e-7)
    expected_pieces = router.bf16_pieces(jnp.asarray((thirds[2] + thirds[1]) + thirds[0]))
    for third, piece in zip(thirds, expected_pieces, strict=True):
        np.testing.assert_array_equal(third, _f32(piece))
    np.testing.assert_array_equal(dx_pieces, np.concatenate([thirds[0], thirds[0], thirds[1]], 1))


def test_router_kernels_leave_other_inputs_to_xla():
    assert mosaic_router.rank(jnp.zeros((1000, 192), jnp.float32), 8) is None
    assert mosaic_router.rank(jnp.zeros((1024, 192), jnp.bfloat16), 8) is None
    assert mosaic_router.logit_grad_pieces(
        jnp.zeros((1000, 64)), jnp.zeros((8, 1000), jnp.int32), jnp.zeros((8, 1000))) is None


@needs_interpreter
@pytest.mark.parametrize("aux", [False, True])
def test_route_on_mosaic_matches_xla(rng, few_sms, aux):
    """``router.route`` on the Mosaic GPU kernels: the same experts, weights and gradients as
    XLA's, with and without the aux losses' dense gradients."""
    x = jnp.asarray(rng.standard_normal((256, 64)), jnp.bfloat16)
    weights = jnp.asarray(rng.standard_normal((64, 16)) * 0.1, jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((256, 4)), jnp.float32)

    def loss(x, weights, backend):
        routed = router.route(x, weights, 4, True, backend=backend)
        value = jnp.sum(routed.weights * cotangent)
        if aux:
            losses = router.router_aux(routed, 16)
            value = value + losses["router_z_loss"] + losses["load_balance_loss"]
        return value, routed.expert_ids

    with gpu_interpreter():
        (value, ids), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True),
                                      static_argnums=2)(x, weights, "mosaic")
    (value_x, ids_x), grads_x = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        x, weights, None)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_x))
    np.testing.assert_allclose(float(value), float(value_x), rtol=1e-6)
    for grad, grad_x in zip(grads, grads_x, strict=True):
        # the x gradient is bf16: the two sides may round one sum to neighbouring values
        rtol = max(1e-5, float(jnp.finfo(grad.dtype).eps))
        np.testing.assert_allclose(_f32(grad), _f32(grad_x), rtol=rtol, atol=1e-6)


@needs_interpreter
@pytest.mark.parametrize("gathered", [False, True])
def test_tgmm_ragged_contraction(rng, few_sms, gathered):
    k_dim, n_dim = 128, 64  # two output row tiles of 64
    offsets = np.asarray(_offsets())
    rhs = rng.standard_normal((PADDED_ROWS, n_dim)).astype(np.float32)
    # Garbage past the groups must not leak into any expert's gradient.
    rhs[NUM_ROWS:] = np.nan
    rhs, rhs2 = jnp.asarray(rhs, jnp.bfloat16), _bf16(rng, PADDED_ROWS, n_dim)
    kwargs = {}
    if gathered:
        source = _bf16(rng, 9, k_dim)
        index = rng.integers(0, 9, PADDED_ROWS).astype(np.int32)
        lhs, lhs_rows = source, _f32(source)[index]
        kwargs["lhs_index"] = jnp.asarray(index)
    else:
        lhs = _f32(rng.standard_normal((PADDED_ROWS, k_dim)))
        lhs[NUM_ROWS:] = np.nan
        lhs = jnp.asarray(lhs, jnp.bfloat16)
        lhs_rows = _f32(lhs)
    with gpu_interpreter():
        out, out2 = mosaic_gmm.tgmm(lhs, rhs, jnp.asarray(offsets, jnp.int32), tiles=TILES,
                                    backend="mosaic", rhs2=rhs2, out_dtype=jnp.float32, **kwargs)
    assert out.shape == (len(GROUP_SIZES), k_dim, n_dim)
    for expert in range(len(GROUP_SIZES)):
        rows = slice(offsets[expert], offsets[expert + 1])
        np.testing.assert_allclose(out[expert], lhs_rows[rows].T @ _f32(rhs)[rows], atol=1e-3)
        np.testing.assert_allclose(out2[expert], lhs_rows[rows].T @ _f32(rhs2)[rows], atol=1e-3)
    assert not np.any(out[1]) and not np.any(out[4])  # experts without rows


@pytest.mark.parametrize(("d_dim", "h_dim", "num_experts", "stages"), [
    (512, 128, 64, 3),  # the E64 decoder: two items per SM, three 48 KiB ring slots
    (512, 64, 64, 3),
    (256, 128, 6, 3),
    (192, 128, 64, None),  # d_model not a multiple of 128
    (512, 256, 64, None),  # weight-gradient accumulators over a warpgroup's registers
    (4096, 128, 64, None),  # 16 items per SM
])  # fmt: skip
def test_joined_dx_layout(d_dim, h_dim, num_experts, stages):
    assert gmm_dx.layout(d_dim, h_dim, num_experts, jnp.bfloat16) == stages


def test_joined_dx_items_spread_over_programs():
    # Steps per item: one per 64-row chunk holding the expert's rows, one for an expert
    # without rows; items (expert, 128 features) dealt round-robin over the programs.
    offsets = jnp.asarray([0, 7, 7, 144, 149], jnp.int32)
    starts = gmm_dx.item_starts(offsets, num_feature_blocks=2, programs=3)
    # Item i = (expert i // 2, features i % 2) runs on program i % 3. Steps of the eight:
    # (e0, f0) 1, (e0, f1) 1, (e1, f0) 1, (e1, f1) 1, (e2, f0) 3, (e2, f1) 3, (e3, f0) 1,
    # (e3, f1) 1; program 2's third item does not exist.
    np.testing.assert_array_equal(starts, [[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 4, 4]])


@needs_interpreter
@pytest.mark.parametrize("h_dim", [128, 64])
def test_input_and_gate_up_grads_in_one_pass(rng, few_sms, h_dim):
    # d = 256: two (expert, 128 features) items per expert, twelve over the two programs.
    # Chunks of 64 rows straddle experts (0 | 2 at row 7, 2 | 3 | 5 at 144 and 149), experts
    # 1 and 4 have no rows, and rows past the groups belong to none: dx leaves them unwritten.
    d_dim, num_experts = 256, len(GROUP_SIZES)
    x = _bf16(rng, PADDED_ROWS, d_dim)
    d_gate, d_up = _bf16(rng, PADDED_ROWS, h_dim), _bf16(rng, PADDED_ROWS, h_dim)
    w_gate, w_up = (_bf16(rng, num_experts, d_dim, h_dim) for _ in range(2))
    with gpu_interpreter():
        dx, dw_gate, dw_up = mosaic_gmm.input_and_gate_up_grads(
            x, d_gate, d_up, w_gate, w_up, _offsets(), tiles=TILES, backend="mosaic")
    assert dx.dtype == dw_gate.dtype == jnp.bfloat16 and dw_up.shape == w_up.shape
    offsets = np.asarray(_offsets())
    for expert in range(num_experts):
        rows = slice(offsets[expert], offsets[expert + 1])
        expected = (_f32(d_gate)[rows] @ _f32(w_gate[expert]).T
                    + _f32(d_up)[rows] @ _f32(w_up[expert]).T)
        if GROUP_SIZES[expert]:
            assert peak_rel_err(_f32(dx)[rows], expected) < 1e-2, f"dx of expert {expert}"
        for grad, rhs in ((dw_gate, d_gate), (dw_up, d_up)):
            expected = _f32(x)[rows].T @ _f32(rhs)[rows]
            np.testing.assert_allclose(_f32(grad[expert]), expected, atol=0.1, rtol=1e-2)
    assert not np.any(_f32(dw_gate[1])) and not np.any(_f32(dw_up[4]))
    assert np.isnan(_f32(dx)[NUM_ROWS:]).all()


def test_joined_dx_needs_one_dtype(rng):
    x = _bf16(rng, PADDED_ROWS, 256)
    grads = [_bf16(rng, PADDED_ROWS, 128) for _ in range(2)]
    weights = [jnp.asarray(_bf16(rng, 6, 256, 128), jnp.float16) for _ in range(2)]
    assert mosaic_gmm.input_and_gate_up_grads(
        x, *grads, *weights, _offsets(), tiles=TILES, backend="mosaic") is None


# ----------------------------------------------------------------------------------------------
# The layer in the interpreter: forward and every gradient against the float32 oracle

DIMS = dict(d_model=64, d_hidden=128, num_experts=4)


@needs_interpreter
@pytest.mark.parametrize("top_k,dispatch_name,routing,skew,recompute,d_model", [
    (2, "sorted", "dropless", 0.0, False, 64),
    (2, "fused", "dropless", 0.0, False, 64),
    (2, "gather", "capacity", 0.0, False, 64),
    (1, "sorted", "dropless", 0.9, False, 64),  # one expert holds every token
    (2, "sorted", "dropless", 0.0, True, 64),
    (2, "fused", "dropless", 0.0, False, 128),  # dx joins the gate/up gradients
])  # fmt: skip
def test_layer_matches_oracle(few_sms, top_k, dispatch_name, routing, skew, recompute,
                              d_model):
    # With one expert per token, renormalised weights are all 1 and the router gets no gradient
    # through them: keep the probabilities.
    math = dict(**{**DIMS, "d_model": d_model}, top_k=top_k, dtype=jnp.bfloat16,
                routing=routing, capacity_factor=0.8, renormalize=top_k > 1)
    config = tilax.MoEConfig(**math, impl="mosaic", dispatch=dispatch_name, recompute=recompute,
                             recompute_rows=128)
    params = tilax.moe_init(jax.random.key(0), config)
    # 152 tokens: dropless train steps read sorted copies made by gmm_rows (blocks of
    # 8) with padding rows after the copies
    x = jax.random.normal(jax.random.key(1), (152, d_model))
    if skew:
        x = skew_tokens(x, params["router"], skew)
    x = x.astype(jnp.bfloat16)
    cotangent = jax.random.normal(jax.random.key(2), x.shape)

    def loss(apply):
        def value(p, x):
            y = apply(p, x)
            return jnp.sum(y.astype(jnp.float32) * cotangent), y

        return jax.jit(jax.value_and_grad(value, argnums=(0, 1), has_aux=True))

    with _pallas.assume_device(mosaic_unavailable_reason=None), gpu_interpreter():
        traced = loss(lambda p, x: tilax.moe_apply(p, x, config)[0]).trace(params, x)
        (_, y), grads = traced.lower().compile()(params, x)
    oracle = tilax.MoEConfig(**math)
    (_, y_ref), grads_ref = loss(lambda p, x: reference.moe_oracle(p, x, oracle))(params, x)
    if skew:
        counts = tilax.moe_apply(params, x, oracle)[1]["expert_counts"]
        assert int(counts.max()) == x.shape[0]
    assert peak_rel_err(y, y_ref) < 3e-2, "output"
    for (path, expected), actual in zip(
        jax.tree_util.tree_flatten_with_path(grads_ref)[0], jax.tree.leaves(grads), strict=True
    ):
        assert peak_rel_err(actual, expected) < 3e-2, f"gradient {jax.tree_util.keystr(path)}"
    # d_model 128 (and the sorted copy of x a train step reads): one kernel for dx and the
    # gate/up gradients; d_model 64 is no multiple of its 128-feature items.
    joined = "moe_gmm_dx_mosaic" in str(traced.jaxpr)  # the kernel's name (mosaic.gmm_dx)
    assert joined == (d_model == 128 and not recompute)


# ----------------------------------------------------------------------------------------------
# The shared expert's kernels (mosaic.shared)


def _shared_weights(rng, d_dim, s_dim):
    return {"w_gate": jnp.asarray(_bf16(rng, d_dim, s_dim, scale=d_dim**-0.5)),
            "w_up": jnp.asarray(_bf16(rng, d_dim, s_dim, scale=d_dim**-0.5)),
            "w_down": jnp.asarray(_bf16(rng, s_dim, d_dim, scale=s_dim**-0.5))}


@needs_interpreter
def test_shared_expert_kernels_match_float32(rng, few_sms):
    # 384 tokens and S = 256: three row tiles by two column tiles, over two programs (one per
    # SM) of three items each, so the gate/up tiles and the staging slots are reused.
    tokens, d_dim, s_dim = 384, 128, 256
    x, dy = jnp.asarray(_bf16(rng, tokens, d_dim)), jnp.asarray(_bf16(rng, tokens, d_dim))
    shared = _shared_weights(rng, d_dim, s_dim)
    assert mosaic_shared.applies(x, shared)
    args = (x, shared["w_gate"], shared["w_up"], shared["w_down"])

    def reference_f32(x, w_gate, w_up, w_down):
        return reference.shared_expert(x, dict(w_gate=w_gate, w_up=w_up, w_down=w_down))

    y_ref, vjp_ref = jax.vjp(reference_f32, *[a.astype(jnp.float32) for a in args])
    with gpu_interpreter():
        act, gate, up = mosaic_shared.activation_forward("swiglu", *args[:3])
        y, vjp = jax.vjp(functools.partial(mosaic_shared.shared_expert, "swiglu"), *args)
        grads = vjp(dy)
    gate_ref, up_ref = (_f32(x) @ _f32(shared[n]) for n in ("w_gate", "w_up"))
    tol = 1e-2  # bfloat16 outputs
    assert peak_rel_err(gate, gate_ref) < tol and peak_rel_err(up, up_ref) < tol
    assert peak_rel_err(act, gate_ref / (1 + np.exp(-gate_ref)) * up_ref) < tol
    assert y.dtype == jnp.bfloat16 and peak_rel_err(y, y_ref) < tol
    for name, grad, expected in zip(("x", "w_gate", "w_up", "w_down"), grads,
                                    vjp_ref(dy.astype(jnp.float32)), strict=True):
        assert grad.dtype == jnp.bfloat16 and peak_rel_err(grad, expected) < tol, name


def test_shared_expert_kernels_take_whole_tiles(rng):
    shared = _shared_weights(rng, 128, 256)
    x = jnp.zeros((384, 128), jnp.bfloat16)
    assert mosaic_shared.applies(x, shared)
    assert not mosaic_shared.applies(x[:200], shared)  # tokens not a multiple of 128
    assert not mosaic_shared.applies(x.astype(jnp.float32), shared)
    narrow = _shared_weights(rng, 128, 192)  # hidden width not a multiple of 128
    assert not mosaic_shared.applies(x, narrow)
