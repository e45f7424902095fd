"""History: the same benchmark case across runs on the same GPU, and its changes.

A *case* is everything that says what was measured (suite, implementation, shapes, dtype, op,
knobs) on one GPU model. For each case measured in more than one dated run on that GPU, the
timeline holds one point per run and the changes compare each run with the previous run that
measured the case, with the same noise-aware verdict as the within-run comparisons (`verdict`).
Runs on different GPUs never share a timeline; runs without a date (the seed files) cannot be
placed in time and are left out. Numbers and keys only; pages/history.py words them.
"""

from __future__ import annotations

import pandas as pd

from . import verdict
from .analysis import timed

# Columns that together say what a row measured (with the GPU, `device`).
CASE = [
    "family", "suite", "impl", "dispatch", "routing", "dtype", "op", "piece", "precision",
    "tokens", "d_model", "d_hidden", "experts", "top_k", "shared_hidden", "skew", "block_m",
    "slab_elems", "n", "m", "dim", "out", "batch", "block_q", "block_k", "block_o", "repeat",
    "resolution", "model_dim", "part", "devices", "exchange", "exchange_chunks", "path",
    "kernel", "block_p",
    "block_l", "num_warps", "num_stages", "bwd_backend",
]
POINT = ["run", "source_file", "commit", "date", "started", "label", "config", "median_ms",
         "q1_ms", "q3_ms", "rounds", "round_ms"]


def timeline(table: pd.DataFrame, run_order: pd.Series) -> pd.DataFrame:
    """One row per (device, case, run) for cases measured in two or more dated runs on the same
    device: the run's median with its spread, ``order`` (the run's place in time) and
    ``case_id`` (a number per device and case). A case measured twice in one run (two files)
    counts once, from the file written last."""
    rows = timed(table)
    rows = rows[rows["date"].notna() & ~rows["summary"].fillna(False).astype(bool)]
    if rows.empty:
        return pd.DataFrame(columns=["device", *CASE, *POINT, "order", "case_id"])
    rows = rows.assign(order=rows["run"].map(run_order))
    rows = rows.sort_values(["order", "started", "source_file"])
    keys = ["device", *CASE]
    rows = rows.drop_duplicates([*keys, "run"], keep="last")
    runs_per_case = rows.groupby(keys, dropna=False)["run"].transform("nunique")
    rows = rows[runs_per_case >= 2]
    rows = rows.assign(case_id=rows.groupby(keys, dropna=False, sort=False).ngroup())
    return rows[["device", *CASE, *POINT, "order", "case_id"]].reset_index(drop=True)


def changes(points: pd.DataFrame) -> pd.DataFrame:
    """One row per case and pair of consecutive runs that measured it: the case, ``before_*``
    and ``after_*`` (run, commit, date, file, median, q1, q3, rounds) and the verdict
    (``ratio`` = after / before, above 1: slower; ``clear``; ``method``; ``p_value``)."""
    if points.empty:
        return pd.DataFrame(columns=["device", "case_id", "label", "config", "ratio", "clear"])
    points = points.sort_values(["case_id", "order"])
    before = points.groupby("case_id").shift(1)
    pairs = points[before["run"].notna()]
    before = before[before["run"].notna()]
    result = verdict.compare_frames(before, pairs)
    out = pairs[["device", "case_id", *CASE, "label", "config"]].copy()
    for side, frame in (("before", before), ("after", pairs)):
        for column in ["run", "commit", "date", "source_file", "median_ms", "q1_ms", "q3_ms",
                       "rounds"]:
            out[f"{side}_{column}"] = frame[column].to_numpy()
    return pd.concat([out, result], axis=1).reset_index(drop=True)


def run_pairs(change_rows: pd.DataFrame) -> pd.DataFrame:
    """Per device and pair of consecutive runs: cases compared, clearly slower, clearly
    faster, no clear difference, not judged (no spread), and the median ratio of the clearly
    slower and of the clearly faster cases."""
    if change_rows.empty:
        return pd.DataFrame(columns=["device", "before_run", "after_run", "compared"])
    frame = change_rows.assign(
        slower=change_rows["clear"].eq(True) & (change_rows["ratio"] > 1),
        faster=change_rows["clear"].eq(True) & (change_rows["ratio"] < 1),
        tie=change_rows["clear"].eq(False),
        unjudged=change_rows["clear"].isna(),
    )
    keys = ["device", "before_run", "before_commit", "before_date", "after_run",
            "after_commit", "after_date"]
    grouped = frame.groupby(keys, dropna=False, sort=False)
    summary = grouped.agg(compared=("ratio", "size"), slower=("slower", "sum"),
                          faster=("faster", "sum"), tie=("tie", "sum"),
                          unjudged=("unjudged", "sum"))
    summary["slower_ratio"] = frame[frame["slower"]].groupby(keys, dropna=False)["ratio"].median()
    summary["faster_ratio"] = frame[frame["faster"]].groupby(keys, dropna=False)["ratio"].median()
    return summary.reset_index()
