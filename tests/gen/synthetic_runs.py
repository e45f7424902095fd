"""Building blocks of the synthetic H200 runs that the report tests store: benchmark rows made
from the bench's own cases, as the harness writes them, and the pytest-benchmark document around
them (imported by name: keep it unique).
"""

from __future__ import annotations

import statistics

H200 = {"gpu": "NVIDIA H200", "gpu_driver": "580.159.04", "gpu_memory_gb": 139.8,
        "compute_capability": "9.0", "jax": "0.11.2", "jaxlib": "0.11.2", "cuda": "13.0",
        "triton": "3.6.0", "python": "3.12.8", "platform": "gpu"}


def stats(seconds: list[float]) -> dict:
    """pytest-benchmark's stats of one row timed ``len(seconds)`` rounds of one iteration."""
    q1, _, q3 = (statistics.quantiles(seconds, n=4, method="inclusive") if len(seconds) > 1
                 else seconds * 3)
    return {"min": min(seconds), "max": max(seconds), "mean": statistics.fmean(seconds),
            "stddev": statistics.stdev(seconds) if len(seconds) > 1 else 0.0,
            "rounds": len(seconds), "median": statistics.median(seconds), "q1": q1, "q3": q3,
            "iqr": q3 - q1, "total": sum(seconds), "iterations": 1, "data": seconds}


def benchmark(case, test: str, seconds: list[float] | None = None, error: str | None = None, *,
              group: str | None = None, compile_s: float = 1.5, **measured) -> dict:
    """One row of ``tests/bench/test_bench_<area>.py::<test>[case.id]``: timed ``seconds`` with
    ``measured`` extra_info and the case's rates, or failed/skipped with ``error`` (the harness
    then times a no-op and keeps the error)."""
    info = {**case.extra_info(), "compile_s": None}
    if error is not None:
        info["error"] = error
        row_stats = stats([1e-6])
    else:
        row_stats = stats(seconds)
        info.update(compile_s=compile_s, **measured, **case.rates(row_stats["median"]))
    module, name = test.split("::")
    return {"group": group, "name": f"{name}[{case.id}]",
            "fullname": f"tests/bench/{module}::{name}[{case.id}]", "params": None,
            "extra_info": info, "stats": row_stats}


def document(benchmarks: list[dict], *, commit: str, suites: list[str], budget_s: float,
             started: str, mode: str = "full") -> dict:
    """The pytest-benchmark document of one H200 run of ``suites`` at ``commit``."""
    machine = {**H200, "commit": commit, "bench_mode": mode, "bench_suites": suites,
               "bench_budget_s": budget_s}
    return {"machine_info": machine, "commit_info": {"id": "unknown"}, "benchmarks": benchmarks,
            "datetime": started, "version": "5.1.0"}
