"""pytest-benchmark JSON (``--benchmark-json``): tilax's own runs from ``nox -s bench``.

Shape: ``{"machine_info": {...}, "commit_info": {...}, "benchmarks": [...], "datetime": ...,
"version": ...}``. Everything a report needs is in each benchmark's ``extra_info`` (the contract
in docs/reports/schema.md); ``stats`` are in seconds. A benchmark whose ``extra_info`` has an
``error`` is a failure row: its stats timed a no-op and are ignored, as are the stats of summary
rows (suite ``maxtok_summary``, rows with ``max_n``). The run id is the file name without
``.json``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ._common import FormatError, as_list, as_mapping, require, split_rel_err, status_of

NAME = "pytest_benchmark"

FAMILIES = ("moe", "rbf")
REQUIRED = ["family", "suite", "impl", "dtype", "op"]
# extra_info keys copied under the same name.
SAME_NAME = [
    "family", "suite", "impl", "dtype", "op", "compile_s", "error",
    # MoE
    "routing", "dispatch", "tokens", "d_model", "d_hidden", "experts", "top_k",
    "shared_hidden", "skew", "flops", "tflops", "max_expert_frac", "empty_experts",
    "rel_err_out", "rel_err_grad_x", "rel_err_grad_params", "piece", "block_m", "peak_mb",
    "max_tokens",
    # RBF
    "n", "m", "dim", "out", "batch", "block_q", "block_k", "block_o", "pairs_per_s",
    "max_n", "precision",
]
# Derived from the (ignored) stats of a failure row, so dropped there.
TIMING_DERIVED = ("flops", "tflops", "pairs_per_s")
# Summary rows (largest size that ran) time nothing of their own: their stats are ignored too.
SUMMARY_SUITES = ("maxtok_summary",)
REL_ERR_REF = {"moe": "float32 dense", "rbf": "float64 reference"}


def matches(doc: dict[str, Any]) -> bool:
    return isinstance(doc.get("benchmarks"), list) and isinstance(doc.get("machine_info"), dict)


def load(doc: dict[str, Any], run: str) -> list[dict[str, Any]]:
    machine = doc["machine_info"]
    commit_info = doc.get("commit_info") or {}
    common = dict(
        run=run,
        device=machine.get("gpu"),
        gpu_memory_gb=machine.get("gpu_memory_gb"),
        jax=machine.get("jax"),
        date=str(doc["datetime"])[:10] if doc.get("datetime") else None,
        commit=machine.get("commit") or (str(commit_info.get("id") or "")[:7] or None),
    )
    rows = []
    for index, bench in enumerate(as_list(doc["benchmarks"], "benchmarks")):
        where = f"benchmarks[{index}]"
        bench = as_mapping(bench, where)
        where = f"benchmarks[{index}] ({bench.get('name', 'unnamed')})"
        extra = as_mapping(bench.get("extra_info"), f"{where}.extra_info")
        require(extra, REQUIRED, f"{where}.extra_info")
        if extra["family"] not in FAMILIES:
            raise FormatError(f"{where}: family {extra['family']!r} is not one of {FAMILIES}")
        row = {**common, **{key: extra.get(key) for key in SAME_NAME}}
        row.update(split_rel_err(extra.get("rel_err"), where))
        status = status_of(extra.get("error"))
        row.update(source_row=index, status=status)
        summary = extra["suite"] in SUMMARY_SUITES or extra.get("max_n") is not None
        if status == "ok" and not summary:
            row.update(_timing(bench.get("stats"), where))
        else:
            row.update({key: None for key in TIMING_DERIVED})
        if any(row.get(key) is not None for key in _REL_ERR_COLUMNS):
            row["rel_err_ref"] = REL_ERR_REF[extra["family"]]
        unknown = {k: v for k, v in extra.items() if k not in SAME_NAME and k != "rel_err"}
        row["extra"] = json.dumps(unknown, sort_keys=True, default=str) if unknown else None
        rows.append(row)
    return rows


_REL_ERR_COLUMNS = (
    "rel_err", "rel_err_dq", "rel_err_dk", "rel_err_dv", "rel_err_dlengthscale",
    "rel_err_out", "rel_err_grad_x", "rel_err_grad_params",
)


def _timing(stats: Any, where: str) -> dict[str, Any]:
    stats = as_mapping(stats, f"{where}.stats")
    require(stats, ["median", "q1", "q3", "rounds"], f"{where}.stats")
    for key in ("median", "q1", "q3"):
        value = stats[key]
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise FormatError(f"{where}.stats.{key} is {value!r}, expected seconds >= 0")
    return {
        "median_ms": stats["median"] * 1e3,
        "q1_ms": stats["q1"] * 1e3,
        "q3_ms": stats["q3"] * 1e3,
        "rounds": stats["rounds"],
        "inner": stats.get("iterations"),
    }
