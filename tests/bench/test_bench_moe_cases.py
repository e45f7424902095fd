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


def test_deepseek_router_rows_beside_the_softmax_rows():
    """The layer suite's DeepSeek-style rows (issue 77): the E64 decoder's shape with sigmoid
    scores, the balance bias, 8 groups of 8 with 4 kept and top-8, each run right after the
    same case with the softmax router, so the two train steps share a process and a file."""
    cases = bench_moe.layer_cases("full")
    deepseek = [case for case in cases if case.router_label()]
    assert deepseek
    for case in deepseek:
        assert (case.experts, case.top_k, case.d_model, case.d_hidden, case.shared_hidden) == (
            64, 8, 512, 128, 1024)
        assert (case.score_func, case.balance_bias, case.expert_groups, case.group_top_k) == (
            "sigmoid", True, 8, 4)
        assert case.extra_info()["router"] == "sigmoid bias groups 8/4 scale 2.5"
        assert "sigmoid-bias-groups8of4-scale2.5" in case.id
        softmax = cases[cases.index(case) - 1]
        assert not softmax.router_label() and softmax.priority == case.priority
        assert softmax.id == case.id.replace("-sigmoid-bias-groups8of4-scale2.5", "")
        config = bench_moe.moe_config(case)
        assert (config.score_func, config.balance_bias, config.expert_groups,
                config.group_top_k, config.routed_scale) == ("sigmoid", True, 8, 4, 2.5)
    assert {(case.impl, case.dispatch, case.tokens, case.op) for case in deepseek} == {
        (impl, dispatch, tokens, "train_step")
        for impl, dispatch, _ in bench_moe.ROUTER_IMPLS for tokens in (16384, 131072)}
    assert {"mosaic", "torch_grouped_mm_compile"} <= {case.impl for case in deepseek}


def test_fp8_rows_beside_the_bfloat16_default():
    """The layer suite's FP8 rows (issue 79): ``quantize="fp8"`` on the FP8 Mosaic GPU kernels
    at the E8 headline (131k tokens, forward and train step) and the E64 decoder's train step,
    each in the file of the same case's bfloat16 row of the default impl (Mosaic GPU, sorted);
    the layer's config carries ``quantize``, its dense float32 reference does not."""
    cases = bench_moe.layer_cases("full")
    fp8 = [case for case in cases if case.quantize and case.impl == "mosaic"]
    assert {(case.experts, case.tokens, case.op) for case in fp8} == {
        (8, 131072, "forward"), (8, 131072, "train_step"), (64, 131072, "train_step")}
    ids = {case.id for case in cases}
    for case in fp8:
        assert (case.impl, case.dispatch, case.dtype) == ("mosaic", "sorted", "bfloat16")
        assert "-bf16-fp8-" in case.id and case.extra_info()["quantize"] == "fp8"
        assert case.id.replace("-fp8", "") in ids
        assert bench_moe.moe_config(case).quantize == "fp8"
        assert bench_moe.moe_config(case, dtype=None, routing="dense").quantize is None
    smoke = [case for case in bench_moe.layer_cases("smoke") if case.quantize]
    assert [(case.impl, case.op) for case in smoke] == [
        ("ragged_dot", "forward"), ("torch_grouped_mm", "forward")]
