"""GPU checks of ``impl="mosaic"`` (the Mosaic GPU kernels, Hopper and newer) against the
float32 dense oracle: forward and every gradient, awkward group sizes (empty experts, one expert
holding every token, partial tiles), the decoder shape, float16, recompute, tile overrides,
padded features. Skipped where Mosaic GPU cannot run (test_moe_gpu.py checks the error there).

Each test compiles its own set of Mosaic kernels (about 20 s on the H200), so the file runs
spread over a few workers, with XLA's autotuning off (see test_moe_gpu.py)::

    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0 PYTHONPATH=src \\
        python -m pytest tests/moe/test_moe_mosaic_gpu.py -q -n 4

On the H200 (jax 0.11.2, commit 37bb3bf) the 40 tests passed in 139 s with ``-n 4``.
At eae54e0 the two shared-expert tests with the five copied-rows tests (``-k "shared or
copied_rows"``) passed in 46 s with ``-n 3``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import peak_rel_err
from moe_gpu_testing import DECODER, DISPATCHES, LAYER, check_deterministic, compare_forward
from moe_gpu_testing import compare as _compare
from moe_testing import router_logit_parts

from tilax import _pallas
from tilax.moe import dispatch as row_dispatch
from tilax.moe import router
from tilax.moe.mosaic import gmm as mosaic_gmm
from tilax.moe.mosaic import router as mosaic_router

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]

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
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_mosaic_train_step_on_copied_rows(dispatch):
    # 2048 tokens: blocks of 32, so the train step's sorted copies of x and dy come from
    # mosaic.gmm_rows (the token counts above fall back to XLA's gather)
    _compare(LAYER, 2048, "bfloat16", impl="mosaic", dispatch=dispatch)


@needs_mosaic
def test_mosaic_decoder_train_step_on_copied_rows_with_padding():
    # 1000 tokens x 8 copies: blocks of 8, and 64 padding rows up to the row tile
    _compare(DECODER, 1000, "bfloat16", impl="mosaic", dispatch="fused")


@needs_mosaic
@pytest.mark.parametrize(("tokens", "top_k", "experts", "width", "dtype"), [
    (2048, 8, 64, 512, "bfloat16"),  # blocks of 32, no padding
    (1000, 3, 7, 512, "bfloat16"),  # blocks of 8, 3 copies a token, 72 padding rows
    (4104, 8, 64, 256, "float16"),  # blocks of 8
    (1024, 2, 8, 2048, "bfloat16"),  # 4 KiB rows: blocks of 8
    (100, 2, 8, 512, "bfloat16"),  # blocks of 4: XLA's gather instead
])  # fmt: skip
def test_mosaic_copy_rows_is_the_gather(tokens, top_k, experts, width, dtype):
    rng = np.random.default_rng(tokens)
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
    layout = row_dispatch.sort_by_expert(jnp.asarray(ids), experts, row_multiple=128)
    x = jnp.asarray(rng.standard_normal((tokens, width)), dtype)
    copied = jax.jit(mosaic_gmm.copy_rows)(x, layout)
    assert np.array_equal(np.asarray(copied), np.asarray(x[layout.row_token]))


# The router's scores and their tolerance against XLA's (the GPU's approximate exp and division).
SCORES = {"softmax": (jax.nn.softmax, 2e-6), "sigmoid": (jax.nn.sigmoid, 4e-6)}


@needs_mosaic
@pytest.mark.parametrize(("score_func", "tokens", "experts", "top_k"), [
    ("softmax", 131072, 64, 8),  # the E64 decoder at the benchmark's size: 2048 blocks
    ("softmax", 4096 + 64, 64, 8),  # 65 blocks
    ("softmax", 1024, 8, 2),
    ("softmax", 512, 16, 16),  # every expert ranked
    ("sigmoid", 131072, 64, 8),
    ("sigmoid", 1024, 8, 2),
])  # fmt: skip
def test_mosaic_router_rank_is_xlas(score_func, tokens, experts, top_k):
    """Logits as XLA adds the pieces, the scores within the GPU's approximate ``exp`` and
    division of XLA's, and the experts of XLA's argmax passes over the kernel's scores, ties
    to the lower expert. A NaN logit makes its token's softmax probabilities all NaN: the
    kernel ranks its first k experts in order, where XLA's argmax on the GPU picks among the
    NaNs in an order of its own (seen on the H200), so that token is checked apart."""
    scores_of, rtol = SCORES[score_func]
    parts = router_logit_parts(np.random.default_rng(tokens), tokens, experts)
    logits, scores, ids, top = jax.jit(mosaic_router.rank, static_argnums=(1, 2))(
        parts, top_k, score_func)
    expected_logits = router.sum_thirds(parts)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(expected_logits))
    np.testing.assert_allclose(np.asarray(scores), np.asarray(scores_of(expected_logits)),
                               rtol=rtol, atol=1e-30)
    expected_top, expected_ids = router.top_k_experts(scores, top_k)
    ids, top, nan_token = np.asarray(ids).T, np.asarray(top).T, tokens // 2
    np.testing.assert_array_equal(ids[nan_token], np.arange(top_k))
    if score_func == "softmax":
        assert np.isnan(top[nan_token]).all()
    others = np.arange(tokens) != nan_token
    np.testing.assert_array_equal(ids[others], np.asarray(expected_ids)[others])
    np.testing.assert_array_equal(top[others], np.asarray(expected_top)[others])


@needs_mosaic
@pytest.mark.parametrize("aux", [False, True])
@pytest.mark.parametrize(("score_func", "routed_scale"), [("softmax", 1.0), ("sigmoid", 2.5)])
def test_mosaic_route_matches_xla(score_func, routed_scale, aux):
    """``router.route`` on the kernels at the E64 decoder's width: XLA's experts, and its
    weights and gradients to float32 rounding, with and without the aux losses (with sigmoid
    scores, the normalised scores' gradient), softmax and sigmoid scores."""
    rng = np.random.default_rng(7 if score_func == "softmax" else 8)
    tokens, experts, top_k = 8192, 64, 8
    x = jnp.asarray(rng.standard_normal((tokens, 512)), jnp.bfloat16)
    weights = jnp.asarray(rng.standard_normal((512, experts)) * 0.05, jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((tokens, top_k)), jnp.float32)

    def loss(x, weights, backend):
        routed = router.route(x, weights, top_k, True, backend=backend, score_func=score_func,
                              routed_scale=routed_scale)
        value = jnp.sum(routed.weights * cotangent)
        if aux:
            losses = router.router_aux(routed, experts)
            value = value + losses["router_z_loss"] + losses["load_balance_loss"]
        return value, (routed.expert_ids, routed.weights)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    assert "moe_router_rank_mosaic" in str(jax.make_jaxpr(step, static_argnums=2)(
        x, weights, "mosaic"))
    (value, (ids, w)), grads = step(x, weights, "mosaic")
    (value_x, (ids_x, w_x)), grads_x = step(x, weights, None)
    assert np.array_equal(np.asarray(ids), np.asarray(ids_x))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_x), rtol=SCORES[score_func][1],
                               atol=1e-7)
    np.testing.assert_allclose(float(value), float(value_x), rtol=1e-5)
    # The scores differ in their last bits (the GPU's approximate exp): the bfloat16 input
    # gradient by a rounding at most, the float32 router gradient by about as little.
    assert peak_rel_err(grads[0], grads_x[0]) < 2**-8
    assert peak_rel_err(grads[1], grads_x[1]) < 1e-5


# DeepSeek-V3's router on the decoder's 64 experts: XLA routes (bias and groups), the rest of
# the layer runs on the Mosaic GPU kernels.
DEEPSEEK = dict(score_func="sigmoid", balance_bias=True, expert_groups=8, group_top_k=4,
                routed_scale=2.5)


@needs_mosaic
@pytest.mark.parametrize("dispatch", ["sorted", "fused_gsum"])
def test_mosaic_deepseek_routing_matches_oracle(dispatch):
    _compare(DECODER, 2048, "bfloat16", impl="mosaic", dispatch=dispatch, **DEEPSEEK)


@needs_mosaic
def test_mosaic_sigmoid_layer_on_the_router_kernels():
    # 2048 tokens and 64 experts: the router kernels take the sigmoid scores in the layer
    _compare(DECODER, 2048, "bfloat16", impl="mosaic", dispatch="fused", score_func="sigmoid",
             routed_scale=2.5)


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
def test_mosaic_decoder_skewed_routing():
    # A few experts hold nearly every copy, the others none: dx and the gate/up gradients
    # (one kernel at the decoder's shapes, mosaic.gmm_dx) run long items beside empty ones
    _compare(DECODER, 2049, "bfloat16", skew=0.9, impl="mosaic", dispatch="fused")


@needs_mosaic
@pytest.mark.parametrize("dispatch", ["fused", "fused_gsum"])
@pytest.mark.parametrize(("tokens", "skew", "dtype", "tiles"), [
    (1500, 0.0, "bfloat16", {}),  # 128-row items, two 64-row sub-tiles each
    (1500, 0.0, "bfloat16", dict(block_m=64, block_n=128)),  # 64-row items, one sub-tile
    (1500, 0.0, "float16", {}),
    (5, 0.0, "bfloat16", {}),  # 40 copies: most experts empty, partial sub-tiles
    (2049, 0.9, "bfloat16", {}),  # a few experts hold nearly every copy
])  # fmt: skip
def test_mosaic_forward_gathers_rows_in_the_kernel(dispatch, tokens, skew, dtype, tiles):
    # the decoder's SwiGLU kernel has 1 column tile of 128: an inference forward gathers x's
    # rows itself (tilax.moe.mosaic.gmm_gather), where a train step reads a sorted copy
    compare_forward(DECODER, tokens, dtype, skew=skew, impl="mosaic", dispatch=dispatch,
                    **tiles)


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
    check_deterministic(impl="mosaic", dispatch="fused_gsum")


@needs_mosaic
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mosaic_decoder_shared_expert_in_the_products_epilogues(dtype):
    # 1024 tokens fill whole 128-row tiles, so the shared expert's SwiGLU runs in the dense
    # products' epilogues (tilax.moe.mosaic.shared) rather than as XLA's elementwise passes
    _compare(DECODER, 1024, dtype, impl="mosaic", dispatch="fused")


# The activations other than SwiGLU (MoEConfig.activation): the same kernels with the GeGLU or
# the not-gated GELU in their epilogues, forward and backward (the not-gated one runs the up
# projection alone), the shared expert's kernels, the gathering forward and the recompute path.
# On the GPU host: ``-k activation`` runs these and test_moe_gpu.py's Triton ones.


@needs_mosaic
@pytest.mark.parametrize("activation", ["geglu", "gelu"])
@pytest.mark.parametrize("dispatch", ["sorted", "fused", "fused_gsum"])
def test_mosaic_activation_matches_oracle(dispatch, activation):
    _compare(LAYER, 2048, "bfloat16", impl="mosaic", dispatch=dispatch, activation=activation)


@needs_mosaic
@pytest.mark.parametrize("activation", ["geglu", "gelu"])
def test_mosaic_decoder_activation_shared_kernels_and_gathering_forward(activation):
    # 1024 tokens, S = 512: the shared expert's kernels take whole tiles; the forward alone runs
    # the activation kernel that gathers its rows (one column tile of d_hidden = 128)
    _compare(DECODER, 1024, "bfloat16", impl="mosaic", dispatch="fused", activation=activation)
    compare_forward(DECODER, 1024, "bfloat16", impl="mosaic", dispatch="fused",
                    activation=activation)


@needs_mosaic
@pytest.mark.parametrize("activation", ["geglu", "gelu"])
def test_mosaic_activation_recompute(activation):
    _compare(LAYER, 1001, "bfloat16", impl="mosaic", dispatch="fused", recompute=True,
             recompute_rows=512, activation=activation)
