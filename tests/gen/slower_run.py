"""A newer copy of a stored run with every time scaled: the history tests' regression (imported
by name: keep it unique)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

TIME_STATS = ("min", "max", "mean", "median", "q1", "q3", "iqr", "stddev", "total", "ld15iqr",
              "hd15iqr")


def write_slower_copy(source: Path, results_dir: Path, factor: float, commit: str,
                      days_later: int = 1, code_hash: str | None = None) -> Path:
    """Write a copy of the pytest-benchmark file ``source`` as a newer run: commit
    ``commit``, dated ``days_later`` days after it, every time multiplied by ``factor``
    (throughput divided by it). With ``code_hash``, the copy records bench-time provenance
    (``machine_info.tilax_provenance``: that hash, ``commit`` declared, tree matching): give
    the source's hash for a run of identical code. Returns the new file's path, named like
    the bench names files (<gpu>-<yyyymmdd>-<commit>-<tag>.json)."""
    doc = json.loads(source.read_text())
    started = datetime.datetime.fromisoformat(doc["datetime"]) + datetime.timedelta(days_later)
    doc["datetime"] = started.isoformat()
    doc["machine_info"]["commit"] = commit
    doc["commit_info"] = {"id": "unknown"}
    if code_hash is not None:
        doc["machine_info"]["tilax_provenance"] = {
            "code_hash": code_hash, "declared_commit": commit, "tree_matches_declared": True}
    for bench in doc["benchmarks"]:
        stats, info = bench.get("stats") or {}, bench["extra_info"]
        for key in TIME_STATS:
            if isinstance(stats.get(key), (int, float)):
                stats[key] *= factor
        if isinstance(stats.get("data"), list):
            stats["data"] = [value * factor for value in stats["data"]]
        if isinstance(stats.get("ops"), (int, float)):
            stats["ops"] /= factor
        for key in ("tflops", "pairs_per_s", "tokens_per_s", "gbps"):
            if isinstance(info.get(key), (int, float)):
                info[key] /= factor
        if isinstance(info.get("child_times_s"), list):
            info["child_times_s"] = [value * factor for value in info["child_times_s"]]
    gpu, _date, _commit, *tag = source.stem.split("-")
    name = "-".join([gpu, f"{started:%Y%m%d}", commit, *tag]) + ".json"
    path = results_dir / name
    path.write_text(json.dumps(doc))
    return path
