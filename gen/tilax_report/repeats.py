"""One value per case and run: the stored rows of one run that measured the same case (one row
per file, or repeated rows of one seed run) become one row.

The row's time is the **median of the repeats' medians** (``median_ms``), with ``repeats`` (how
many timed rows), ``repeat_min_ms``/``repeat_max_ms`` (their range) and ``source_files`` (the
files they came from); its quartiles are the medians of the repeats' quartiles (so q1 <= median
<= q3 still holds), ``rounds`` and ``round_ms`` pool every repeat's rounds, and the other
measurements (throughput, power, memory, errors) are medians too, throughput rescaled to the
median time. ``source_file``/``source_row`` name the repeat nearest the median (the stored row
whose number the site shows when the count is odd). A case with no timed repeat keeps its first
failed row (else its first skipped row), with ``attempts`` counting every row. Ladder summary
rows (they time nothing, and each file's states its own limit) are kept as stored.

The per-file rows stay available (`load.StoredResults.rows`) for the raw-data page.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from . import schema

RUN_CASE = ["run", "device", *schema.CASE_COLUMNS]
# Measurements that become the median of the repeats (besides median, q1 and q3).
MEDIAN_OF_REPEATS = [
    "compile_s", "sync_call_s", "run_s", "power_w", "sm_clock_mhz", "power_samples",
    "peak_mb", "xla_temp_mb", "xla_arg_mb", "xla_out_mb", "max_expert_frac", "empty_experts",
    "rel_err", "rel_err_dq", "rel_err_dk", "rel_err_dv", "rel_err_dlengthscale", "rel_err_out",
    "rel_err_grad_x", "rel_err_grad_params", "rel_err_out_vs_one_device",
]
# Per unit of time: scaled by (the nearest repeat's median / the collapsed median).
THROUGHPUT = ["tflops", "pairs_per_s", "tokens_per_s", "gbps", "touched_weight_gbps"]


def single_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with the repeat columns of rows that stand alone (one stored row each)."""
    timed = (rows["status"] == "measured") & rows["median_ms"].notna()
    return rows.assign(
        repeats=timed.astype("Int64"),
        attempts=pd.array(np.ones(len(rows), dtype=int), dtype="Int64"),
        repeat_min_ms=rows["median_ms"].where(timed),
        repeat_max_ms=rows["median_ms"].where(timed),
        source_files=pd.Series([(name,) for name in rows["source_file"]], index=rows.index,
                               dtype="object"),
    )


def collapse(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per run, device and case (`schema.CASE_COLUMNS`): see the module docstring.
    ``rows`` is the per-file table (`schema.COLUMNS`); the result has the same columns, in the
    order of the rows' first appearance."""
    rows = single_rows(rows)
    summary = rows["summary"].fillna(False).astype(bool)
    group = rows.groupby(RUN_CASE, dropna=False, sort=False).ngroup()
    # summary rows stand alone: a unique negative group each
    group = group.where(~summary, -1 - np.arange(len(rows)))
    size = group.map(group.value_counts())
    repeated = rows[size > 1].assign(_group=group[size > 1])
    if repeated.empty:
        return rows.reset_index(drop=True)
    merged = _merge_groups(repeated)
    out = pd.concat([rows[size == 1].assign(_group=group[size == 1]), merged])
    first_seen = group.drop_duplicates()
    order = pd.Series(np.arange(len(first_seen)), index=first_seen.to_numpy())
    out = out.iloc[np.argsort(out["_group"].map(order).to_numpy(), kind="stable")]
    return schema.conform(out.drop(columns="_group"))


def _merge_groups(rows: pd.DataFrame) -> pd.DataFrame:
    timed = rows[(rows["status"] == "measured") & rows["median_ms"].notna()]
    by = timed.groupby("_group", sort=False)
    stats = by["median_ms"].agg(["median", "min", "max", "size"])
    # The base row of a group with timed repeats: the repeat nearest the group's median
    # (the earlier file on a tie); of a group without: its first failed, else first, row.
    distance = (timed["median_ms"] - timed["_group"].map(stats["median"])).abs()
    nearest = (timed.assign(_distance=distance).sort_values(["_distance", "source_file"])
               .drop_duplicates("_group"))
    untimed = rows[~rows["_group"].isin(stats.index)]
    first = (untimed.assign(_failed=untimed["status"] != "failed")
             .sort_values(["_failed", "source_file", "source_row"]).drop_duplicates("_group")
             .drop(columns="_failed"))
    base = pd.concat([nearest.drop(columns="_distance"), first]).set_index("_group")

    all_rows = rows.groupby("_group", sort=False)
    base["attempts"] = all_rows.size()
    base["source_files"] = all_rows["source_file"].agg(lambda s: tuple(sorted(set(s))))
    base["repeats"] = stats["size"].reindex(base.index).fillna(0).astype("Int64")
    base["repeat_min_ms"] = stats["min"]
    base["repeat_max_ms"] = stats["max"]
    has_time = base.index.isin(stats.index)
    nearest_ms = base["median_ms"].copy()
    base.loc[has_time, "median_ms"] = stats["median"]
    base.loc[has_time, "q1_ms"] = by["q1_ms"].median()
    base.loc[has_time, "q3_ms"] = by["q3_ms"].median()
    base.loc[has_time, "rounds"] = by["rounds"].sum(min_count=1)
    pooled = by["round_ms"].agg(_pooled)
    base["round_ms"] = [pooled[g] if g in pooled.index else r
                        for g, r in zip(base.index, base["round_ms"], strict=True)]
    medians = by[MEDIAN_OF_REPEATS].median()
    for column in MEDIAN_OF_REPEATS:
        values = medians[column].reindex(base.index)
        if schema.COLUMNS[column][0] == "Int64":
            values = values.round()
        base.loc[has_time, column] = values[has_time]
    scale = (nearest_ms / base["median_ms"]).where(has_time, 1.0)
    for column in THROUGHPUT:
        base[column] = base[column] * scale
    return base.reset_index()


def _pooled(values: pd.Series):
    """The rounds of every repeat as one tuple; None when a repeat stored none (a pooled set
    missing a repeat would weight the others)."""
    if any(not isinstance(v, tuple) for v in values):
        return None
    return tuple(x for v in values for x in v)
