"""The timing harness on fake cases and a fake ``benchmark`` (no JAX, no rows written): skips,
failures, rates, the ladder's jumps and bisection, and the budget split. The real
pytest-benchmark fixture is exercised by the smoke rows themselves (see
test_bench_contract.py).
"""

import math
import statistics
import time
from types import SimpleNamespace

import pytest
from bench_harness import BudgetPlan, Runner, Settings, State, split_budget
from bench_ladder import ladder_outcome, search_ladder


class FakeBenchmark:
    """``pedantic`` and ``extra_info`` as pytest-benchmark has them, without a results row."""

    def __init__(self):
        self.extra_info, self.stats = {}, None

    def pedantic(self, target, rounds=1, iterations=1, warmup_rounds=0):
        data = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(iterations):
                target()
            data.append((time.perf_counter() - start) / iterations)
        self.stats = SimpleNamespace(stats=SimpleNamespace(
            median=statistics.median(data), rounds=rounds, iterations=iterations, min=min(data)))


@pytest.fixture
def fake_benchmark():
    return FakeBenchmark()


class FakeWorkload:
    """Calls of ``seconds`` each; each wait costs ``wait_s`` more (the host's latency)."""

    def __init__(self, seconds=0.0, error=None, wait_s=0.0):
        self.seconds, self.error, self.calls, self.waits = seconds, error, 0, []
        self.wait_s = wait_s

    def start(self):
        self.calls += 1
        if self.error and self.calls >= self.error[0]:
            raise self.error[1]
        time.sleep(self.seconds)
        return self.calls

    def finish(self, pending):
        self.waits.append(pending)
        time.sleep(self.wait_s)
        return pending

    def call(self):
        return self.finish(self.start())

    def inspect(self, out):
        return {"first_output": out}

    def close(self):
        pass


class FakeCase:
    def __init__(self, work=1.0, workload=None, reason=None, suite="layer"):
        self._work, self.workload, self.reason = work, workload or FakeWorkload(), reason
        self.suite = suite

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


def test_measured_row(fake_benchmark):
    workload = FakeWorkload(seconds=0.002)
    Runner(fake_benchmark, make_state()).run(FakeCase(work=1e9, workload=workload))
    info = fake_benchmark.extra_info
    assert "error" not in info
    assert info["compile_s"] >= 0.002 and info["first_output"] == 1
    stats = fake_benchmark.stats.stats
    assert 3 <= stats.rounds <= 5 and stats.median >= 0.002
    assert info["tflops"] == pytest.approx(1e9 / stats.median / 1e12)
    # compile call, warm-up call, two probes of queued calls (as many as 50 ms holds at the
    # warm-up call's time, then at the first probe's), then rounds of calls queued back to
    # back (50 ms of 2 ms calls), waiting once per round
    queued = stats.iterations
    # (a loaded machine sleeps longer than asked: the counts follow the calls it timed)
    assert info["sync_call_s"] >= 0.002
    first, second = info["probe_calls"]
    assert first == min(50, math.ceil(0.05 / info["sync_call_s"]))
    assert queued > 1 and info["queued_call_s"] >= 0.002
    assert workload.calls == 2 + first + second + stats.rounds * queued
    assert workload.waits[2:] == [2 + first, *(2 + first + second + queued * r
                                               for r in range(stats.rounds + 1))]


def test_rounds_are_sized_by_queued_calls_not_by_one_waited_call(fake_benchmark):
    # A wait of 8 ms after 2 ms of work: sized by that one call, a round of 50 ms would hold
    # 5 calls; sized by the probe's queued calls (5 calls and one wait, 3.6 ms a call), 14.
    workload = FakeWorkload(seconds=0.002, wait_s=0.008)
    Runner(fake_benchmark, make_state()).run(FakeCase(work=1e9, workload=workload))
    info = fake_benchmark.extra_info
    assert info["sync_call_s"] >= 0.010
    assert fake_benchmark.stats.stats.iterations > math.ceil(0.05 / info["sync_call_s"])


class WarmingWorkload(FakeWorkload):
    """Calls four times slower until the ``fast_after``-th (a device leaving idle clocks)."""

    def __init__(self, seconds, fast_after):
        super().__init__(seconds=seconds)
        self.fast_after = fast_after

    def start(self):
        pending = super().start()
        if self.calls <= self.fast_after:
            time.sleep(3 * self.seconds)
        return pending


def test_rounds_follow_the_faster_probe(fake_benchmark):
    # Slow through the warm-up call and the first probe (8 ms a call: 7 calls probed), then
    # 2 ms: the second probe (a round's worth at the first probe's time, 7 calls) is the
    # faster, and its time sizes the rounds (about 25 calls of 2 ms, not 7).
    workload = WarmingWorkload(seconds=0.002, fast_after=9)
    Runner(fake_benchmark, make_state()).run(FakeCase(work=1e9, workload=workload))
    info = fake_benchmark.extra_info
    first, second = info["probe_calls"]
    assert first == min(50, math.ceil(0.05 / info["sync_call_s"]))
    # relative, not in milliseconds: a loaded machine stretches every sleep
    assert info["queued_call_s"] < info["sync_call_s"]
    assert fake_benchmark.stats.stats.iterations > first


def test_calls_of_a_round_or_more_are_not_probed(fake_benchmark):
    workload = FakeWorkload(seconds=0.06)
    Runner(fake_benchmark, make_state()).run(FakeCase(work=1e9, workload=workload))
    stats = fake_benchmark.stats.stats
    assert stats.iterations == 1
    assert workload.calls == 2 + stats.rounds


def test_budget_spent_makes_a_skipped_row(fake_benchmark):
    case = FakeCase()
    Runner(fake_benchmark, make_state(budget_s=0.0)).run(case)
    assert fake_benchmark.extra_info["error"].startswith("skipped: not attempted, the run's time")
    assert case.workload.calls == 0 and fake_benchmark.extra_info["compile_s"] is None


def test_time_predicted_from_the_previous_size_skips(fake_benchmark):
    state = make_state()
    state.last_call[("fake",)] = (1.0, 1.0)  # 1 s per call at work 1
    Runner(fake_benchmark, state).run(FakeCase(work=4.0))
    assert "exceeds the 10 s per-row limit" in fake_benchmark.extra_info["error"]


def test_a_size_without_a_work_measure_predicts_nothing(fake_benchmark):
    state = make_state()
    state.last_call[("fake",)] = (0.0, 1.0)  # a data-movement piece: no flops to scale by
    case = FakeCase(work=0.0)
    Runner(fake_benchmark, state).run(case)
    assert fake_benchmark.extra_info.get("error") is None
    assert case.workload.calls > 0


def test_a_smaller_size_out_of_memory_skips(fake_benchmark):
    state = make_state()
    state.failed[("fake",)] = (2.0, "work=2.0", "RESOURCE_EXHAUSTED: Out of memory")
    Runner(fake_benchmark, state).run(FakeCase(work=4.0))
    assert "already failed with: RESOURCE_EXHAUSTED" in fake_benchmark.extra_info["error"]


def test_case_precheck_reason_is_the_error(fake_benchmark):
    Runner(fake_benchmark, make_state()).run(FakeCase(reason="unavailable: no such peer"))
    assert fake_benchmark.extra_info["error"] == "unavailable: no such peer"


@pytest.mark.parametrize("failing_call", [1, 2, 4])
def test_exceptions_become_failure_rows(fake_benchmark, failing_call):
    state = make_state()
    oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9 GiB")
    Runner(fake_benchmark, state).run(FakeCase(workload=FakeWorkload(error=(failing_call, oom))))
    assert fake_benchmark.extra_info["error"].startswith("RuntimeError: RESOURCE_EXHAUSTED")
    assert ("fake",) in state.failed  # larger sizes of this config will not be attempted
    assert (fake_benchmark.extra_info["compile_s"] is None) == (failing_call == 1)


def test_a_bare_assert_says_where_it_failed(tmp_path):
    from bench_harness import describe_error

    page = tmp_path / "guides" / "page.md"
    page.parent.mkdir()
    page.write_text("# prose\n\nrel = 0.5\nassert rel < 1e-2\n")
    try:
        exec(compile(page.read_text(), str(page), "exec"), {})
    except AssertionError as exc:
        error = describe_error(exc)
    assert error == "AssertionError: raised at guides/page.md:4: assert rel < 1e-2"
    assert describe_error(ValueError("bad n")) == "ValueError: bad n"


def test_a_size_predicted_past_the_step_limit_is_tried_while_the_budget_lasts():
    from bench_ladder import too_slow_to_try

    # 60 s step limit: a size predicted at 90 s is tried (its timeout brackets the limit)
    assert not too_slow_to_try(predicted_s=90.0, left_s=60.0, step_limit_s=60.0)
    # the ladder's share of the budget has 30 s left: the same size is refused
    assert too_slow_to_try(predicted_s=90.0, left_s=30.0, step_limit_s=60.0)
    assert not too_slow_to_try(predicted_s=20.0, left_s=30.0, step_limit_s=60.0)


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


SIZES = [2**k for k in range(10, 18)]  # 1024 .. 131072


def fake_step(limit, attempted):
    """A ladder step that fits up to ``limit`` and runs out of memory above it."""

    def attempt(size):
        attempted.append(size)
        if size > limit:
            return {"ok": False, "error": "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory"}
        return {"ok": True, "times": [0.1]}

    return attempt


def never_refuse(size, last):
    return None


@pytest.mark.parametrize("jump", [None, 2**16, 2**17])
@pytest.mark.parametrize("limit", [2**10, 2**13, 2**16])
def test_ladder_bisects_after_a_failed_jump(jump, limit):
    attempted = []
    probes = search_ladder(SIZES, fake_step(limit, attempted), lambda last: jump, never_refuse)
    assert [p["size"] for p in probes] == attempted
    assert len(set(attempted)) == len(attempted)  # no size twice
    outcome = ladder_outcome(SIZES, probes)
    assert outcome["best"]["size"] == limit
    assert outcome["limit_bracket"] == [limit, 2 * limit]
    assert outcome["limit_kind"] == "out of memory" and not outcome["max_is_lower_bound"]
    assert "RESOURCE_EXHAUSTED" in outcome["stopped_by"]


def test_ladder_probes_the_h200_case_in_order():
    # 2**10 ran, the jump to 2**16 ran out of memory, the limit is 2**13: bisect 2**13, 2**14
    attempted = []
    jumps = {2**10: 2**16}
    probes = search_ladder(SIZES, fake_step(2**13, attempted),
                           lambda last: jumps.get(last["size"]), never_refuse)
    assert attempted == [2**10, 2**16, 2**13, 2**14]
    assert [p["ok"] for p in probes] == [True, False, True, False]
    # without a jump it climbs one size at a time
    attempted = []
    search_ladder(SIZES, fake_step(2**12, attempted), lambda last: None, never_refuse)
    assert attempted == [2**10, 2**11, 2**12, 2**13]


def test_ladder_that_never_fails_reaches_its_end():
    attempted = []
    probes = search_ladder(SIZES, fake_step(2**20, attempted), lambda last: None, never_refuse)
    outcome = ladder_outcome(SIZES, probes)
    assert attempted == SIZES and outcome["best"]["size"] == SIZES[-1]
    assert outcome["limit_bracket"] is None and outcome["max_is_lower_bound"]
    assert outcome["limit_kind"] == "end of ladder"


def test_ladder_stopped_by_time_or_budget_is_a_lower_bound():
    # sizes from 2**14 up are predicted too slow: bisect below them, then stop
    attempted = []

    def too_slow(size, last):
        return ("time", "skipped: not attempted, timeout predicted") if size >= 2**14 else None

    probes = search_ladder(SIZES, fake_step(2**16, attempted), lambda last: 2**16, too_slow)
    outcome = ladder_outcome(SIZES, probes)
    assert attempted == [2**10, 2**13]
    assert [p["size"] for p in probes] == [2**10, 2**16, 2**13, 2**14]
    assert outcome["best"]["size"] == 2**13 and outcome["max_is_lower_bound"]
    assert outcome["limit_bracket"] is None and outcome["limit_kind"] == "time (predicted)"

    # the budget ends after the jump ran out of memory: 2**10 ran, nothing is bracketed
    attempted = []

    def budget_after_two(size, last):
        return ("budget", "skipped: not attempted, budget") if len(attempted) >= 2 else None

    probes = search_ladder(SIZES, fake_step(2**13, attempted), lambda last: 2**16,
                           budget_after_two)
    outcome = ladder_outcome(SIZES, probes)
    assert attempted == [2**10, 2**16] and probes[-1]["kind"] == "budget"
    assert outcome["best"]["size"] == 2**10 and outcome["max_is_lower_bound"]
    assert outcome["limit_kind"] == "budget" and outcome["stopped_by"].startswith("skipped")


def test_ladder_whose_first_size_fails_has_no_summary_size():
    attempted = []
    probes = search_ladder(SIZES, fake_step(2**9, attempted), lambda last: None, never_refuse)
    assert attempted == [2**10]
    outcome = ladder_outcome(SIZES, probes)
    assert outcome["best"] is None and outcome["error"].startswith("no size ran: JaxRuntime")


def test_a_summary_of_no_size_names_the_size_that_failed(fake_benchmark):
    from bench_ladder import LadderStep, summarize
    from bench_moe import MoECase

    case = MoECase(suite="maxtok", impl="ragged_dot", dispatch="sorted", routing="dropless",
                   dtype="bfloat16", op="train_step", tokens=2**24, d_model=512, d_hidden=1024,
                   experts=8, top_k=2)  # the summary step's case: the ladder's largest size
    step = LadderStep("maxtok-x", case, "tokens", (2**17, 2**18, 2**24), summary=True)
    probes = [{"size": 2**17, "ok": False, "attempted": True,
               "error": "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory"}]
    runner = SimpleNamespace(benchmark=fake_benchmark, info=fake_benchmark.extra_info)
    runner.info.update(case.extra_info())
    summarize(runner, step, probes)
    info = fake_benchmark.extra_info
    assert info["error"].startswith("no size ran: JaxRuntimeError")
    assert info["tokens"] == 2**17 and info["suite"] == "maxtok_summary"


def test_budget_split_keeps_time_for_every_suite():
    plan = BudgetPlan(shares=split_budget(400.0, {"maxtok": 3.0, "layer": 4.0, "decoder": 1.0}),
                      rows_left={"maxtok": 2, "layer": 10, "decoder": 5})
    assert plan.shares == {"maxtok": 150.0, "layer": 200.0, "decoder": 50.0}
    assert plan.available("maxtok", 400.0) == 150.0
    plan.finished("maxtok", 140.0)  # a long ladder
    assert plan.available("maxtok", 260.0) == 10.0
    plan.finished("maxtok", 10.0)  # the suite's last row: its share is no longer reserved
    assert plan.rows_left["maxtok"] == 0
    assert plan.available("layer", 250.0) == 200.0  # the decoder's 50 s stay reserved
    assert plan.available("decoder", 250.0) == 50.0
    plan.finished("layer", 230.0)  # layer over its share, using slack nobody was owed
    assert plan.available("decoder", 20.0) == 20.0
    assert plan.available("layer", 20.0) == -30.0  # the decoder is still owed 50 s
    # a ladder's even part of its suite's time, among the ladders not yet searched
    plan.ladders_left["maxtok"] = {"a", "b", "c"}
    assert plan.ladder_allowance("maxtok", "a", 90.0) == 30.0
    assert plan.ladder_allowance("maxtok", "b", 60.0) == 30.0


def test_a_suite_out_of_time_skips_while_others_run(fake_benchmark):
    state = make_state(budget_s=100.0)
    state.budget = BudgetPlan(shares={"layer": 50.0, "decoder": 50.0},
                              spent={"layer": 60.0}, rows_left={"layer": 5, "decoder": 5})
    state.settings.started -= 60.0  # the layer rows took 60 s: 40 s left, 50 s owed to decoder
    Runner(fake_benchmark, state).run(FakeCase(suite="layer"))
    assert fake_benchmark.extra_info["error"].startswith("skipped: not attempted, the run's time")
    other = FakeBenchmark()
    Runner(other, state).run(FakeCase(suite="decoder"))
    assert "error" not in other.extra_info


class LimitedCase(FakeCase):
    """A case with a per-row limit of its own (as the launch sweep's rows have)."""

    def __init__(self, row_limit_s, **kwargs):
        super().__init__(**kwargs)
        self.row_limit_s = row_limit_s


def test_a_case_limit_caps_its_timed_rounds(fake_benchmark):
    # 20 ms calls, 70 ms allowed: the first two calls take 40 ms, one round of one call fits
    # (not the three calls a round would queue without the limit)
    workload = FakeWorkload(seconds=0.02)
    Runner(fake_benchmark, make_state(target_time_s=1.0)).run(
        LimitedCase(0.07, work=1e9, workload=workload))
    assert "error" not in fake_benchmark.extra_info
    stats = fake_benchmark.stats.stats
    assert (stats.rounds, stats.iterations) == (1, 1) and workload.calls == 3
    # a fast call keeps its planned rounds (a 5 s limit: room for them even when a loaded
    # machine stretches each 2 ms sleep many times over); a case without a limit of its own is
    # not capped by the session's
    for case, row_limit_s in ((LimitedCase(10.0, workload=FakeWorkload(0.002)), 5.0),
                              (FakeCase(workload=FakeWorkload(0.02)), 0.5)):
        benchmark = FakeBenchmark()
        Runner(benchmark, make_state(target_time_s=1.0, row_limit_s=row_limit_s)).run(case)
        assert benchmark.stats.stats.rounds == 5


def test_a_case_limit_below_the_session_limit_applies_to_predictions(fake_benchmark):
    state = make_state()
    state.last_call[("fake",)] = (1.0, 0.5)  # 0.5 s per call: 2.5 s for 5 calls, under 10 s
    Runner(fake_benchmark, state).run(LimitedCase(2.0, work=1.0))
    assert "exceeds the 2 s per-row limit" in fake_benchmark.extra_info["error"]
