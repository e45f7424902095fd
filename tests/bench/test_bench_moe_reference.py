"""The MoE rows' float32 dense reference, computed over chunks of tokens so that every size has
numerics: chunked and whole give the same outputs and gradients."""

import bench_moe
import jax
import pytest


@pytest.mark.parametrize("shape", [bench_moe.SMOKE_LAYER, bench_moe.SMOKE_DECODER])
def test_chunked_reference_equals_the_whole(monkeypatch, shape):
    case = bench_moe.MoECase(suite="layer", impl="pallas", dispatch="sorted", routing="dropless",
                             dtype="bfloat16", op="train_step", tokens=96, **shape)
    inputs = bench_moe.make_inputs(case)
    whole = bench_moe.reference(case, inputs)
    per_token = case.experts * (3 * case.d_hidden + case.d_model) * 4 * 2.5
    # room for 40 tokens: chunks of 32 (a power of two), the last one short
    monkeypatch.setattr(bench_moe, "REFERENCE_CHUNK_BYTES", int(40 * per_token))
    assert bench_moe.reference_chunk_tokens(case) == 32
    chunked = bench_moe.reference(case, inputs)
    for name in ("y", "grad_x"):
        assert chunked[name].shape == whole[name].shape == (96, case.d_model)
    # norm-wise, as the rows measure: only the order of the float32 sums differs (the bfloat16
    # rows' errors are about 1e-2)
    for name in ("y", "grad_x", "grad_params"):
        assert bench_moe.rel_err(chunked[name], whole[name]) < 1e-6, name
    assert jax.tree.structure(chunked["grad_params"]) == jax.tree.structure(whole["grad_params"])


def test_chunk_size():
    decoder = bench_moe.MoECase(suite="decoder", impl="pallas", dispatch="sorted",
                                routing="dropless", dtype="bfloat16", op="train_step",
                                tokens=1048576, **bench_moe.SEED_DECODER)
    # E64, h128, d512: 573 kB a token, so 43k tokens fit 24 GiB: chunks of 32768
    assert bench_moe.reference_chunk_tokens(decoder) == 32768
    small = bench_moe.MoECase(**{**decoder.__dict__, "tokens": 4096})
    assert bench_moe.reference_chunk_tokens(small) == 4096
    assert not bench_moe.wants_numerics("capacity") and bench_moe.wants_numerics("dropless")
