"""The timing harness on fake cases (no JAX): skips, failures, rates and replayed timings.

Marked ``bench_contract``: they run in smoke mode only, so their rows never enter a GPU run.
"""

import time

import pytest
from bench_harness import Runner, Settings, State, record_external_timings

pytestmark = pytest.mark.bench_contract


class FakeWorkload:
    def __init__(self, seconds=0.0, error=None):
        self.seconds, self.error, self.calls = seconds, error, 0

    def call(self):
        self.calls += 1
        if self.error and self.calls >= self.error[0]:
            raise self.error[1]
        time.sleep(self.seconds)
        return self.calls

    def inspect(self, out):
        return {"first_output": out}

    def close(self):
        pass


class FakeCase:
    def __init__(self, work=1.0, workload=None, reason=None):
        self._work, self.workload, self.reason = work, workload or FakeWorkload(), reason

    def extra_info(self):
        return {"family": "moe", "suite": "layer", "impl": "pallas"}

    def scale_key(self):
        return ("fake",)

    def size_label(self):
        return f"work={self._work}"

    def work(self):
        return self._work

    def rates(self, median):
        return {"tflops": self._work / median / 1e12}

    def precheck(self, state):
        return self.reason

    def build(self, state):
        return self.workload


def make_state(**overrides):
    values = dict(mode="full", suites=frozenset(), budget_s=100.0, row_limit_s=10.0,
                  target_time_s=0.02, min_rounds=3, max_rounds=5, step_timeout_s=10.0)
    values.update(overrides)
    return State(Settings(**values))


def test_measured_row(benchmark):
    workload = FakeWorkload(seconds=0.002)
    Runner(benchmark, make_state()).run(FakeCase(work=1e9, workload=workload))
    info = benchmark.extra_info
    assert "error" not in info
    assert info["compile_s"] >= 0.002 and info["first_output"] == 1
    stats = benchmark.stats.stats
    assert 3 <= stats.rounds <= 5 and stats.median >= 0.002
    assert info["tflops"] == pytest.approx(1e9 / stats.median / 1e12)
    assert workload.calls == 2 + stats.rounds  # compile call, warm-up call, timed rounds


def test_budget_spent_makes_a_skipped_row(benchmark):
    case = FakeCase()
    Runner(benchmark, make_state(budget_s=0.0)).run(case)
    assert benchmark.extra_info["error"].startswith("skipped: not attempted, the run's time")
    assert case.workload.calls == 0 and benchmark.extra_info["compile_s"] is None


def test_time_predicted_from_the_previous_size_skips(benchmark):
    state = make_state()
    state.last_call[("fake",)] = (1.0, 1.0)  # 1 s per call at work 1
    Runner(benchmark, state).run(FakeCase(work=4.0))
    assert "exceeds the 10 s per-row limit" in benchmark.extra_info["error"]


def test_a_smaller_size_out_of_memory_skips(benchmark):
    state = make_state()
    state.failed[("fake",)] = (2.0, "work=2.0", "RESOURCE_EXHAUSTED: Out of memory")
    Runner(benchmark, state).run(FakeCase(work=4.0))
    assert "already failed with: RESOURCE_EXHAUSTED" in benchmark.extra_info["error"]


def test_case_precheck_reason_is_the_error(benchmark):
    Runner(benchmark, make_state()).run(FakeCase(reason="unavailable: no such peer"))
    assert benchmark.extra_info["error"] == "unavailable: no such peer"


@pytest.mark.parametrize("failing_call", [1, 2, 4])
def test_exceptions_become_failure_rows(benchmark, failing_call):
    state = make_state()
    oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9 GiB")
    Runner(benchmark, state).run(FakeCase(workload=FakeWorkload(error=(failing_call, oom))))
    assert benchmark.extra_info["error"].startswith("RuntimeError: RESOURCE_EXHAUSTED")
    assert ("fake",) in state.failed  # larger sizes of this config will not be attempted
    assert (benchmark.extra_info["compile_s"] is None) == (failing_call == 1)


def test_external_timings_are_the_rows_rounds(benchmark):
    record_external_timings(benchmark, [0.5, 0.1, 0.3])
    stats = benchmark.stats.stats
    assert stats.rounds == 3
    assert stats.median == pytest.approx(0.3) and stats.min == pytest.approx(0.1)


def test_ladder_jumps_to_the_largest_size_predicted_to_fit():
    from bench_ladder import LadderStep, _jump_target
    from bench_moe import MoECase

    case = MoECase(suite="maxtok", impl="pallas", dispatch="sorted", routing="dropless",
                   dtype="bfloat16", op="train_step", tokens=2**18, d_model=512, d_hidden=1024,
                   experts=8, top_k=2)
    sizes = (2**18, 2**20, 2**21, 2**22, 2**23, 2**24)
    step = LadderStep("maxtok-x", case, "tokens", sizes)
    gib = 2**30
    last = {"size": 2**18, "work": case.work(), "times": [0.03, 0.03], "wall_s": 8.0,
            "peak_bytes": 3 * gib, "limit_bytes": 126 * gib}
    assert _jump_target(step, last, timeout=60.0, calls=3) == 2**23  # 42x the size fits
    assert _jump_target(step, last, timeout=9.0, calls=3) == 2**21  # 8.6 s fits, 16x: 9.4 s
    assert _jump_target(step, dict(last, peak_bytes=None), timeout=60.0, calls=3) is None
    assert _jump_target(step, dict(last, peak_bytes=100 * gib), 60.0, 3) is None
