"""Peak-memory and largest-problem ladders: every size in a fresh subprocess with a time limit.

A *ladder* runs one config at growing sizes (tokens for MoE ``maxtok``, ``n`` for RBF
``kernel_mv_max_n``); each step is one pytest-benchmark row made by a child process::

    python tests/bench/bench_ladder.py '<json spec>'

The child builds the same workload as the in-process benchmarks, times the first call
(``compile_s``) and ``timed_calls`` more calls, reads the device's
``memory_stats()["peak_bytes_in_use"]`` (``torch.cuda.max_memory_allocated`` for torch peers)
and prints one ``TILAX_LADDER_RESULT {...}`` line. The parent replays the child's call times as
the row's rounds and stores ``peak_mb``. After a step that ran, the ladder jumps over the
sizes that step predicts to fit (peak memory taken as linear in the size against the device
limit, time scaled by the work against the step limit) to the largest of them, then tries the
size above it. A ladder stops at its first failure: out of memory, a crash, the step's time
limit (``timeout after N s``), or a time predicted from the previous step (``timeout
(predicted, not attempted)``). Sizes jumped over and sizes above the stop are reported as
skipped tests (not rows: they were never needed). A summary row per ladder (``maxtok_summary``, or a
``kernel_mv_max_n`` row with ``max_n``) names the largest size that ran and carries that step's
timings and peak. ``kernel_mv_peak`` rows are single-step ladders.

Children get ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` and ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.9``
(unless already set), so their peak is what the problem needs and they may use most of the
device. The parent runs the ladders before its own in-process benchmarks (priority 0) so its
memory pool is still small while they run.
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
    json_safe,
    record_external_timings,
    record_failure,
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
        return f"{self.ladder}-{self.size_field}{getattr(self.case, self.size_field)}"


def ladder_steps(template, sizes: list[int], size_field: str, summary: bool = True):
    """The steps of one ladder plus its summary row, in run order."""
    size = getattr(template, size_field)
    name = template.id.replace(f"-T{size}-", "-").replace(f"-n{size}-", "-")
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
    paths = [src, str(BENCH_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
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


def _jump_target(step: LadderStep, last: dict, timeout: float, calls: int) -> int | None:
    """The largest ladder size above the last one that the last step's peak memory (linear in
    the size) and time (scaled by the work) predict to fit; ``None`` if nothing is predicted
    to fit or the peak or limit is unknown."""
    if not last.get("peak_bytes") or not last.get("limit_bytes"):
        return None
    fitting = last["size"] * last["limit_bytes"] / last["peak_bytes"]
    candidates = [
        size for size in step.sizes
        if last["size"] < size <= fitting
        and _predicted_wall(last, _sized(step.case, step.size_field, size).work(), calls) <= timeout
    ]
    return max(candidates) if candidates else None


def run_step(runner, step: LadderStep) -> None:
    """One ladder step (or summary) into one row; see the module docstring.

    After a step that ran, sizes the last step predicts to fit (memory and time) are jumped
    over up to the largest of them, which runs next, then the size above it (the one expected
    to fail) runs to confirm the limit.
    """
    state, settings, info = runner.state, runner.settings, runner.info
    case = step.case
    info.update(json_safe(case.extra_info()))
    info.setdefault("compile_s", None)
    history = state.ladders.setdefault(step.ladder, [])
    if step.summary:
        summarize(runner, step, history)
        return
    stop = next((h for h in history if not h["ok"]), None)
    if stop is not None:
        pytest.skip(f"not needed: ladder {step.ladder} stopped at {stop['label']}")
    size = getattr(case, step.size_field)
    timeout = max(5.0, min(settings.step_timeout_s, settings.remaining()))
    calls = 1 + _timed_calls(settings)
    last = history[-1] if history else None
    if last is not None:
        target = _jump_target(step, last, timeout, calls)
        if target is not None and size < target:
            pytest.skip(f"not needed: from {last['label']} ({last['peak_bytes'] / 2**30:.1f} of "
                        f"{last['limit_bytes'] / 2**30:.0f} GiB) the ladder jumps to "
                        f"{step.size_field}={target}")
    reason = case.unavailable_reason()
    if reason is None and settings.remaining() <= 0:
        reason = (f"skipped: not attempted, the run's time budget of {settings.budget_s:.0f} s "
                  f"was spent before this step")
    if reason is None and last is not None and settings.mode != "smoke":
        predicted = _predicted_wall(last, case.work(), calls)
        if predicted > timeout:
            reason = (f"timeout (predicted, not attempted): about {predicted:.0f} s for this step "
                      f"(scaled by the work from {last['wall_s']:.0f} s at {last['label']}) "
                      f"exceeds the step limit of {timeout:.0f} s")
    if reason is not None:
        history.append({"ok": False, "label": case.size_label(), "error": reason})
        record_failure(runner.benchmark, reason)
        return
    spec = {"module": type(case).__module__, "case": case.to_spec(), "mode": settings.mode,
            "timed_calls": _timed_calls(settings)}
    result = launch(spec, timeout)
    if not result["ok"]:
        history.append({"ok": False, "label": case.size_label(), "error": result["error"]})
        if result.get("compile_s") is not None:
            info["compile_s"] = result["compile_s"]
        record_failure(runner.benchmark, result["error"])
        return
    entry = {"ok": True, "label": case.size_label(), "size": size, "work": case.work(),
             "times": result["times"], "wall_s": result["wall_s"],
             "compile_s": result["compile_s"], "peak_bytes": result.get("peak_bytes"),
             "limit_bytes": result.get("limit_bytes")}
    history.append(entry)
    _record_success(runner, case, entry)


def summarize(runner, step: LadderStep, history: list[dict]) -> None:
    case = step.case
    info = runner.info
    ran = [h for h in history if h["ok"]]
    if case.family == "moe":
        info["suite"] = "maxtok_summary"
    if not ran:
        first = history[0]["error"] if history else "no step of this ladder ran"
        record_failure(runner.benchmark, f"no size ran: {first}")
        return
    best = max(ran, key=lambda h: h["size"])
    stop = next((h for h in history if not h["ok"]), None)
    sized = _sized(case, step.size_field, best["size"])
    info.update(json_safe(sized.extra_info()))
    if case.family == "moe":
        info.update(suite="maxtok_summary", max_tokens=best["size"])
    else:
        info["max_n"] = best["size"]
    info["stopped_by"] = stop["error"][:500] if stop else "the largest size tried ran"
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
    sys.path.insert(0, str(BENCH_DIR))
    child_main(sys.argv[1])
