"""The run catalogue: one row per run (every file of one commit on one GPU), ordered by date,
with its provenance: the declared commit, the code hash of what ran and where it comes from.

The functions here count stored rows: give them the per-file rows (`load.StoredResults.rows`).
Numbers and keys only; the runs page (pages/runs.py) puts them into words.
"""

from __future__ import annotations

import pandas as pd

# The environment a run page shows, in this order (tidy-table columns).
ENVIRONMENT = [
    "device", "gpu_memory_gb", "gpu_driver", "compute_capability", "cuda", "jax", "jaxlib",
    "jax_cuda_plugin", "triton", "torch", "tokamax", "pykeops", "numpy", "python", "commit",
]


def _first(values: pd.Series):
    values = values.dropna()
    return values.iloc[0] if not values.empty else None


def _joined(values: pd.Series) -> str:
    return ", ".join(sorted({str(v) for v in values.dropna()}))


def _all_true(values: pd.Series):
    values = values.dropna()
    return bool(values.all()) if not values.empty else None


def _any_true(values: pd.Series):
    values = values.dropna()
    return bool(values.any()) if not values.empty else None


def catalogue(table: pd.DataFrame) -> pd.DataFrame:
    """One row per run: its environment (the first value its files record), ``date`` and
    ``started`` (its first file's), ``files`` (list), ``suites``, ``families``, ``codes``, the
    rows per status (each stored row counted once) and ``order`` (0 = oldest; missing for runs
    without a date, which cannot be placed in time). Provenance: ``code_hashes`` (the distinct
    code hashes of its files, comma-separated; usually one), ``code_hash_source`` (stored,
    declared), ``tree_matches_declared`` (stored provenance: every file's tree was the declared
    commit's; missing for declared labels), ``recorded_heads`` and ``recorded_dirty`` (what
    pytest-benchmark found on the GPU host), and ``same_code_runs`` (the other runs whose code
    hash is the same: identical src/ and tests/bench/). Sorted newest first, undated runs
    last."""
    per_row = table.drop_duplicates(["source_file", "source_row"])
    grouped = table.groupby("run", sort=False)
    runs = pd.DataFrame({
        **{column: grouped[column].agg(_first) for column in ENVIRONMENT},
        "date": grouped["date"].min(),
        "started": grouped["started"].min(),
        "files": grouped["source_file"].agg(lambda s: sorted(s.unique())),
        "formats": grouped["source_format"].agg(_joined),
        "suites": grouped["suite"].agg(_joined),
        "families": grouped["family"].agg(_joined),
        "codes": grouped["code"].agg(_joined),
        "note": grouped["run_note"].agg(_first),
        "bench_modes": grouped["bench_mode"].agg(_joined),
        # one budget per stored file (a file is one bench call), in file-name order
        "bench_budget_s": table.drop_duplicates(["run", "source_file"]).sort_values("source_file")
        .groupby("run", sort=False)["bench_budget_s"].agg(lambda s: s.dropna().tolist()),
        "bench_parts": grouped["bench_part"].agg(_joined),
        "code_hashes": grouped["code_hash"].agg(_joined),
        "code_hash_source": grouped["code_hash_source"].agg(_joined),
        "tree_matches_declared": grouped["tree_matches_declared"].agg(_all_true),
        "recorded_heads": grouped["recorded_head"].agg(_joined),
        "recorded_dirty": grouped["recorded_dirty"].agg(_any_true),
    })
    by_hash = runs[runs["code_hashes"] != ""].groupby("code_hashes").groups
    runs["same_code_runs"] = [
        sorted(set(by_hash.get(h, [])) - {run}) if h else []
        for run, h in zip(runs.index, runs["code_hashes"], strict=True)]
    counts = per_row.groupby(["run", "status"]).size().unstack("status")
    counts = counts.reindex(columns=["measured", "failed", "skipped"]).fillna(0).astype(int)
    runs = runs.join(counts).reset_index()
    runs = runs.sort_values(["date", "started", "run"], na_position="first")
    dated = runs["date"].notna()
    runs["order"] = float("nan")
    runs.loc[dated, "order"] = range(int(dated.sum()))
    return runs.iloc[::-1].reset_index(drop=True)


def run_order(table: pd.DataFrame) -> pd.Series:
    """run -> position in time (0 = oldest; missing for runs without a date)."""
    runs = catalogue(table)
    return pd.Series(runs["order"].to_numpy(), index=runs["run"])


def suite_status(table: pd.DataFrame) -> pd.DataFrame:
    """Per run and suite, the stored rows per status (measured, failed, skipped)."""
    per_row = table.drop_duplicates(["source_file", "source_row"])
    counts = per_row.groupby(["run", "family", "suite", "status"], dropna=False).size()
    counts = counts.unstack("status").reindex(columns=["measured", "failed", "skipped"])
    return counts.fillna(0).astype(int).reset_index()


def skip_reasons(table: pd.DataFrame) -> pd.DataFrame:
    """Per run, suite and reason, the skipped rows (the reason as stored)."""
    skipped = table[table["status"] == "skipped"].drop_duplicates(["source_file", "source_row"])
    return (skipped.groupby(["run", "suite", "error"], dropna=False).size()
            .rename("rows").reset_index())
