"""History: the same benchmark case across runs on the same GPU, its changes, and the between-run
noise model that says which changes are beyond the noise.

A *case* (`CASE`) is everything that says what was measured (suite, implementation, shapes,
dtype, op, knobs) on one GPU model; the backend a default implementation picked may change
between runs, and that change is what history shows. The timeline holds one point per run (the
run's one value: the median of its repeats, `repeats`), and the changes compare each run with
the previous run that measured the case.

Noise between runs: the stored measurements of one case made with identical code (same
``code_hash``: several files of one run, or runs filed under different commits whose ``src/``
and ``tests/bench/`` are identical) differ by the run-to-run spread alone. Per group of
identical-code measurements of a case, the spread is log(max / min) of their medians. A spread
more than `FENCE_MAD` robust standard deviations (the scaled median absolute deviation) above
the median of all of them is a fault (a throttled or broken machine), not noise, and is left
out. A case's ``run_spread`` is the largest of its remaining
spreads, and never below the *floor*: the `FLOOR_QUANTILE` quantile of the spreads within the
fence on that GPU (of every GPU's groups when that GPU has fewer than `MIN_FLOOR_GROUPS`). The
floor stands in where a case has no repeat, and bounds a case whose two repeats agreed by
chance. A change between runs is flagged only when it passes the within-run test **and**
exceeds that spread (`verdict.compare`): identical-code runs are never flagged for a difference
within the noise, since their values lie within the spread they define, while a run 1.3x slower
on every case is flagged even on identical code.

Runs on different GPUs never share a timeline; runs without a date (the seed files) cannot be
placed in time and are left out. Numbers and keys only; pages/history.py words them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.stats import median_abs_deviation

from . import schema, verdict

# Columns that together say what a row measured across runs (with the GPU, `device`).
CASE = [c for c in schema.CASE_COLUMNS if c not in ("code", "fwd_backend", "bwd_backend",
                                                    "summary")]
POINT = ["run", "source_file", "source_files", "commit", "code_hash", "code_hash_source",
         "date", "started", "label", "config", "median_ms", "q1_ms", "q3_ms", "rounds",
         "round_ms", "repeats", "repeat_min_ms", "repeat_max_ms", "spread_stored", "superseded",
         "run_spread", "run_spread_basis"]
FLOOR_QUANTILE = 0.95
MIN_FLOOR_GROUPS = 10
FENCE_MAD = 8.0


def _timed(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[(frame["status"] == "measured") & frame["median_ms"].notna()
                 & ~frame["summary"].fillna(False).astype(bool)]


def _case_key(frame: pd.DataFrame, columns: list[str]) -> pd.Series:
    """One number per distinct combination of ``columns`` (missing values equal each other)."""
    return pd.util.hash_pandas_object(frame[columns], index=False)


def identical_code_groups(rows: pd.DataFrame) -> pd.DataFrame:
    """Per device, code hash and case with two or more timed stored rows (the per-file rows,
    `load.StoredResults.rows`): ``measurements``, ``runs``, ``min_ms``, ``max_ms`` and
    ``log_range`` = log(max / min)."""
    timed = _timed(rows)
    timed = timed[timed["code_hash"].notna()]
    keys = ["device", "code_hash", *CASE]
    grouped = timed.assign(_case=_case_key(timed, ["device", *CASE])).groupby(
        [*keys, "_case"], dropna=False, sort=False)
    groups = grouped.agg(measurements=("median_ms", "size"), runs=("run", "nunique"),
                         min_ms=("median_ms", "min"), max_ms=("median_ms", "max"))
    groups = groups[groups["measurements"] >= 2].reset_index()
    groups["log_range"] = np.log(groups["max_ms"] / groups["min_ms"])
    return groups


def _limits(log_range: pd.Series) -> pd.Series:
    fence = log_range.median() + FENCE_MAD * median_abs_deviation(log_range, scale="normal")
    return pd.Series({"fence": fence, "floor": log_range[log_range <= fence].quantile(
        FLOOR_QUANTILE), "groups": len(log_range)})


def noise_limits(groups: pd.DataFrame) -> pd.DataFrame:
    """Per device: ``fence`` (an identical-code spread above it is a fault, not noise: the
    median of the groups' spreads plus `FENCE_MAD` robust standard deviations, the scaled
    median absolute deviation, which a faulty run among them barely moves),
    ``floor`` (the `FLOOR_QUANTILE` quantile of the spreads within the fence) and ``groups``;
    from every device's groups together when a device has fewer than `MIN_FLOOR_GROUPS`."""
    if groups.empty:
        return pd.DataFrame(columns=["fence", "floor", "groups"], dtype="float64")
    pooled = _limits(groups["log_range"])
    rows = {}
    for device, per_device in groups.groupby("device", sort=False):
        rows[device] = (_limits(per_device["log_range"])
                        if len(per_device) >= MIN_FLOOR_GROUPS else pooled)
    return pd.DataFrame(rows).T


def spread_floor(groups: pd.DataFrame) -> pd.Series:
    """device -> the floor of the run-to-run spread (see the module docstring)."""
    return noise_limits(groups)["floor"].astype("float64")


def with_run_spread(table: pd.DataFrame, rows: pd.DataFrame) -> pd.DataFrame:
    """``table`` with ``run_spread`` and ``run_spread_basis`` from the identical-code groups of
    ``rows`` (the per-file rows): 'identical code' where the case's own spread (within the
    fence) is above the floor, 'floor' elsewhere, 'no identical-code repeats stored' (and no
    spread) when the data hold none at all."""
    groups = identical_code_groups(rows)
    limits = noise_limits(groups)
    if groups.empty:
        return table.assign(run_spread=np.nan, run_spread_basis=pd.Series(
            "no identical-code repeats stored", index=table.index, dtype="str"))
    noise = groups[groups["log_range"] <= groups["device"].map(limits["fence"])]
    own = noise.groupby("_case")["log_range"].max()
    case_spread = _case_key(table, ["device", *CASE]).map(own)
    device_floor = table["device"].map(limits["floor"]).fillna(
        _limits(groups["log_range"])["floor"]).astype("float64")
    spread = np.fmax(case_spread, device_floor)
    basis = np.where(case_spread > device_floor, "identical code", "floor")
    return table.assign(run_spread=spread.astype("float64"),
                        run_spread_basis=pd.Series(basis, index=table.index, dtype="str"))


def timeline(table: pd.DataFrame, run_order: pd.Series) -> pd.DataFrame:
    """One row per (device, case, run) for cases measured in two or more dated runs on the same
    device: the run's value (median of its repeats) with its spread, ``order`` (the run's place
    in time) and ``case_id`` (a number per device and case)."""
    rows = _timed(table)
    rows = rows[rows["date"].notna()]
    if rows.empty:
        return pd.DataFrame(columns=["device", *CASE, *POINT, "order", "case_id"])
    rows = rows.assign(order=rows["run"].map(run_order))
    # A backend change inside one run would leave two rows of one case: the better measured
    # one stands for the run.
    rows = rows.sort_values(["order", "repeats", "started", "source_file"])
    keys = ["device", *CASE]
    rows = rows.assign(_case=_case_key(rows, keys))
    rows = rows.drop_duplicates(["_case", "run"], keep="last")
    runs_per_case = rows.groupby("_case")["run"].transform("nunique")
    rows = rows[runs_per_case >= 2]
    rows = rows.assign(case_id=rows.groupby("_case", sort=False).ngroup())
    return rows[["device", *CASE, *POINT, "order", "case_id"]].reset_index(drop=True)


SIDE = ["run", "commit", "code_hash", "date", "source_file", "source_files", "median_ms",
        "q1_ms", "q3_ms", "rounds", "repeats", "repeat_min_ms", "repeat_max_ms"]


def changes(points: pd.DataFrame) -> pd.DataFrame:
    """One row per case and pair of consecutive runs that measured it: the case, ``before_*``
    and ``after_*`` (`SIDE`), ``same_code`` (both runs' code hashes known and equal),
    ``run_spread`` (the larger of the two rows') and the verdict (``ratio`` = after / before,
    above 1: slower; ``clear``; ``method``; ``p_value``)."""
    if points.empty:
        return pd.DataFrame(columns=["device", "case_id", *CASE, "label", "config",
                                     *[f"before_{c}" for c in SIDE],
                                     *[f"after_{c}" for c in SIDE], "same_code", "run_spread",
                                     "ratio", "clear", "method", "p_value"])
    points = points.sort_values(["case_id", "order"])
    before = points.groupby("case_id").shift(1)
    pairs = points[before["run"].notna()]
    before = before[before["run"].notna()]
    result = verdict.compare_frames(before, pairs)
    out = pairs[["device", "case_id", *CASE, "label", "config"]].copy()
    for side, frame in (("before", before), ("after", pairs)):
        for column in SIDE:
            out[f"{side}_{column}"] = frame[column].to_numpy()
    out["same_code"] = (out["before_code_hash"].notna()
                        & out["before_code_hash"].eq(out["after_code_hash"])).to_numpy(bool)
    out["run_spread"] = np.fmax(before["run_spread"].to_numpy(float),
                                pairs["run_spread"].to_numpy(float))
    return pd.concat([out, result], axis=1).reset_index(drop=True)


def run_pairs(change_rows: pd.DataFrame) -> pd.DataFrame:
    """Per device and pair of consecutive runs: cases compared, clearly slower, clearly
    faster, no clear difference, not judged, ``same_code`` (every case compared had identical
    code on both sides), the median ratio of the clearly slower and of the clearly faster
    cases and of all compared cases; newest pair first, as the history page lists them."""
    keys = ["device", "before_run", "before_commit", "before_date", "after_run",
            "after_commit", "after_date"]
    if change_rows.empty:
        return pd.DataFrame(columns=[*keys, "compared", "slower", "faster", "tie", "unjudged",
                                     "same_code", "slower_ratio", "faster_ratio",
                                     "median_ratio"])
    frame = change_rows.assign(
        slower=change_rows["clear"].eq(True) & (change_rows["ratio"] > 1),
        faster=change_rows["clear"].eq(True) & (change_rows["ratio"] < 1),
        tie=change_rows["clear"].eq(False),
        unjudged=change_rows["clear"].isna(),
    )
    grouped = frame.groupby(keys, dropna=False, sort=False)
    summary = grouped.agg(compared=("ratio", "size"), slower=("slower", "sum"),
                          faster=("faster", "sum"), tie=("tie", "sum"),
                          unjudged=("unjudged", "sum"), same_code=("same_code", "all"),
                          median_ratio=("ratio", "median"))
    summary["slower_ratio"] = frame[frame["slower"]].groupby(keys, dropna=False)["ratio"].median()
    summary["faster_ratio"] = frame[frame["faster"]].groupby(keys, dropna=False)["ratio"].median()
    return summary.reset_index().sort_values(["after_date", "after_run"], ascending=False,
                                             kind="stable").reset_index(drop=True)


def regressions(pairs: pd.DataFrame, share: float = 0.5) -> pd.DataFrame:
    """The run pairs (of `run_pairs`) where most compared cases got clearly slower (at least
    ``share`` of them): a slower run, whatever its cause, is the first thing the history page
    says."""
    flagged = pairs[(pairs["compared"] > 0) & (pairs["slower"] >= share * pairs["compared"])]
    return flagged.reset_index(drop=True)
