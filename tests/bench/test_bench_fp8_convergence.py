"""FP8 convergence evidence (suite ``fp8_convergence``, ``bench_fp8_convergence``): the rows
when asked for by name, and a CPU smoke run of both trainings at the smoke sizes."""

import math

import bench_fp8_convergence
import pytest
from bench_rows import check_extra_info

from tilax.moe import api


@pytest.mark.bench_suite("fp8_convergence")
def test_fp8_convergence(bench, case):
    bench.run(case)


def test_both_runs_share_seeds_and_data_learn_and_store_their_curves():
    cases = bench_fp8_convergence.suite_cases("fp8_convergence", "smoke")
    assert [case.quantize for case in cases] == [None, "fp8"]
    runs = [bench_fp8_convergence.train(case) for case in cases]
    case = cases[0]
    for run in runs:
        curve = run["loss_curve"]
        steps = [point[0] for point in curve]
        assert steps == list(range(case.log_every, case.steps + 1, case.log_every))
        assert all(math.isfinite(value) for point in curve for value in point)
        # it learns: the loss falls by a tenth of its distance to the floor
        first, last = curve[0][1], run["final_loss"]
        assert last < first - 0.1 * (first - run["final_floor"]), curve
    bf16, fp8 = runs
    # identical data: the teacher's floor is the same float32 number at every point
    assert [p[2] for p in bf16["loss_curve"]] == [p[2] for p in fp8["loss_curve"]]
    # identical initial weights: the first losses differ by the quantisation only, and the
    # two runs stay apart (the quantisation happens)
    assert abs(fp8["loss_curve"][0][1] - bf16["loss_curve"][0][1]) < 0.02 * bf16["loss_curve"][0][1]
    assert fp8["final_loss"] != bf16["final_loss"]
    for case, run in zip(cases, runs, strict=True):
        info = case.extra_info() | {"compile_s": 1.0, "tflops": 1.0}
        info |= {key: run[key] for key in ("loss_curve", "final_loss", "final_floor")}
        assert check_extra_info(info) == []
        assert info["quantize"] == case.quantize
        assert info["impl"] == api.resolve_impl(case.config())  # what impl="auto" runs


def test_a_row_without_its_curve_breaks_the_contract():
    case = bench_fp8_convergence.suite_cases("fp8_convergence", "smoke")[1]
    info = case.extra_info() | {"compile_s": 1.0, "tflops": 1.0}
    assert "missing 'loss_curve'" in check_extra_info(info)
