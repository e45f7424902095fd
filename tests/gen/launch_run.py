"""A synthetic stored run of the launch sweep (suite ``kernel_mv_launches``) for the report
tests (imported by name: keep it unique). Its rows are the bench's own launch cases
(``tests/bench/bench_rbf.py``), so a key renamed there breaks the report tests, with invented
times: per kernel family a few launches, the default among them, and a failed, a skipped and a
capped (one round) row."""

import json
import statistics
import sys
from pathlib import Path

from report_fixtures import PYTEST_BENCHMARK_FIXTURE, REPO

BENCH = REPO / "tests" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_rbf  # noqa: E402
from bench_rows import check_document  # noqa: E402

NAME = "h200-20260116-1b2c3d4-launches.json"
RUN = "h200-20260116-1b2c3d4"  # the run id: GPU, date and commit of its files
SHARED_MEMORY_ERROR = ("JaxRuntimeError: INTERNAL: out of resource: shared memory, Required: "
                       "264192, Hardware limit: 232448")
BUDGET_SKIP = ("skipped: not attempted, the run's time budget of 450 s was spent before this row "
               "(or what is left is owed to other suites)")
# (group, (block_p, block_l, warps, stages)[, grad_backend]) -> median ms, or an error; the
# defaults (fast
# 128x128 w4 s3 forward, 128x64 w4 s3 backward; exact 64x32 w4 s2) as GPU_PREFERRED has them.
OUTCOMES = {
    ("fast_fwd", (128, 128, 4, 3)): 3.0,  # the default, second
    ("fast_fwd", (128, 64, 4, 3)): 2.0,  # the fastest
    ("fast_fwd", (64, 128, 4, 3)): 3.03,  # within the noise of the default (~1.01x)
    ("fast_fwd", (64, 64, 8, 2)): 4.5,  # 1.50x the default
    ("fast_fwd", (256, 128, 8, 3)): SHARED_MEMORY_ERROR,
    ("fast_fwd", (64, 32, 8, 2)): BUDGET_SKIP,
    ("fast_bwd", (128, 64, 4, 3)): 10.0,  # the default is the fastest
    ("fast_bwd", (64, 64, 4, 3)): 15.0,
    ("fast_bwd", (128, 64, 4, 2), "mosaic"): 6.0,  # the Mosaic GPU sweeps: faster still
    ("exact_fwd", (64, 32, 4, 2)): 12.0,
    ("exact_fwd", (128, 32, 4, 2)): 14.0,
    ("exact_bwd", (64, 32, 4, 2)): "JaxRuntimeError: INTERNAL: a made-up launch failure",
    ("exact_bwd", (32, 32, 4, 2)): 80.0,
    ("exact_bwd", (32, 128, 8, 2)): 2200.0,  # a spilling launch: one timed round
}
#: Rows flagged as their family's default as the runs stored before commit 12feb05 flag them
#: (since then the exact backward's dq and dk launches differ, and no row of that family is
#: its default): the report reads stored files, old ones included.
STORED_DEFAULTS = {("exact_bwd", (64, 32, 4, 2))}
SPREAD = (-0.01, -0.006, -0.003, -0.001, 0.0, 0.0, 0.001, 0.003, 0.006, 0.01)


def _stats(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    if len(ordered) > 1:
        q1, _, q3 = statistics.quantiles(ordered, n=4)
    else:
        q1 = q3 = ordered[0]
    return {"min": ordered[0], "max": ordered[-1], "mean": statistics.fmean(ordered),
            "stddev": statistics.pstdev(ordered), "rounds": len(ordered),
            "median": statistics.median(ordered), "iqr": q3 - q1, "q1": q1, "q3": q3,
            "iqr_outliers": 0, "stddev_outliers": 0, "outliers": "0;0", "ld15iqr": ordered[0],
            "hd15iqr": ordered[-1], "ops": 1 / statistics.fmean(ordered),
            "total": sum(ordered), "data": seconds, "iterations": 1}


def _row(case, outcome) -> dict:
    info = {**case.extra_info(), "compile_s": 1.5}
    if isinstance(outcome, str):
        info["error"] = outcome
        if outcome.startswith("skipped:"):
            info["compile_s"] = None
        seconds = [1e-7]
    else:
        spread = SPREAD if outcome < 1000 else (0.0,)
        seconds = [outcome * (1 + d) / 1e3 for d in spread]
        info["pairs_per_s"] = case.work() / statistics.median(seconds)
        info["rel_err"] = (2e-3 if case.op == "fwd" else
                           {"dq": 2e-3, "dk": 3e-3, "dv": 1e-3, "dlengthscale": 2.5e-3})
        if case.path == "exact":
            info["rel_err"] = (1e-7 if case.op == "fwd" else
                               {"dq": 2e-7, "dk": 3e-7, "dv": 1e-7, "dlengthscale": 2e-7})
    name = f"test_kernel_mv_launches[{case.id}]"
    return {"group": None, "name": name, "fullname": f"tests/bench/test_bench_rbf.py::{name}",
            "params": {"case": case.id}, "param": case.id, "extra_info": info,
            "options": {"disable_gc": False, "timer": "perf_counter", "min_rounds": 5,
                        "max_time": 1.0, "min_time": 5e-06, "warmup": False},
            "stats": _stats(seconds)}


def launch_document(outcomes: dict = OUTCOMES, commit: str = "1b2c3d4",
                    started: str = "2026-01-16T10:00:00+00:00") -> dict:
    """The synthetic run as pytest-benchmark JSON, rows in the order of ``outcomes``."""
    fixture = json.loads(PYTEST_BENCHMARK_FIXTURE.read_text())
    machine = dict(fixture["machine_info"], commit=commit, bench_mode="full",
                   bench_suites=["kernel_mv_launches"], bench_budget_s=450.0, bench_part=None)
    cases = {(case.group, case.launch, case.grad_backend): case
             for case in bench_rbf.launch_cases("full")}
    rows = [_row(cases[(*key, None)[:3]], outcome) for key, outcome in outcomes.items()]
    for key, row in zip(outcomes, rows, strict=True):
        if key in STORED_DEFAULTS:
            row["extra_info"]["default_launch"] = True
    doc = {"machine_info": machine, "commit_info": fixture["commit_info"], "benchmarks": rows,
           "datetime": started, "version": "5.1.0"}
    problems = check_document(doc)
    assert not problems, problems
    return doc


def write_launch_run(results_dir: Path, outcomes: dict = OUTCOMES, name: str = NAME,
                     **document) -> Path:
    path = Path(results_dir) / name
    path.write_text(json.dumps(launch_document(outcomes, **document), indent=1))
    return path
