"""The decode suite's grid (tests/bench/bench_moe.py ``decode_cases``): both layers at every
token count with every tilax path and peer, bfloat16 forward only, the copy bandwidth first and
last; and the touched-weight bytes each row records, against a count of the routed experts."""

import bench_harness
import bench_moe
import jax
import jax.numpy as jnp
import numpy as np

IMPLS = {
    "auto",
    "decode",
    "triton",
    "mosaic",
    "ragged_dot",
    "tokamax",
    "torch_grouped_mm",
    "torch_grouped_mm_compile",
}


def test_every_impl_at_every_size_of_both_layers():
    cases = bench_moe.decode_cases("full")
    copies = [case for case in cases if isinstance(case, bench_moe.CopyBandwidthCase)]
    assert [case.label for case in copies] == ["first", "last"]
    assert cases[0] is copies[0] and cases[-1] is copies[1]
    assert min(c.priority for c in cases) == copies[0].priority  # run before every layer row
    assert max(c.priority for c in cases) == copies[1].priority  # and after
    assert all(case.nbytes >= 2**30 for case in copies)  # far past L2
    layer = [case for case in cases if isinstance(case, bench_moe.DecodeCase)]
    assert len(layer) + len(copies) == len(cases)
    assert {(c.dtype, c.op, c.routing) for c in layer} == {("bfloat16", "forward", "dropless")}
    for shape in bench_moe.DECODE_SHAPES.values():
        rows = {
            (c.impl, c.tokens)
            for c in layer
            if (c.d_model, c.d_hidden, c.experts, c.top_k)
            == (shape["d_model"], shape["d_hidden"], shape["experts"], shape["top_k"])
        }
        assert rows == {(impl, t) for impl in IMPLS for t in (1, 4, 16, 64, 256, 512)}
    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids))


def test_touched_weight_bytes_count_the_routed_experts():
    case = next(
        c
        for c in bench_moe.decode_cases("smoke")
        if isinstance(c, bench_moe.DecodeCase) and c.tokens == 1
    )
    inputs = bench_moe.make_inputs(case)
    info = bench_moe.touched_weights(case, inputs)
    # the layer's routing: the top-k of x @ router (float32) per token
    logits = np.asarray(inputs.x, np.float32) @ np.asarray(inputs.params["router"])
    routed = np.argsort(-logits, axis=1)[:, : case.top_k]
    touched = len(np.unique(routed))
    assert info["touched_experts"] == touched == case.top_k  # one token: top_k experts
    per_expert = 3 * case.d_model * case.d_hidden * 2  # bfloat16 w_gate, w_up, w_down
    shared = 3 * case.d_model * case.shared_hidden * 2
    router = case.d_model * case.experts * 4
    assert info["touched_weight_bytes"] == touched * per_expert + shared + router


def test_copy_bandwidth_row_copies_its_buffer():
    case = bench_moe.CopyBandwidthCase("decode", 2**16, "first", 4)
    workload = case.build(state=None)
    out = workload.call()
    (buffer,) = workload.args
    assert out.shape == buffer.shape and out.dtype == jnp.uint32
    assert bool(jnp.all(out == buffer)) and out is not buffer
    assert case.rates(1e-3)["gbps"] == 2 * 2**16 / 1e-3 / 1e9
    assert isinstance(workload, bench_harness.JaxWorkload) and jax.default_backend()
