"""The RTX 3090 RBF kernels seed file (rtx3090-rbf-kernels.json).

Shape: ``{"device": {...}, "config": {"runner": ..., "note": ..., "runs": {...}}, "results":
[...]}``. Rows carry a ``family`` (the suite) but no run id; ``config.runs`` lists the runs with
the sections, sizes and impls each measured, and the loader assigns a row to the one run whose
section, sizes and impls contain it (the crossover probe run is the one whose script says
"crossover"). A row no run or several runs match gets the file-level run id ``rbf_kernels``.
``rel_err`` is a float (fwd) or a dict of dq/dk/dv/dlengthscale (fwd_bwd). Rows with
``checkout`` measured the code before the change (impl ``default@gpu-benchmarks``).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from ._common import (
    as_list,
    as_mapping,
    reject_unknown,
    require,
    seed_environment,
    split_rel_err,
    status_of,
)

NAME = "rbf_seed"
FALLBACK_RUN = "rbf_kernels"

SAME_NAME = [
    "impl", "batch", "n", "m", "dim", "out", "xla_temp_mb", "xla_arg_mb", "xla_out_mb",
    "compile_s", "inner", "median_ms", "q1_ms", "q3_ms", "peak_mb", "error", "run_s",
    "block_q", "block_k", "block_o", "repeat",
]
KNOWN_ROW_FIELDS = set(SAME_NAME) | {"family", "mode", "rel_err", "checkout"}
# config.runs[*].sections name -> row family.
SECTION_FAMILY = {
    "grid": "kernel_mv",
    "kde": "kde_density",
    "tiles": "kernel_mv_tiles",
    "peak": "kernel_mv_peak",
    "max_n": "kernel_mv_max_n",
}


def matches(doc: dict[str, Any]) -> bool:
    config = doc.get("config")
    return (
        set(doc) == {"device", "config", "results"}
        and isinstance(config, dict)
        and isinstance(config.get("runs"), dict)
        and "runner" in config
    )


def load(doc: dict[str, Any], file_stem: str) -> list[dict[str, Any]]:
    device = as_mapping(doc["device"], "device")
    config = doc["config"]
    runs = {
        PurePosixPath(name).stem: as_mapping(run, f"config.runs[{name!r}]")
        for name, run in as_mapping(config["runs"], "config.runs").items()
    }
    rows = []
    for index, record in enumerate(as_list(doc["results"], "results")):
        where = f"results[{index}]"
        record = as_mapping(record, where)
        require(record, ["family", "impl", "mode", "n"], where)
        reject_unknown(record, KNOWN_ROW_FIELDS, where)
        run = _run_of(record, runs)
        row = {key: record.get(key) for key in SAME_NAME}
        row.update(split_rel_err(record.get("rel_err"), where))
        before = record.get("checkout")
        row.update(
            source_row=index,
            run=run,
            code="before" if before and "before" in str(before) else None,
            run_note=config.get("note") if before else _describe(runs.get(run)),
            **seed_environment(device),
            family="rbf",
            suite=record["family"],
            op=record["mode"],
            status=status_of(record.get("error")),
            pairs_per_s=_pairs_per_s(record),
        )
        rows.append(row)
    return rows


def _run_of(record: dict[str, Any], runs: dict[str, dict[str, Any]]) -> str:
    family, n = record["family"], record["n"]
    impl = str(record["impl"]).split("@")[0]
    if family == "kernel_mv_crossover":
        found = [name for name, run in runs.items() if "crossover" in str(run.get("script", ""))]
    else:
        found = [
            name
            for name, run in runs.items()
            if any(SECTION_FAMILY.get(s) == family for s in run.get("sections", []))
            and impl in run.get("impls", [])
            and n in run.get("ladder" if family == "kernel_mv_max_n" else "sizes", [])
        ]
    return found[0] if len(found) == 1 else FALLBACK_RUN


def _describe(run: dict[str, Any] | None) -> str | None:
    if not run:
        return None
    if "script" in run:
        return str(run["script"])
    parts = [f"sections {', '.join(run.get('sections', []))}"]
    if "repeats" in run:
        parts.append(f"{run['repeats']} repeats")
    if "timeout" in run:
        parts.append(f"timeout {run['timeout']} s")
    return "; ".join(parts)



def _pairs_per_s(record: dict[str, Any]) -> float | None:
    median_ms = record.get("median_ms")
    if median_ms is None or record.get("m") is None or not median_ms > 0:
        return None
    # Rows without a batch field (kde_density) are unbatched.
    return record["n"] * record["m"] * (record.get("batch") or 1) / (median_ms / 1e3)
