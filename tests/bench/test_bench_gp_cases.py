"""The Gaussian-process suites' grids, pre-checks and rows (``bench_gp``), the data of the
known GP, and the fit's two endings: on a CPU, small n."""

import bench_gp
import numpy as np
import pytest
from bench_harness import Settings, State
from bench_rows import check_extra_info

H200_BYTES = 143_771_000_000


def make_state(device_bytes=None):
    settings = Settings(mode="full", suites=frozenset({"gp"}), budget_s=100.0, row_limit_s=10.0,
                        target_time_s=0.02, min_rounds=3, max_rounds=5, step_timeout_s=10.0)
    return State(settings, device_bytes=device_bytes)


def test_every_impl_at_every_size():
    cases = bench_gp.mll_cases("full")
    assert {(case.impl, case.n) for case in cases} == {
        (impl, n) for impl in bench_gp.MLL_IMPLS for n in (16384, 65536, 262144, 1048576)}
    assert {case.dim for case in cases} == {8} and {case.kernel for case in cases} == {"rbf"}
    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids))
    # size-major: every row of one n (sharing its data and reference) runs before the next n
    priorities = [case.priority for case in sorted(cases, key=lambda case: case.n)]
    assert priorities == sorted(priorities)
    tilax = [case for case in cases if case.impl == "tilax"]
    assert {(c.num_probes, c.tol, c.preconditioner_rank) for c in tilax} == {(16, 0.01, 400)}


def test_the_fit_is_at_a_million_points_in_its_own_suite():
    (fit,) = bench_gp.suite_cases("gp_fit", "full")
    assert (fit.n, fit.suite, fit.op) == (1048576, "gp_fit", "fit")
    info = fit.extra_info()
    assert info["generating"] == bench_gp.GENERATING and info["start"] == bench_gp.FIT_START
    assert "10%" in info["stopping_rule"]
    # a device call is at most 10 minutes: the fit stops itself before that
    assert fit.time_limit_s <= 500


@pytest.mark.parametrize("impl", bench_gp.DENSE_IMPLS)
def test_dense_rows_beyond_the_device_are_skipped_as_not_fitting(impl):
    state = make_state(H200_BYTES)
    for n, fits in ((16384, True), (65536, True), (262144, False), (1048576, False)):
        reason = bench_gp.GpCase(impl, n).precheck(state)
        if fits:  # attempted, where the peer is installed
            assert reason is None or reason.startswith("unavailable: tinygp"), (n, reason)
        else:
            assert reason.startswith("skipped: not attempted, does not fit"), (n, reason)


def test_matrix_free_rows_are_never_skipped_for_memory():
    state = make_state(H200_BYTES)
    assert bench_gp.GpCase("tilax", 1048576).precheck(state) is None


def test_a_large_keops_row_needs_a_smaller_one_to_predict_it():
    state = make_state(H200_BYTES)
    case = bench_gp.GpCase("gpytorch_keops", 262144)
    assert case.precheck(state).startswith("skipped: not attempted, no smaller size")
    state.last_call[case.scale_key()] = (bench_gp.GpCase("gpytorch_keops", 65536).work(), 2.0)
    reason = case.precheck(state)  # attempted where GPyTorch and KeOps are installed
    assert reason is None or reason.startswith("unavailable:"), reason


def test_row_contract():
    info = dict(bench_gp.GpCase("tilax", 64).extra_info(), compile_s=1.0, mll=-50.0,
                grad={"lengthscale": 1.0, "outputscale": 2.0, "noise": 3.0}, evals_per_s=2.0,
                cg_iterations=3)
    assert check_extra_info(info) == []
    assert "missing 'cg_iterations'" in check_extra_info(
        {k: v for k, v in info.items() if k != "cg_iterations"})
    skipped = dict(bench_gp.GpCase("tinygp", 1048576).extra_info(), compile_s=None,
                   error="skipped: not attempted, does not fit: ...")
    assert check_extra_info(skipped) == []
    fit = dict(bench_gp.FitCase(128).extra_info(), compile_s=1.0)
    assert check_extra_info(fit) == ["missing 'trajectory'"]
    ran = dict(fit, steps=2, fit_s=3.0, converged=False, final={}, trajectory=[{}, {}])
    assert check_extra_info(ran) == ["a measured fit row must have converged"]
    assert check_extra_info(dict(ran, error="stopped: ...")) == []


def test_known_gp_data_are_reproducible_with_the_stated_variance():
    x, y = bench_gp.known_gp_data(4096, 8, seed=3)
    x2, y2 = bench_gp.known_gp_data(4096, 8, seed=3)
    assert x.shape == (4096, 8) and y.shape == (4096,)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
    assert abs(float(np.var(np.asarray(x))) - 1) < 0.05
    # var(y) = outputscale + noise, up to the draw of one function
    expected = bench_gp.GENERATING["outputscale"] + bench_gp.GENERATING["noise"]
    assert abs(float(np.var(np.asarray(y))) / expected - 1) < 0.3


def test_the_fit_rule():
    near = {k: 1.09 * v for k, v in bench_gp.GENERATING.items()}
    assert bench_gp.within(near)
    assert not bench_gp.within(dict(near, noise=0.8 * bench_gp.GENERATING["noise"]))


class RecordingBenchmark:
    """``extra_info`` and ``pedantic`` as pytest-benchmark has them, keeping the rounds."""

    def __init__(self):
        self.extra_info, self.rounds = {}, []

    def pedantic(self, target, rounds=1, iterations=1, warmup_rounds=0):
        for _ in range(rounds * iterations):
            target()
        self.rounds.append(rounds)


def run_fit(case):
    from bench_harness import Runner

    benchmark = RecordingBenchmark()
    bench_gp.run_fit(Runner(benchmark, make_state()), case)
    info = benchmark.extra_info
    assert check_extra_info(info) == [], info
    return info


def test_a_fit_that_meets_the_rule_is_a_measured_row_with_its_time():
    # from the generating hyperparameters with small steps: within 10% after the first step
    start = tuple(bench_gp.GENERATING[k] for k in bench_gp.PARAM_NAMES)
    info = run_fit(bench_gp.FitCase(64, start=start, learning_rate=0.01,
                                    **bench_gp.SMOKE_SETTINGS))
    assert "error" not in info and info["converged"] is True and info["steps"] == 1
    assert info["child_times_s"] == [info["fit_s"]]  # the row's one round: the fit's time
    assert bench_gp.within(info["final"])


def test_a_fit_stopped_short_is_a_failed_row_that_keeps_its_steps():
    case = bench_gp.FitCase(64, max_steps=2, **bench_gp.SMOKE_SETTINGS)
    info = run_fit(case)
    assert info["error"].startswith("stopped: the hyperparameters were not within 10%")
    assert info["steps"] == 2 and info["converged"] is False
    assert [step["step"] for step in info["trajectory"]] == [1, 2]
    # Adam moves every log-hyperparameter by about the learning rate on its first step
    first = info["trajectory"][0]
    for name in bench_gp.PARAM_NAMES:
        step = abs(np.log(first[name] / bench_gp.FIT_START[name]))
        assert step == pytest.approx(case.learning_rate, rel=0.05)


def test_the_rank_sweep_varies_the_rank_alone():
    cases = bench_gp.rank_cases("full")
    assert {(case.n, case.preconditioner_rank) for case in cases} == {
        (n, rank) for n in (65536, 262144) for rank in bench_gp.RANK_SWEEP}
    assert {(case.impl, case.suite, case.tol, case.num_probes) for case in cases} == {
        ("tilax", "gp_rank", 0.01, 16)}
    assert len({case.id for case in cases}) == len(cases)
    info = dict(cases[0].extra_info(), compile_s=1.0, mll=-1.0, evals_per_s=1.0,
                cg_iterations=9, grad=dict.fromkeys(bench_gp.PARAM_NAMES, 0.5))
    assert check_extra_info(info) == [] and info["suite"] == "gp_rank"
