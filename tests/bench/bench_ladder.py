"""Peak-memory and largest-problem ladders: every size in a fresh subprocess with a time limit.

A *ladder* runs one config at growing sizes (tokens for MoE ``maxtok``, ``n`` for RBF
``kernel_mv_max_n``); each step is one pytest-benchmark row made by a child process::

    python tests/bench/bench_ladder.py '<json spec>'

The child builds the same workload as the in-process benchmarks, times the first call
(``compile_s``) and ``timed_calls`` more calls, reads the device's
``memory_stats()["peak_bytes_in_use"]`` (``torch.cuda.max_memory_allocated`` for torch peers)
and prints one ``TILAX_LADDER_RESULT {...}`` line. The parent replays the child's call times as
the row's rounds and stores ``peak_mb``.

The first step of a ladder to run searches the whole ladder (:func:`search_ladder`): it climbs
from the smallest size, jumping over the sizes the last step that ran predicts to fit (peak
memory taken as linear in the size against the device limit, time scaled by the work against
the step's time) to the largest of them; after a failure (out of memory, a crash, the step's
time limit ``timeout after N s``) or a size predicted too slow for what is left of the ladder's
budget share (``skipped: not attempted, timeout predicted``; a size predicted past the step
limit alone is tried, so that its timeout brackets the limit) it bisects the ladder's sizes
between the largest that ran and the smallest that failed until the two are adjacent. The
search keeps within each step's limit and the ladder's part of its suite's budget share
(``bench_harness.BudgetPlan``); the first size always gets a step. Probed sizes become rows
(measured or failure rows); the others are skipped tests (not rows: never needed). A summary
row per ladder (``maxtok_summary``, or a ``kernel_mv_max_n`` row with ``max_n``) names the
largest size that ran, carries that step's timings and peak, and says how well the limit is
known (:func:`ladder_outcome`): ``limit_bracket`` [ran, failed] with ``limit_kind`` ("out of
memory", "timeout", "error") when the next ladder size failed, else ``limit_bracket`` null and
``max_is_lower_bound`` true (``limit_kind`` "time (predicted)", "budget" or "end of ladder");
``stopped_by`` is the stopping error or reason and ``probed_sizes`` the search's order.
``kernel_mv_peak`` rows are single-step ladders.

Children get ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` and ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.9``
(unless already set), so their peak is what the problem needs and they may use most of the
device. The parent runs the ladders before its own in-process benchmarks (priority 0) so its
memory pool is still small while they run; their suites' budget shares keep them from starving
the other suites.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_harness import (
    Settings,
    State,
    describe_error,
    is_out_of_memory,
    json_safe,
    record_external_timings,
    record_failure,
    suite_of,
)

MARKER = "TILAX_LADDER_RESULT "
BENCH_DIR = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class LadderStep:
    """One size of a ladder (``case`` is a MoECase/RbfCase at that size)."""

    ladder: str
    case: object
    size_field: str
    sizes: tuple = ()
    priority: int = 0
    summary: bool = False

    @property
    def id(self) -> str:
        if self.summary:
            return f"{self.ladder}-summary"
        if len(self.sizes) == 1:
            return self.ladder
        return f"{self.ladder}-{self.size_field}{getattr(self.case, self.size_field)}"


def ladder_steps(template, sizes: list[int], size_field: str, summary: bool = True,
                 name: str | None = None):
    """The steps of one ladder plus its summary row, in run order."""
    size = getattr(template, size_field)
    name = name or template.id.replace(f"-T{size}-", "-").replace(f"-n{size}-", "-")
    steps = []
    for size in sizes:
        steps.append(LadderStep(name, _sized(template, size_field, size), size_field,
                                tuple(sizes), priority=template.priority))
    if summary:
        steps.append(LadderStep(name, steps[-1].case, size_field, tuple(sizes),
                                priority=template.priority, summary=True))
    return steps


def child_env() -> dict[str, str]:
    import tilax

    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    src = str(Path(tilax.__file__).resolve().parents[1])
    # tests/ too: the bench modules import the shared test helpers (tests/helpers.py)
    paths = [src, str(BENCH_DIR), str(BENCH_DIR.parent)]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def launch(spec: dict, timeout: float) -> dict:
    """Run one step in a fresh interpreter; always returns a result dict (never raises)."""
    command = [sys.executable, str(Path(__file__).resolve()), json.dumps(spec)]
    start = time.monotonic()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=child_env())
    except subprocess.TimeoutExpired:
        return {"ok": False, "timeout": True, "wall_s": time.monotonic() - start,
                "error": f"timeout after {timeout:.0f} s (fresh subprocess: start-up, compile "
                         f"and {1 + spec['timed_calls']} calls)"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            result = json.loads(line[len(MARKER):])
            result["wall_s"] = time.monotonic() - start
            return result
    tail = (proc.stderr or proc.stdout).strip()[-1500:]
    return {"ok": False, "wall_s": time.monotonic() - start,
            "error": f"child process exited with code {proc.returncode} without a result: {tail}"}


def _timed_calls(settings: Settings) -> int:
    return 1 if settings.mode == "smoke" else 2


def _sized(case, size_field: str, size: int):
    changes = {size_field: size}
    if size_field == "n" and getattr(case, "m", None) is not None:
        changes["m"] = size
    return dataclasses.replace(case, **changes)


def _predicted_wall(last: dict, work: float, calls: int) -> float:
    """Wall time of a step with ``work``, scaled from the last step that ran (start-up and
    compile stay, the calls scale with the work)."""
    per_call = statistics.median(last["times"])
    return last["wall_s"] + calls * per_call * (work / last["work"] - 1)


def _jump_target(step: LadderStep, last: dict | None, timeout: float,
                 calls: int) -> int | None:
    """The largest ladder size above the last one that the last step's peak memory (linear in
    the size) and time (scaled by the work) predict to fit; ``None`` if nothing is predicted
    to fit or the peak or limit is unknown."""
    if last is None or not last.get("peak_bytes") or not last.get("limit_bytes"):
        return None
    fitting = last["size"] * last["limit_bytes"] / last["peak_bytes"]
    candidates = [
        size for size in step.sizes
        if last["size"] < size <= fitting
        and _predicted_wall(last, _sized(step.case, step.size_field, size).work(), calls) <= timeout
    ]
    return max(candidates) if candidates else None


def search_ladder(sizes, attempt, jump_target, refuse) -> list[dict]:
    """Probe a ladder's sizes; returns the probes in order (a pure search, no I/O of its own).

    ``attempt(size)`` runs one size (a dict with ``ok``, ``error`` when not ok);
    ``jump_target(last)`` is the largest size the last step that ran predicts to fit, or
    ``None``; ``refuse(size, last)`` is ``None`` or ``(kind, reason)`` for a size not to be
    attempted: kind ``"time"`` (predicted over the ladder's time: larger sizes are too) or
    ``"budget"`` (no time left at all: the search stops).

    While nothing has failed the search climbs, jumping to the predicted size (else the next
    one); after a failure or a refusal it bisects the ladder's indices between the largest
    size that ran and the smallest that failed, until the two are adjacent. Each probe is
    ``{"size", "ok", "attempted", ...}``.
    """
    probes: list[dict] = []
    ok_at = -1  # index of the largest size that ran
    fail_at = len(sizes)  # index of the smallest size that failed or was refused
    last = None
    index = 0
    while ok_at + 1 < fail_at:
        size = sizes[index]
        refusal = refuse(size, last)
        if refusal is not None:
            kind, reason = refusal
            probes.append({"size": size, "ok": False, "attempted": False, "kind": kind,
                           "error": reason})
            if kind == "budget":
                break
            fail_at = index
        else:
            probe = dict(attempt(size), size=size, attempted=True)
            probes.append(probe)
            if probe["ok"]:
                ok_at, last = index, probe
            else:
                fail_at = index
        if fail_at < len(sizes) or ok_at + 1 >= fail_at:
            index = (ok_at + fail_at) // 2 if ok_at >= 0 else 0
            index = max(index, ok_at + 1)
        else:
            target = jump_target(last)
            index = ok_at + 1
            if target in sizes:
                index = max(index, min(sizes.index(target), fail_at - 1))
    return probes


def ladder_outcome(sizes, probes: list[dict]) -> dict:
    """The summary of a search: the largest size that ran and how well the limit is known.

    ``limit_bracket`` [ran, failed] when the next ladder size above the largest that ran was
    attempted and failed (``limit_kind``: out of memory, timeout or error); otherwise the
    largest size is only a lower bound (``limit_bracket`` is ``None``; stopped by the time
    predicted for the next size, the budget, or the end of the ladder).
    """
    ran = [p for p in probes if p["ok"]]
    if not ran:
        first = probes[0]["error"] if probes else "no step of this ladder ran"
        return {"best": None, "error": f"no size ran: {first}"}
    best = max(ran, key=lambda p: p["size"])
    index = list(sizes).index(best["size"])
    if index + 1 == len(sizes):
        return {"best": best, "limit_bracket": None, "limit_kind": "end of ladder",
                "max_is_lower_bound": True, "stopped_by": "the largest ladder size ran"}
    above = sizes[index + 1]
    stop = next((p for p in probes if p["size"] == above), None) or probes[-1]
    if stop["attempted"] and stop["size"] == above:
        error = stop["error"]
        kind = ("out of memory" if is_out_of_memory(error)
                else "timeout" if error.startswith("timeout") else "error")
        return {"best": best, "limit_bracket": [best["size"], above], "limit_kind": kind,
                "max_is_lower_bound": False, "stopped_by": error[:500]}
    kind = stop.get("kind") or "budget"
    return {"best": best, "limit_bracket": None,
            "limit_kind": "time (predicted)" if kind == "time" else "budget",
            "max_is_lower_bound": True, "stopped_by": stop["error"][:500]}


def too_slow_to_try(predicted_s: float, left_s: float, step_limit_s: float) -> bool:
    """Whether a size predicted to take ``predicted_s`` is refused with ``left_s`` left to its
    step. Only the budget refuses it: a size predicted past the step limit alone is tried
    anyway (with that limit), so that its timeout brackets the limit instead of leaving the
    largest size that ran a lower bound."""
    return predicted_s > left_s and left_s < step_limit_s


def run_step(runner, step: LadderStep) -> None:
    """One ladder step (or summary) into one row; see the module docstring.

    The first step of a ladder to run searches the whole ladder (:func:`search_ladder`, each
    probe a fresh subprocess); every step then reports its size's probe (a measured or a
    failure row), or is skipped if its size was not needed, and the summary reports
    :func:`ladder_outcome`.
    """
    state, info = runner.state, runner.info
    case = step.case
    info.update(json_safe(case.extra_info()))
    info.setdefault("compile_s", None)
    if step.ladder not in state.ladders:
        state.ladders[step.ladder] = _search(runner, step)
    probes = state.ladders[step.ladder]
    if step.summary:
        summarize(runner, step, probes)
        return
    size = getattr(case, step.size_field)
    probe = next((p for p in probes if p["size"] == size), None)
    if probe is None:
        probed = ", ".join(str(p["size"]) for p in probes)
        pytest.skip(f"not needed: ladder {step.ladder} probed {step.size_field} = {probed}")
    if not probe["ok"]:
        if probe.get("compile_s") is not None:
            info["compile_s"] = probe["compile_s"]
        record_failure(runner.benchmark, probe["error"])
        return
    _record_success(runner, case, probe)


def _search(runner, step: LadderStep) -> list[dict]:
    """Search one ladder within its time: each step's limit, and the ladder's even part of what
    its suite may use (the first size always gets the step limit, within the suite's time)."""
    state, settings = runner.state, runner.settings
    suite = suite_of(step.case)
    calls = 1 + _timed_calls(settings)
    started = time.monotonic()
    allowance = state.budget.ladder_allowance(suite, step.ladder, state.available(suite))

    def limit(first: bool) -> float:
        suite_left = state.available(suite) if first else min(
            state.available(suite), allowance - (time.monotonic() - started))
        return min(settings.step_timeout_s, suite_left)

    def case_at(size):
        return _sized(step.case, step.size_field, size)

    def attempt(size):
        case = case_at(size)
        reason = case.unavailable_reason()
        if reason is not None:
            return {"ok": False, "error": reason}
        spec = {"module": type(case).__module__, "case": case.to_spec(), "mode": settings.mode,
                "timed_calls": _timed_calls(settings)}
        result = launch(spec, max(5.0, limit(first=not probes_ran)))
        probes_ran.append(size)
        if not result["ok"]:
            return {"ok": False, "error": result["error"], "compile_s": result.get("compile_s")}
        return {"ok": True, "label": case.size_label(), "work": case.work(),
                "times": result["times"], "wall_s": result["wall_s"],
                "compile_s": result["compile_s"], "peak_bytes": result.get("peak_bytes"),
                "limit_bytes": result.get("limit_bytes")}

    def refuse(size, last):
        left = limit(first=last is None and not probes_ran)
        if left <= 0:
            return "budget", (f"skipped: not attempted, the run's time budget of "
                              f"{settings.budget_s:.0f} s was spent, or what was left of it was "
                              f"this ladder's share, before this step")
        if last is None or settings.mode == "smoke":
            return None
        predicted = _predicted_wall(last, case_at(size).work(), calls)
        if too_slow_to_try(predicted, left, settings.step_timeout_s):
            return "time", (f"skipped: not attempted, timeout predicted: about "
                            f"{predicted:.0f} s for this step (scaled by the work from "
                            f"{last['wall_s']:.0f} s at {last['label']}) exceeds the "
                            f"{left:.0f} s left of this ladder's share of the budget")
        return None

    def jump(last):
        return _jump_target(step, last, max(5.0, limit(first=False)), calls)

    probes_ran: list[int] = []
    return search_ladder(list(step.sizes), attempt, jump, refuse)


def summarize(runner, step: LadderStep, probes: list[dict]) -> None:
    case = step.case
    info = runner.info
    outcome = ladder_outcome(step.sizes, probes)
    best = outcome["best"]
    if best is None and probes:  # the row names the size that failed, not the ladder's largest
        info.update(json_safe(_sized(case, step.size_field, probes[0]["size"]).extra_info()))
    if case.family == "moe":
        info["suite"] = "maxtok_summary"
    info["probed_sizes"] = [p["size"] for p in probes]
    if best is None:
        record_failure(runner.benchmark, outcome["error"])
        return
    sized = _sized(case, step.size_field, best["size"])
    info.update(json_safe(sized.extra_info()))
    if case.family == "moe":
        info.update(suite="maxtok_summary", max_tokens=best["size"])
    else:
        info["max_n"] = best["size"]
    for key in ("limit_bracket", "limit_kind", "max_is_lower_bound", "stopped_by"):
        info[key] = outcome[key]
    _record_success(runner, sized, best)


def _record_success(runner, case, entry: dict) -> None:
    info = runner.info
    info["compile_s"] = entry["compile_s"]
    info["peak_mb"] = _mb(entry["peak_bytes"])
    info["wall_s"] = entry["wall_s"]
    record_external_timings(runner.benchmark, entry["times"])
    info.update(json_safe(case.rates(statistics.median(entry["times"]))))


def _mb(nbytes) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def child_main(spec_json: str) -> None:
    """The child side: build, time, read the peak, print one result line."""
    spec = json.loads(spec_json)
    result: dict = {"ok": False}
    try:
        module = importlib.import_module(spec["module"])
        case_type = module.RbfCase if spec["module"] == "bench_rbf" else module.MoECase
        case = case_type.from_spec(spec["case"])
        settings = Settings(mode=spec["mode"], suites=frozenset(), budget_s=1e9,
                            row_limit_s=1e9, target_time_s=0.0, min_rounds=1, max_rounds=1,
                            step_timeout_s=1e9)
        state = State(settings)
        workload = case.build(state)
        start = time.perf_counter()
        workload.call()
        result["compile_s"] = time.perf_counter() - start
        times = []
        for _ in range(spec["timed_calls"]):
            start = time.perf_counter()
            workload.call()
            times.append(time.perf_counter() - start)
        peak, limit = workload.memory()
        result.update(ok=True, times=times, peak_bytes=peak, limit_bytes=limit)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as the row's error
        result.update(ok=False, error=describe_error(exc))
    print(MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.path[:0] = [str(BENCH_DIR), str(BENCH_DIR.parent)]
    child_main(sys.argv[1])
