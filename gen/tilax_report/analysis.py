"""Derived tables the report pages share: labels, within-run comparisons, growth fits.

Numbers and keys only: the pages (pages/) put them into words. Speed is only ever compared
within one run on one device, between the run's one value per case (`repeats`: the median of
the repeats), inside a group keyed by (run, device, ...case), and only between rows measured in
at least one common file (one process; `share_a_file`), with a noise-aware verdict (`verdict`):
two single measurements of one file are judged by the within-run test, rows with repeats must
also be beyond the case's run-to-run spread. Superseded peer rows are never ranked nor used as
a baseline. Runs on different GPUs are put side by side separately and labelled as such
(`across_devices`); runs over time are in `history`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from . import verdict

RUN_KEYS = ["run", "device"]
# A case is one layer: another activation or router (sigmoid scores, bias, groups) is another
# case, never ranked against the softmax top-k rows of the same shape.
MOE_CONFIG = ["d_model", "d_hidden", "experts", "top_k", "shared_hidden", "skew", "activation",
              "router"]
MOE_CASE = [*MOE_CONFIG, "dtype", "op", "tokens"]
RBF_CONFIG = ["dim", "out", "batch"]
RBF_CASE = ["suite", *RBF_CONFIG, "op", "n", "m"]
# Codes in order of preference when undated runs of one file stand for a device in a headline.
CODE_RANK = {"final": 0, "intermediate": 1, "sweep": 2, "before": 3}


def with_labels(table: pd.DataFrame) -> pd.DataFrame:
    """Add key columns: ``label`` (impl as compared), ``config`` and ``gpu`` (the short GPU
    name), and name a missing device 'unknown GPU'."""
    frame = table.copy()
    # Pages group by device: a run that did not record its GPU still gets a group.
    frame["device"] = frame["device"].fillna("unknown GPU")
    frame["label"] = [_impl_label(r) for r in frame.itertuples(index=False)]
    frame["config"] = [_config_label(r) for r in frame.itertuples(index=False)]
    frame["gpu"] = frame["device"].map(short_gpu)
    return frame


def short_gpu(name: object) -> str:
    """'NVIDIA GeForce RTX 3090' -> 'RTX 3090': enough to tell the stored GPUs apart."""
    if not isinstance(name, str) or not name:
        return "unknown GPU"
    for prefix in ("NVIDIA ", "GeForce "):
        name = name.removeprefix(prefix)
    return name


def _impl_label(row) -> str:
    impl = row.impl if isinstance(row.impl, str) else ""
    if row.family != "moe":
        # a precision other than the default is another way to compute: its own label
        precision = f" ({row.precision})" if isinstance(row.precision, str) else ""
        # so is another kernel than the Gaussian (kernel_mv's Matérn kernels)
        profile = f" {row.profile}" if isinstance(row.profile, str) else ""
        return (impl or row.suite) + profile + precision
    if row.routing == "dense":
        return "dense routing" if impl in ("", "auto", "dense") else f"dense routing ({impl})"
    name = f"{impl}/{row.dispatch}" if isinstance(row.dispatch, str) else impl
    if pd.notna(row.recompute) and bool(row.recompute):  # memory-saving variant: its own line
        name += " +recompute"
    if isinstance(row.quantize, str):  # quantised experts (MoEConfig.quantize): its own line
        name += f" +{row.quantize}"
    if pd.notna(row.deterministic) and bool(row.deterministic):  # repeatable: its own line
        name += " +deterministic"
    if row.routing == "capacity":
        return f"capacity ({name})"
    return name or "?"


def _config_label(row) -> str:
    if row.family == "moe":
        parts = []
        if not pd.isna(row.experts):
            parts.append(f"E{row.experts} top-{row.top_k}")
        if not pd.isna(row.d_model):
            parts.append(f"d{row.d_model} h{row.d_hidden}")
        if not pd.isna(row.shared_hidden) and row.shared_hidden:
            parts.append(f"shared {row.shared_hidden}")
        # Balanced routing is the default: only a skewed router is named (the H100 file does
        # not record skew; its decoder cases count as balanced).
        if not pd.isna(row.skew) and row.skew:
            parts.append(f"skew {row.skew:g}")
        # SwiGLU experts are the default (and every run before the option): only another
        # activation is named, so its rows are a config of their own
        activation = getattr(row, "activation", None)
        if isinstance(activation, str) and activation != "swiglu":
            parts.append(activation)
        # Another router (sigmoid scores, bias, groups) is another layer: its own config.
        if isinstance(row.router, str) and row.router:
            parts.append(row.router)
        return " ".join(parts)
    if row.family == "rbf":
        parts = []
        if not pd.isna(row.dim):
            parts.append(f"dim {row.dim}")
        if not pd.isna(row.out):
            parts.append(f"out {row.out}")
        if not pd.isna(row.batch) and row.batch != 1:
            parts.append(f"batch {row.batch}")
        return ", ".join(parts)
    return ""


def config_order(frame: pd.DataFrame) -> list[str]:
    """The config labels of ``frame`` in numeric order (dim 2 before dim 32; E8 before E64)."""
    keys = [k for k in [*MOE_CONFIG, *RBF_CONFIG] if k in frame.columns]
    ordered = frame.sort_values(keys, na_position="first")["config"]
    return list(dict.fromkeys(ordered))


def failure_kind(message: object) -> str:
    """'out of memory', 'timeout' or 'error', for short table cells."""
    if not isinstance(message, str) or not message:
        return ""
    text = message.lower()
    if "timeout" in text:
        return "timeout"
    if "out of memory" in text or "resource_exhausted" in text:
        return "out of memory"
    return "error"


def timed(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows with a usable time: measured, with a median."""
    return frame[(frame["status"] == "measured") & frame["median_ms"].notna()]


def claimable(frame: pd.DataFrame) -> pd.DataFrame:
    """Timed rows that may back a claim (a headline, a ranking, a verdict): not superseded."""
    good = timed(frame)
    if "superseded" not in good:
        return good
    return good[~good["superseded"].fillna(False).astype(bool)]


def failures(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows that were attempted and failed (out of memory, timeout, error)."""
    return frame[frame["status"] == "failed"]


def skipped(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows that were never attempted (time budget, predicted failure, peer not installed)."""
    return frame[frame["status"] == "skipped"]


def status_counts(frame: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """Rows per ``keys`` and status: columns measured, failed, skipped (zeros filled in)."""
    counts = frame.groupby([*keys, "status"], dropna=False).size().unstack("status")
    counts = counts.reindex(columns=["measured", "failed", "skipped"]).fillna(0).astype(int)
    return counts.reset_index()


def _group(frame: pd.DataFrame, keys: Sequence[str]):
    return frame.groupby(list(keys), dropna=False, sort=False)


def rank_within_run(frame: pd.DataFrame, case: Sequence[str]) -> pd.DataFrame:
    """One row per (run, device, case) with at least two claimable labels (`claimable`): the
    fastest label (by the run's one value, the median of its repeats), the runner-up, their
    ratio and whether the noise allows calling it (``clear``, ``method``; see `verdict`);
    when the two share no stored file, no ratio (``method`` 'different files'). Also
    ``source_file`` (the fastest row's) and ``source_files`` (every file behind the ranked
    rows). Failed, skipped and superseded labels of the case are counted, not ranked."""
    keys = [*RUN_KEYS, *case]
    # Only the columns read below: picking rows of the whole tidy table is most of the cost.
    needed = [*keys, "code", "config", "label", "status", "rounds", "source_files",
              *verdict.FIELDS]
    frame = frame[list(dict.fromkeys(c for c in needed if c in frame))]
    out = []
    for key, rows in _group(frame, keys):
        good = claimable(rows).sort_values("median_ms")
        if good["label"].nunique() < 2:
            continue
        best, second, worst = good.iloc[0], good.iloc[1], good.iloc[-1]
        lead = verdict.compare(best, second)
        if not set(_as_files(best["source_files"])) & set(_as_files(second["source_files"])):
            lead = {**lead, "ratio": math.nan, "clear": None, "method": "different files"}
        out.append({
            **dict(zip(keys, key, strict=True)),
            "source_file": best["source_file"],
            "source_files": files_behind(good),
            "code": best["code"], "config": best["config"],
            "fastest": best["label"], "fastest_ms": best["median_ms"],
            "fastest_q1": best["q1_ms"], "fastest_q3": best["q3_ms"],
            "fastest_rounds": best["rounds"], "fastest_repeats": best["repeats"],
            "fastest_min": best["repeat_min_ms"], "fastest_max": best["repeat_max_ms"],
            "runner_up": second["label"], "runner_up_ms": second["median_ms"],
            "runner_up_q1": second["q1_ms"], "runner_up_q3": second["q3_ms"],
            "runner_up_rounds": second["rounds"], "runner_up_repeats": second["repeats"],
            "ratio": lead["ratio"], "clear": lead["clear"], "method": lead["method"],
            "slowest": worst["label"], "slowest_ratio": worst["median_ms"] / best["median_ms"],
            "labels": good["label"].nunique(),
            "failed": int((rows["status"] == "failed").sum()),
            "skipped": int((rows["status"] == "skipped").sum()),
            "superseded": int(rows["superseded"].fillna(False).astype(bool).sum()),
        })
    if not out:
        return pd.DataFrame(columns=[*keys, "source_file", "source_files", "code", "config",
                                     "fastest", "fastest_ms", "labels", "ratio", "clear",
                                     "method"])
    return pd.DataFrame(out).astype({k: frame[k].dtype for k in keys})


def files_behind(rows: pd.DataFrame) -> tuple[str, ...]:
    """Every stored file behind ``rows`` (``source_file`` and every repeat's file in
    ``source_files``), sorted: what a source line under a table or chart should link."""
    names = {f for files in rows["source_files"] if isinstance(files, tuple) for f in files}
    return tuple(sorted(names | set(rows["source_file"].dropna())))


def share_a_file(files: pd.Series, other: pd.Series) -> pd.Series:
    """Row by row: the two rows' repeats were measured in at least one common stored file (one
    process): the condition for forming a ratio between them."""
    return pd.Series([bool(set(_as_files(a)) & set(_as_files(b)))
                      for a, b in zip(files, other, strict=True)], index=files.index,
                     dtype=bool)


def _as_files(value) -> tuple:
    return value if isinstance(value, tuple) else ()


def speedups(frame: pd.DataFrame, case: Sequence[str], baseline: str) -> pd.DataFrame:
    """Every claimable row (`claimable`) with ``speedup`` = baseline median / its median, the
    baseline being the claimable row labelled ``baseline`` in the same run and case;
    ``speedup_lo``/``_hi`` bound it with the quartiles (baseline q1 / row q3, baseline q3 / row
    q1); ``clear`` and ``method`` the verdict. Cases without a timed baseline are left out."""
    keys = [*RUN_KEYS, *case]
    good = claimable(frame)
    fields = [c for c in [*verdict.FIELDS, "source_files"] if c not in keys]
    base = good[good["label"] == baseline][[*keys, *fields]]
    base = base.drop_duplicates(subset=keys)
    merged = good.merge(base, on=keys, how="inner", suffixes=("", "_base"))
    merged = merged[share_a_file(merged["source_files"], merged["source_files_base"])]
    merged["speedup"] = merged["median_ms_base"] / merged["median_ms"]
    merged["speedup_lo"] = merged["q1_ms_base"] / merged["q3_ms"]
    merged["speedup_hi"] = merged["q3_ms_base"] / merged["q1_ms"]
    base_rows = merged[[f"{c}_base" for c in fields]]
    base_rows.columns = fields
    judged = verdict.compare_frames(base_rows, merged)
    merged["clear"], merged["method"] = judged["clear"], judged["method"]
    merged["baseline"] = baseline
    return merged


def newest_per_device(ranked: pd.DataFrame, run_order: pd.Series) -> pd.DataFrame:
    """Per device, the ranked case of its newest run (``run_order``: run -> position in time,
    missing for undated runs, which rank after every dated one); among undated runs and among
    one run's cases, the latest code and the most labels."""
    if ranked.empty:
        return ranked
    order = ranked.assign(
        _when=-ranked["run"].map(run_order).fillna(-1),
        _code=ranked["code"].map(CODE_RANK).fillna(0), _labels=-ranked["labels"],
    ).sort_values(["_when", "_code", "_labels", "source_file", "run"])
    order = order.drop_duplicates(subset=["device"]).drop(columns=["_when", "_code", "_labels"])
    return order.sort_values("run", key=lambda r: -r.map(run_order).fillna(-1))


def growth_exponent(n: pd.Series, value: pd.Series) -> float:
    """Least-squares slope of log(value) against log(n): value ~ n**slope."""
    mask = n.notna() & value.notna() & (value > 0)
    x = np.log(n[mask].astype(float).to_numpy())
    y = np.log(value[mask].astype(float).to_numpy())
    if len(np.unique(x)) < 2:
        return math.nan
    return float(np.polyfit(x, y, 1)[0])


def memory_growth(frame: pd.DataFrame) -> pd.DataFrame:
    """Per run x suite x impl x op x config of the RBF memory suites: how peak memory grows with
    n (fit exponent over the steps that ran), the range measured and the first failure."""
    keys = [*RUN_KEYS, "suite", "op", "config", "label"]
    rows = frame[frame["suite"].isin(["kernel_mv_peak", "kernel_mv_max_n"])
                 & frame["max_n"].isna()]
    out = []
    for key, group in _group(rows, keys):
        group = group.sort_values("n")
        ran = group[(group["status"] == "measured") & group["peak_mb"].notna()]
        failed = group[group["status"] == "failed"]
        first_fail = failed.iloc[0] if not failed.empty else None
        record = dict(zip(keys, key, strict=True))
        record.update(
            n_min=ran["n"].min() if not ran.empty else pd.NA,
            n_max=ran["n"].max() if not ran.empty else pd.NA,
            peak_min=ran["peak_mb"].iloc[0] if not ran.empty else math.nan,
            peak_max=ran["peak_mb"].iloc[-1] if not ran.empty else math.nan,
            exponent=growth_exponent(ran["n"], ran["peak_mb"]),
            failed_at=first_fail["n"] if first_fail is not None else pd.NA,
            failure=first_fail["error"] if first_fail is not None else "",
            steps=len(group),
        )
        out.append(record)
    # the columns also when no run has memory rows (an RBF page of other suites only)
    return pd.DataFrame(out, columns=[*keys, "n_min", "n_max", "peak_min", "peak_max",
                                      "exponent", "failed_at", "failure", "steps"])


def across_devices(frame: pd.DataFrame, case: Sequence[str]) -> pd.DataFrame:
    """Timed rows whose (label, case) was measured on two or more devices."""
    good = timed(frame)
    keys = ["label", *case]
    counts = good.groupby(keys, dropna=False)["device"].transform("nunique")
    return good[counts >= 2]


def ladder_limits(ladder: pd.DataFrame, summary: pd.DataFrame, size: str, stated: str,
                  keys: Sequence[str]) -> pd.DataFrame:
    """How well each ladder's limit is known, from its own rows in the same run.

    One row per ladder (``keys``): ``ran`` the largest ``size`` that ran, ``failed`` the
    smallest larger size that failed and ``kind`` how (out of memory, timeout, error),
    ``lower_bound`` True when ``ran`` is only a lower bound of the limit: the failing size is
    more than double the one that ran (the ladder jumped past sizes it never tried) or no
    larger size failed. A summary row's ``limit_ran``/``limit_failed`` bracket and
    ``max_is_lower_bound`` (newer runs record them) take precedence; its ``stated`` value
    (max_tokens, max_n) counts as a size that ran. Also ``peak_mb`` and ``run_s`` of the
    largest size that ran, and ``summary`` (the summary row's index, or None).
    """
    keys = list(keys)
    summaries = {}
    for index, row in summary.iterrows():
        summaries[tuple(row[k] for k in keys)] = index
    groups = {key: group for key, group in ladder.groupby(keys, sort=False, dropna=False)}
    out = []
    for key in list(groups) + [k for k in summaries if k not in groups]:
        group = groups.get(key, ladder.iloc[0:0])
        row = summary.loc[summaries[key]] if key in summaries else None
        ran = group[group["status"] == "measured"].sort_values(size)
        largest = ran[size].max() if not ran.empty else pd.NA
        if row is not None and pd.notna(row[stated]) and (
                pd.isna(largest) or row[stated] > largest):
            largest = row[stated]
        failed = group[group["status"] == "failed"]
        if pd.notna(largest):
            failed = failed[failed[size] > largest]
        failed = failed.sort_values(size)
        record = dict(zip(keys, key, strict=True))
        last = ran[ran[size] == largest].tail(1) if pd.notna(largest) else ran.iloc[0:0]
        record.update(
            ran=largest,
            failed=failed[size].iloc[0] if not failed.empty else pd.NA,
            kind=failure_kind(failed["error"].iloc[0]) if not failed.empty else "",
            failure=failed["error"].iloc[0] if not failed.empty else "",
            peak_mb=last["peak_mb"].iloc[0] if not last.empty else float("nan"),
            run_s=last["run_s"].iloc[0] if not last.empty else float("nan"),
            summary=summaries.get(key), stopped="",
        )
        record["lower_bound"] = pd.notna(largest) and (
            pd.isna(record["failed"]) or record["failed"] > 2 * largest)
        if row is not None and pd.notna(row["limit_ran"]) and pd.notna(row["limit_failed"]):
            record.update(ran=row["limit_ran"], failed=row["limit_failed"], lower_bound=False)
            record["kind"] = (row["limit_kind"] if isinstance(row["limit_kind"], str)
                              else record["kind"] or "error")
        elif row is not None and pd.notna(row["max_is_lower_bound"]) and row["max_is_lower_bound"]:
            record["lower_bound"] = pd.notna(record["ran"])
            record["stopped"] = row["limit_kind"] if isinstance(row["limit_kind"], str) else ""
        out.append(record)
    columns = [*keys, "ran", "failed", "kind", "failure", "peak_mb", "run_s", "summary",
               "lower_bound", "stopped"]
    return pd.DataFrame(out, columns=columns)


def best_limit_per_ladder(limits: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """One ``ladder_limits`` row per ladder of a run (``keys``, without the file): a run's files
    may repeat a ladder, when a later call gave it the time an earlier one lacked. A bracketed
    limit wins over a lower bound, then the larger size that ran."""
    order = limits.assign(
        _bound=limits["lower_bound"].fillna(True).astype(bool),
        _ran=pd.to_numeric(limits["ran"], errors="coerce"),
    ).sort_values(["_bound", "_ran"], ascending=[True, False], na_position="last")
    return order.drop_duplicates(list(keys)).drop(columns=["_bound", "_ran"]).sort_index()
