"""The MoE suites' grids where they name the peers: tokamax, PyTorch ``_grouped_mm`` (eager and
compiled) and ``lax.ragged_dot`` beside tilax at the four headline configs (E8 top-2 at 32k and
131k tokens, the E64 decoder at 16k and 131k), bfloat16, forward and train step, with errors
against the float32 reference."""

import bench_moe

HEADLINE = [(8, 32768), (8, 131072), (64, 16384), (64, 131072)]
PEERS = ("tokamax", "torch_grouped_mm", "torch_grouped_mm_compile", "ragged_dot", "pallas")


def test_every_peer_at_the_headline_configs():
    cases = bench_moe.layer_cases("full") + bench_moe.decoder_cases("full")
    for impl in PEERS:
        rows = {(case.experts, case.tokens, case.op) for case in cases
                if case.impl == impl and case.dtype == "bfloat16" and case.numerics
                and not case.skew and case.routing == "dropless" and case.top_k in (2, 8)}
        assert {(e, t, op) for e, t in HEADLINE for op in ("forward", "train_step")} <= rows, impl
    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids))


def test_peers_without_float32_rows():
    cases = bench_moe.layer_cases("full") + bench_moe.decoder_cases("full")
    assert not [case.id for case in cases
                if case.impl in bench_moe.BF16_ONLY_IMPLS and case.dtype != "bfloat16"]
