"""GPU checks of the decode kernels (``impl="decode"``, and ``impl="auto"`` at small batches,
which the decode rule routes to them) against the float32 dense oracle (skipped off GPU).

Run on the GPU host with XLA's autotuning off (as test_moe_gpu.py)::

    XLA_FLAGS=--xla_gpu_autotune_level=0 PYTHONPATH=src:tests \\
        python -m pytest tests/moe/test_moe_decode_gpu.py -q

Token counts from 1 to 512 (odd ones too), both bench shapes of the decode suite at 16 tokens
(their real tiles: 128-row tiles, 64-128-column strips), bfloat16, float16 and float32, capacity
drops, the other expert activations (GeGLU, not-gated gelu), and a train step at a small batch
(the custom VJP's training kernels).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_gpu_testing import DECODER, LAYER, compare, compare_forward

import tilax
from tilax.moe import api

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]

QWEN3_LIKE = dict(d_model=2048, d_hidden=768, num_experts=128, top_k=8)
MIXTRAL_LIKE = dict(d_model=4096, d_hidden=14336, num_experts=8, top_k=2)


@pytest.mark.parametrize("tokens", [1, 4, 13, 64, 256, 512])
def test_decode_forward_matches_oracle(tokens):
    compare_forward(LAYER, tokens, "bfloat16", impl="decode")


@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_fine_grained_decoder_with_shared_expert(tokens):
    compare_forward(DECODER, tokens, "bfloat16", impl="decode")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_other_dtypes(dtype):
    compare_forward(LAYER, 37, dtype, impl="decode")


@pytest.mark.parametrize("activation", ["geglu", "gelu"])
def test_other_activations(activation):
    """The decode kernels' epilogue follows MoEConfig.activation (gelu: no w_gate), and a
    train step through them runs the training kernels of that activation."""
    compare_forward(DECODER, 16, "bfloat16", impl="decode", activation=activation)
    compare(LAYER, 16, "bfloat16", impl="decode", activation=activation)


def test_capacity_routing():
    compare_forward(LAYER, 64, "bfloat16", impl="decode", routing="capacity", capacity_factor=0.8)


@pytest.mark.parametrize("dims", [QWEN3_LIKE, MIXTRAL_LIKE], ids=["qwen3", "mixtral"])
def test_bench_shapes(dims):
    compare_forward(dims, 16, "bfloat16", impl="decode")


def test_auto_runs_decode_at_small_batches_and_trains_through_it():
    config = tilax.MoEConfig(**LAYER, dtype=jnp.bfloat16)
    assert api.resolve_impl(config, 64) == "decode"
    compare_forward(LAYER, 64, "bfloat16")
    compare(LAYER, 64, "bfloat16", impl="decode")  # forward and every gradient


def test_repeats_are_bitwise_equal():
    config = tilax.MoEConfig(**LAYER, dtype=jnp.bfloat16, impl="decode")
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (256, config.d_model)).astype(config.dtype)
    apply = jax.jit(lambda p, x: tilax.moe_apply(p, x, config)[0])
    first = np.asarray(apply(params, x))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(apply(params, x)), first)
