"""Timing harness shared by the MoE and RBF benchmarks.

One benchmark row is one *case* (a frozen dataclass from ``bench_moe``/``bench_rbf``) run by
:class:`Runner`:

1. pre-checks that decide, without running anything, that a row cannot run: the run's time
   budget is spent, a smaller size of the same config already ran out of memory, the time per
   call predicted from the previous size exceeds the per-row limit, or the case's own memory
   estimate exceeds the device (``"skipped: ..."`` rows, never attempted); a case may carry a
   per-row limit of its own (``row_limit_s``, the lower of it and the session's applies);
2. ``case.build(state)`` makes a *workload* (jitted function + inputs; peers that cannot be
   imported raise :class:`Unavailable`);
3. the first call, compile included, is timed alone (``compile_s``) and its output checked
   (numerics, router statistics); a second call is a warm-up that sizes the rounds (for a case
   with a ``row_limit_s`` of its own, no more rounds than fit its limit after the two untimed
   calls, compile aside, and at least one: a launch that turns out ten times slower than its
   neighbours is timed briefly instead of eating the run);
4. ``benchmark.pedantic`` times ``rounds`` rounds of ``iterations`` calls queued back to back,
   as a training loop issues them, the last call of each round ending in ``block_until_ready``
   (or ``torch.cuda.synchronize``), no warm-up rounds (done above). A round holds about
   ``QUEUED_S`` of calls, so the host's latency of one call and its wait (stored apart as
   ``sync_call_s``, the warm-up call) is not counted once per call; the rounds are sized by
   the faster of two probes of queued calls (``queued_call_s``, stored with the numbers of
   calls probed, ``probe_calls``): as many calls as that one call's time puts in a round, then
   as many as the first probe's time does;
5. TFLOP/s or pairs/s are derived from the case's counted work and the median.

Any exception becomes a failure row: ``extra_info["error"]`` holds the exception type and
message and a no-op is timed once so pytest-benchmark still writes the row (its stats must be
ignored). Ladder steps (peak memory, largest problem) run in a fresh subprocess each, see
``bench_ladder``; their timings are measured in the child and replayed into the fixture.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_power

#: Queued device time aimed at per timed round: the fixed host latency of dispatching a call and
#: waiting for it (a few tenths of a millisecond on the H200 host) then adds about 1% a call.
QUEUED_S = 0.05
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OutOfMemoryError")
MAX_ERROR_CHARS = 2000


def queued_call_s(workload, calls: int) -> float:
    """One call's time when calls are queued: ``calls`` calls back to back, waited for once
    (a probe, untimed by pytest-benchmark). The one-call time just after compilation ran 1.5 to
    6 times the queued time on the H200 host (2.6 to 9.7 ms for calls of 1.6 ms), so rounds
    sized by it held a fraction of ``QUEUED_S``, and each call carried that much more of its
    round's fixed latency."""
    start = time.perf_counter()
    pending = None
    for _ in range(calls):
        pending = workload.start()
    workload.finish(pending)
    return (time.perf_counter() - start) / calls


class Unavailable(Exception):
    """A peer library or backend that cannot run here; the row's error says why."""


def describe_error(exc: BaseException) -> str:
    """``"Type: message"``, trimmed to a size a results file can carry. An exception with no
    message (a bare ``assert``) says where it was raised instead: ``file:line: source``."""
    message = str(exc).strip() or _raised_at(exc)
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    if isinstance(exc, Unavailable):
        text = message
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 20] + " ... [truncated]"
    return text


def _raised_at(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    where = "/".join(Path(frame.filename).parts[-2:])  # e.g. guides/kernel-sums.md
    return f"raised at {where}:{frame.lineno}: {frame.line or ''}".rstrip(": ")


def is_out_of_memory(error: str) -> bool:
    return any(marker in error for marker in OOM_MARKERS)


@dataclasses.dataclass
class Settings:
    """How hard to run: chosen once per session by conftest (mode, suites, budget)."""

    mode: str  # "smoke" (CPU, tiny), "quick" or "full"
    suites: frozenset[str]
    budget_s: float  # wall-clock budget of the whole session
    row_limit_s: float  # most time one in-process row may take (predicted)
    target_time_s: float  # timed time aimed at per row
    min_rounds: int
    max_rounds: int
    step_timeout_s: float  # time limit of one ladder subprocess
    started: float = dataclasses.field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()


class LRU:
    """A tiny least-recently-used cache: inputs and references are shared by consecutive rows
    of one shape (cases are ordered shape-major) without keeping every shape alive."""

    def __init__(self, size: int = 1):
        self.size = size
        self.items: OrderedDict[Any, Any] = OrderedDict()

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        while len(self.items) >= self.size:
            self.items.popitem(last=False)
            gc.collect()
        value = make()
        self.items[key] = value
        return value

    def clear(self) -> None:
        self.items.clear()


@dataclasses.dataclass
class BudgetPlan:
    """Each suite's share of the session's budget, so one suite cannot starve the others.

    A suite is *owed* its share minus what its rows have used until its last row has run. A row
    of suite ``s`` may start while the session's remaining time, less what the other suites
    are still owed, is positive: a suite runs on its own share plus any time nobody else is
    owed (shares of finished suites, time they did not use), whatever the order of the rows.
    Without shares (unit tests, a single suite) it is the session's remaining time.
    """

    shares: dict = dataclasses.field(default_factory=dict)  # suite -> seconds
    spent: dict = dataclasses.field(default_factory=dict)  # suite -> seconds used
    rows_left: dict = dataclasses.field(default_factory=dict)  # suite -> rows not yet run
    ladders_left: dict = dataclasses.field(default_factory=dict)  # suite -> ladder names

    def owed(self, suite: str) -> float:
        if self.rows_left.get(suite, 0) <= 0:
            return 0.0
        return max(0.0, self.shares.get(suite, 0.0) - self.spent.get(suite, 0.0))

    def available(self, suite: str | None, remaining: float) -> float:
        """Seconds a row of ``suite`` may still use, given the session's ``remaining``."""
        others = sum(self.owed(name) for name in self.shares if name != suite)
        return remaining - others

    def finished(self, suite: str | None, seconds: float) -> None:
        """One row of ``suite`` ended after ``seconds``."""
        if suite is None:
            return
        self.spent[suite] = self.spent.get(suite, 0.0) + seconds
        self.rows_left[suite] = self.rows_left.get(suite, 1) - 1

    def ladder_allowance(self, suite: str, ladder: str, available: float) -> float:
        """A ladder's even part of what its suite may use, among its suite's ladders not yet
        searched (``ladder`` included); called once per ladder, when its search starts."""
        left = self.ladders_left.setdefault(suite, set())
        count = max(1, len(left | {ladder}))
        left.discard(ladder)
        return available / count


def split_budget(budget_s: float, weights: dict[str, float]) -> dict[str, float]:
    """Seconds per suite in proportion to ``weights``."""
    total = sum(weights.values())
    return {suite: budget_s * weight / total for suite, weight in weights.items()} if total else {}


def suite_of(case) -> str | None:
    """The suite a parametrized case (or ladder step) belongs to."""
    inner = getattr(case, "case", case)
    return getattr(inner, "suite", None)


@dataclasses.dataclass
class State:
    """What the rows of one session learn from each other."""

    settings: Settings
    device_bytes: int | None = None
    # scale key -> (work, seconds per call) of the last size that ran
    last_call: dict = dataclasses.field(default_factory=dict)
    # scale key -> (work, size label, error) of a size that ran out of memory
    failed: dict = dataclasses.field(default_factory=dict)
    # ladder key -> list of finished steps (dicts)
    ladders: dict = dataclasses.field(default_factory=dict)
    inputs: LRU = dataclasses.field(default_factory=lambda: LRU(1))
    references: LRU = dataclasses.field(default_factory=lambda: LRU(1))
    probes: dict = dataclasses.field(default_factory=dict)
    budget: BudgetPlan = dataclasses.field(default_factory=BudgetPlan)

    def available(self, suite: str | None) -> float:
        """Seconds a row of ``suite`` may still use (see :class:`BudgetPlan`)."""
        return self.budget.available(suite, self.settings.remaining())


def jax_device_memory() -> tuple[int | None, int | None]:
    """(peak_bytes_in_use, bytes_limit) of the first JAX device; ``None`` where unknown (CPU)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use"), stats.get("bytes_limit")


class JaxWorkload:
    """A jitted function and its arguments. ``start`` dispatches one call and returns its
    outputs without waiting; ``finish`` waits for them; ``call`` does both."""

    def __init__(self, fn, args, inspect=None):
        self.fn = fn
        self.args = args
        self._inspect = inspect

    def start(self):
        return self.fn(*self.args)

    def finish(self, pending):
        import jax

        return jax.block_until_ready(pending)

    def call(self):
        return self.finish(self.start())

    def inspect(self, out) -> dict:
        return self._inspect(out) if self._inspect else {}

    def memory(self) -> tuple[int | None, int | None]:
        return jax_device_memory()

    def close(self) -> None:
        self.args = None


def torch_device_memory(torch) -> tuple[int | None, int | None]:
    """(max_memory_allocated, total memory) of torch's first CUDA device; ``None`` on a CPU."""
    if not torch.cuda.is_available():
        return None, None
    total = torch.cuda.get_device_properties(0).total_memory
    return int(torch.cuda.max_memory_allocated()), int(total)


def _no_op() -> None:
    return None


def record_failure(benchmark, error: str) -> None:
    """Make a failure row: the error text plus the stats of one no-op call."""
    benchmark.extra_info["error"] = error
    benchmark.pedantic(_no_op, rounds=1, iterations=1, warmup_rounds=0)


def record_external_timings(benchmark, seconds: list[float]) -> None:
    """Store timings measured elsewhere (a ladder subprocess) as this row's rounds.

    The row itself is one no-op round here; its ``child_times_s`` carries the child's timings,
    and ``with_external_timings`` puts their statistics in the row's ``stats`` wherever the
    row is written (the side file, and the JSON through pytest-benchmark's documented
    ``pytest_benchmark_update_json`` hook), so the row's stats are the child's timings, not
    the parent's.
    """
    benchmark.extra_info["child_times_s"] = [float(s) for s in seconds]
    benchmark.pedantic(_no_op, rounds=1, iterations=1, warmup_rounds=0)


def with_external_timings(row: dict) -> dict:
    """``row`` (a benchmark of pytest-benchmark's JSON) with ``stats`` computed from its
    ``child_times_s`` where it has them (by pytest-benchmark's own ``Stats``); else unchanged."""
    seconds = row.get("extra_info", {}).get("child_times_s")
    if not seconds:
        return row
    from pytest_benchmark.stats import Stats

    stats = Stats()
    for duration in seconds:
        stats.update(duration)
    replayed = stats.as_dict()
    if "data" in row.get("stats", {}):
        replayed["data"] = list(seconds)
    replayed["iterations"] = 1
    return dict(row, stats=replayed)


def json_safe(value: Any) -> Any:
    """Plain Python numbers/containers for extra_info (no numpy or JAX scalars, no NaN)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if hasattr(value, "dtype") and "int" in str(value.dtype):
        return int(number)
    return number if math.isfinite(number) else None


class Runner:
    """Runs one case into one benchmark row (see the module docstring)."""

    def __init__(self, benchmark, state: State):
        self.benchmark = benchmark
        self.state = state
        self.settings = state.settings

    @property
    def info(self) -> dict:
        return self.benchmark.extra_info

    def fail(self, error: str) -> None:
        record_failure(self.benchmark, error)

    def row_limit(self, case) -> float:
        """The most this row may take: the session's per-row limit, or the case's own
        ``row_limit_s`` where that is lower."""
        own = getattr(case, "row_limit_s", None)
        return self.settings.row_limit_s if own is None else min(own, self.settings.row_limit_s)

    def precheck(self, case) -> str | None:
        """Why this row will not be attempted, or ``None``."""
        settings, state = self.settings, self.state
        row_limit = self.row_limit(case)
        available = state.available(suite_of(case))
        if available <= 0:
            return (f"skipped: not attempted, the run's time budget of {settings.budget_s:.0f} s "
                    f"was spent before this row (or what is left is owed to other suites)")
        key = case.scale_key()
        if key in state.failed:
            work, label, error = state.failed[key]
            if case.work() >= work:
                return (f"skipped: not attempted, a smaller or equal size of this config "
                        f"({label}) already failed with: {error[:300]}")
        work, seconds = state.last_call.get(key, (0.0, 0.0))
        # A row without a work measure (a piece that only moves data) cannot be scaled.
        if work > 0 and self.settings.mode != "smoke":
            predicted = seconds * case.work() / work
            calls = 2 + settings.min_rounds
            if predicted * calls > row_limit:
                return (f"skipped: not attempted, predicted {predicted:.3g} s per call (measured "
                        f"{seconds:.3g} s at {work:.3g} units of work, scaled to "
                        f"{case.work():.3g}) times {calls} calls exceeds the "
                        f"{row_limit:.0f} s per-row limit")
            if predicted * calls > available:
                return (f"skipped: not attempted, predicted {predicted * calls:.0f} s for this "
                        f"row exceeds the {available:.0f} s left of the run's budget to its "
                        f"suite")
        return case.precheck(state)

    def plan(self, seconds: float) -> tuple[int, int]:
        """(rounds, iterations) for a call of ``seconds``."""
        settings = self.settings
        if settings.mode == "smoke":
            return settings.max_rounds, 1
        iterations = max(1, min(50, math.ceil(QUEUED_S / max(seconds, 1e-7))))
        per_round = max(seconds * iterations, 1e-7)
        rounds = int(settings.target_time_s / per_round)
        return max(settings.min_rounds, min(settings.max_rounds, rounds)), iterations

    def sized_plan(self, case, seconds: float, warm_s: float) -> tuple[int, int]:
        """``plan`` for calls of ``seconds``, capped by the case's own row limit (if it has one)
        with calls of ``warm_s``, the first two calls' time."""
        rounds, iterations = self.plan(seconds)
        if getattr(case, "row_limit_s", None) is not None:
            rounds, iterations = self.capped_plan(case, rounds, iterations, warm_s)
        return rounds, iterations

    def capped_plan(self, case, rounds: int, iterations: int, seconds: float) -> tuple[int, int]:
        """(rounds, iterations) cut to what fits the row's limit after its first two calls
        (each about ``seconds`` when compile is set aside): fewer rounds, and fewer queued calls
        per round where even one round would not fit; at least one call."""
        left = self.row_limit(case) - 2 * seconds
        iterations = max(1, min(iterations, int(left / max(seconds, 1e-9))))
        fit = int(left / max(seconds * iterations, 1e-9))
        return max(1, min(rounds, fit)), iterations

    def run(self, case) -> None:
        if getattr(case, "ladder", None) is not None:
            import bench_ladder

            bench_ladder.run_step(self, case)
            return
        self.info.update(json_safe(case.extra_info()))
        self.info.setdefault("compile_s", None)
        reason = self.precheck(case)
        if reason is not None:
            self.fail(reason)
            return
        try:
            workload = case.build(self.state)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a row
            self.fail(describe_error(exc))
            return
        try:
            self._measure(case, workload)
        finally:
            workload.close()
            gc.collect()

    def _measure(self, case, workload) -> None:
        try:
            start = time.perf_counter()
            out = workload.call()
            self.info["compile_s"] = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001
            self._remember_failure(case, describe_error(exc))
            return
        try:
            self.info.update(json_safe(workload.inspect(out)))
        except Exception as exc:  # noqa: BLE001 - a broken check must not lose the timing
            self.info["numerics_error"] = describe_error(exc)
        del out
        # Started before the warm call: nvidia-smi takes a few tenths of a second to start.
        with bench_power.PowerSampler(bench_power.on_gpu()) as power:
            timed = self._time_rounds(case, workload, power)
        if timed:
            self.info.update(power.summary())

    def _time_rounds(self, case, workload, power) -> bool:
        """The warm call, the probes and the timed rounds; ``False`` where one failed (the
        row's error is set)."""
        try:
            start = time.perf_counter()
            workload.call()
            warm_s = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001
            self._remember_failure(case, describe_error(exc))
            return False
        self.info["sync_call_s"] = warm_s
        rounds, iterations = self.sized_plan(case, warm_s, warm_s)
        if iterations > 1:
            # Two probes, the second as long as the first says a round is; the faster sizes
            # the rounds: a process's first row can probe a device still coming out of idle
            # (on the H200 a round of 6 calls where other processes took 11 to 23, each call
            # then carrying more of its round's fixed latency).
            probes = [iterations]
            try:
                queued_s = queued_call_s(workload, iterations)
                probes.append(self.sized_plan(case, queued_s, warm_s)[1])
                queued_s = min(queued_s, queued_call_s(workload, probes[-1]))
            except Exception as exc:  # noqa: BLE001
                self._remember_failure(case, describe_error(exc))
                return False
            self.info["probe_calls"] = probes
            self.info["queued_call_s"] = queued_s
            rounds, iterations = self.sized_plan(case, queued_s, warm_s)
        errors: list[BaseException] = []
        issued = 0

        def timed_call():  # pedantic calls it rounds x iterations times; each round's last waits
            nonlocal issued
            if errors:
                return
            try:
                pending = workload.start()
                issued += 1
                if issued % iterations == 0:
                    workload.finish(pending)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        power.timed()
        self.benchmark.pedantic(timed_call, rounds=rounds, iterations=iterations,
                                warmup_rounds=0)
        power.done()
        if errors:
            error = describe_error(errors[0])
            self.info["error"] = error
            if is_out_of_memory(error):
                self.state.failed[case.scale_key()] = (case.work(), case.size_label(), error)
            return False
        median = self.benchmark.stats.stats.median
        self.info.update(json_safe(case.rates(median)))
        self.state.last_call[case.scale_key()] = (case.work(), median)
        return True

    def _remember_failure(self, case, error: str) -> None:
        if is_out_of_memory(error):
            self.state.failed[case.scale_key()] = (case.work(), case.size_label(), error)
        self.fail(error)
