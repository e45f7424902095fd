"""The MoE suites' grids where they name the peers: the autotuned tokamax layer at the four
headline configs only (E8 top-2 at 32k and 131k tokens, the E64 decoder at 16k and 131k),
bfloat16, forward and train step, beside the tokamax layer at its defaults."""

import bench_moe


def test_autotuned_tokamax_at_the_headline_configs():
    cases = bench_moe.layer_cases("full") + bench_moe.decoder_cases("full")
    tuned = [case for case in cases if case.impl == "tokamax_autotuned"]
    assert sorted({(case.experts, case.tokens) for case in tuned}) == [
        (8, 32768), (8, 131072), (64, 16384), (64, 131072)]
    assert len(tuned) == 8 and {case.op for case in tuned} == {"forward", "train_step"}
    assert all(case.dtype == "bfloat16" and case.numerics and not case.skew for case in tuned)
    # last in their suites: each searches tokamax's configs first (minutes)
    assert all(case.priority > max(c.priority for c in cases if c.impl != case.impl)
               for case in tuned)
    defaults = {(c.suite, c.experts, c.tokens, c.op) for c in cases if c.impl == "tokamax"}
    assert {(c.suite, c.experts, c.tokens, c.op) for c in tuned} <= defaults
    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids))
    assert "decoder-tokamax_autotuned-bf16-T131072-E64k8-d512h128-S1024-train_step" in ids
