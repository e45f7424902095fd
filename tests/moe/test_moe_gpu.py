"""GPU checks of every Pallas Triton impl x dispatch against the float32 dense oracle (skipped
off GPU); the Mosaic GPU backend's are in test_moe_mosaic_gpu.py.

Run on the GPU host, serially (pytest-xdist workers on one GPU were slower, each paying the
compile of every shape), with XLA's autotuning off: the float32 dense oracle's matmuls are
autotuned at every new shape otherwise (the first test of each shape took 35-50 s), and only
the kernels' results matter here::

    XLA_FLAGS=--xla_gpu_autotune_level=0 PYTHONPATH=src \\
        python -m pytest tests/moe/test_moe_gpu.py -q

On the H200 (commit 2452d44) this file and tests/moe/test_moe_recompute.py (which runs on the
GPU too) passed together in 172 s (45 passed; skipped: the check of the error where Mosaic GPU
cannot run); without the flag this file alone took 264 s (commit cf11ba3).

``MoEConfig.deterministic``'s repeatability (Triton and Mosaic GPU, E8 top-2 at 16k tokens)
runs alone with ``-k deterministic_train_step -s`` (it prints whether the default's repeats
differ).

Moderate sizes; token counts are not multiples of any tile. float32 operands use the GPU's
default (TF32) matmul precision in the kernels, hence the looser float32 tolerance.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_gpu_testing import DECODER, DISPATCHES, LAYER, check_deterministic, inputs, loss_step
from moe_gpu_testing import compare as _compare

import tilax
from tilax import _pallas

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]



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


@pytest.mark.parametrize("impl", ["triton", "ragged_dot"])
def test_deepseek_routing(impl):
    # DeepSeek-V3's router on the decoder's 64 experts: sigmoid scores, a balance bias that
    # moves the choice, 8 groups of which 4 are kept, the routed output scaled
    _compare(DECODER, 1500, "bfloat16", impl=impl, dispatch="fused_gsum", score_func="sigmoid",
             balance_bias=True, expert_groups=8, group_top_k=4, routed_scale=2.5)


@pytest.mark.parametrize("impl", ["blocked", "ragged_dot"])
def test_xla_baselines(impl):
    _compare(LAYER, 1001, "bfloat16", impl=impl)


@pytest.mark.parametrize("block_m,num_warps", [(64, 4), (128, 8), (64, 8)])
def test_tile_overrides(block_m, num_warps):
    _compare(LAYER, 1001, "bfloat16", impl="pallas", dispatch="fused_gsum",
             block_m=block_m, num_warps=num_warps)


def test_fused_gsum_top2_is_deterministic():
    check_deterministic(dispatch="fused_gsum")


# The activations other than SwiGLU (MoEConfig.activation) on the Triton kernels.
@pytest.mark.parametrize("activation", ["geglu", "gelu"])
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_activation_matches_oracle(dispatch, activation):
    _compare(LAYER, 1001, "bfloat16", impl="triton", dispatch=dispatch, activation=activation)


@pytest.mark.parametrize("activation", ["geglu", "gelu"])
def test_activation_float32_recompute(activation):
    _compare(LAYER, 1001, "float32", impl="triton", dispatch="fused", recompute=True,
             recompute_rows=512, activation=activation)


def test_mosaic_reports_why_it_cannot_run():
    reason = _pallas.mosaic_unavailable_reason()
    if reason is None:
        pytest.skip("this GPU runs Mosaic GPU kernels: the test_mosaic_* tests run them")
    config = tilax.MoEConfig(**LAYER, impl="mosaic")
    params = tilax.moe_init(jax.random.key(0), config)
    x = jnp.ones((8, config.d_model), config.dtype)
    with pytest.raises(ValueError, match="compute capability 9.0"):
        tilax.moe_apply(params, x, config)


# MoEConfig.deterministic: the train step at a realistic size, repeated in one process.
REPEAT_LAYER = dict(d_model=512, d_hidden=1024, num_experts=8, top_k=2)


def _repeated_train_steps(config, repeats=3):
    """``repeats`` results (loss, y, every gradient) of one compiled train step, as numpy."""
    params, x, cotangent = inputs(config, 16384, 0.0)
    step = loss_step(lambda p, x: tilax.moe_apply(p, x, config)[0], cotangent)
    results = []
    for _ in range(repeats):
        (loss, y), grads = step(params, x)
        results.append([np.asarray(leaf) for leaf in jax.tree.leaves((loss, y, grads))])
    return results


@pytest.mark.parametrize("impl", ["auto", "triton", "mosaic"])
def test_deterministic_train_step_is_bitwise_repeatable(impl):
    """Three calls of the deterministic train step (E8 top-2 d512 h1024, 16 384 tokens, bf16)
    agree bitwise: output, loss and every gradient. Prints, without asserting, whether the
    default's three calls differ (the default has no promise)."""
    if impl == "mosaic" and _pallas.mosaic_unavailable_reason() is not None:
        pytest.skip(str(_pallas.mosaic_unavailable_reason()))
    config = tilax.MoEConfig(**REPEAT_LAYER, impl=impl, deterministic=True)
    first, *others = _repeated_train_steps(config)
    for other in others:
        for a, b in zip(first, other, strict=True):
            np.testing.assert_array_equal(b, a)
    default = tilax.MoEConfig(**REPEAT_LAYER, impl=impl)
    first, *others = _repeated_train_steps(default)
    differing = sum(not np.array_equal(a, b) for other in others
                    for a, b in zip(first, other, strict=True))
    print(f"\n{impl} ({tilax.moe.resolve_impl(default)}): the default's repeats differ in "
          f"{differing} of {len(first) * len(others)} arrays")
