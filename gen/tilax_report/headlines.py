"""The findings the site puts up front, computed from the stored rows (never typed in).

- Which MoE layer implementation was fastest for 32k-token bf16 train steps, per GPU, and by
  how much (ratios within one run).
- How peak memory grows with n for the RBF implementations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from . import analysis
from .render import fmt_int, fmt_ms, fmt_num, fmt_ratio, fmt_size

HEADLINE_CASE = {"tokens": 32768, "dtype": "bfloat16", "op": "train_step"}
MOE_BASELINES = ("dense routing", "ragged_dot/sorted")


@dataclass
class Finding:
    sentences: list[str]  # Markdown bullet texts
    table: pd.DataFrame  # formatted for display
    rows: pd.DataFrame  # tidy rows behind it (for source lines and charts)


def moe_layer_rows(table: pd.DataFrame) -> pd.DataFrame:
    return table[(table["family"] == "moe") & (table["suite"] == "layer")]


def moe_train_32k(table: pd.DataFrame) -> Finding:
    """Fastest MoE layer per run for 32k-token bf16 train steps (every config measured)."""
    rows = moe_layer_rows(table)
    for field, value in HEADLINE_CASE.items():
        rows = rows[rows[field] == value]
    ranked = rank_exact_moe(rows, analysis.MOE_CASE)
    sentences = []
    for _, best in analysis.primary_runs(ranked).iterrows():
        sentences.append(_moe_sentence(best, rows))
    display = ranked_display(ranked)
    return Finding(sentences, display, rows)


def rank_exact_moe(rows: pd.DataFrame, case: list[str]) -> pd.DataFrame:
    """Rank MoE layer implementations within each run and case, leaving capacity routing (it
    drops tokens, so it computes a different function) out of the ranking but reporting its
    time, and adding the slowdown of the dense-routing and ragged_dot baselines."""
    exact = rows[rows["routing"] != "capacity"]
    ranked = analysis.rank_within_run(exact, case)
    if ranked.empty:
        return ranked
    keys = [*analysis.RUN_KEYS, *case]
    for baseline in MOE_BASELINES:
        base = analysis.timed(exact[exact["label"] == baseline])[[*keys, "median_ms"]]
        merged = ranked.merge(base.drop_duplicates(subset=keys), on=keys, how="left")
        ranked[f"vs {baseline}"] = (merged["median_ms"] / merged["fastest_ms"]).to_numpy()
    capacity = analysis.timed(rows[rows["routing"] == "capacity"])[[*keys, "median_ms"]]
    merged = ranked.merge(capacity.drop_duplicates(subset=keys), on=keys, how="left")
    ranked["capacity_ms"] = merged["median_ms"].to_numpy()
    return ranked


def _moe_sentence(best: pd.Series, rows: pd.DataFrame) -> str:
    code = f", {best['code']} code" if isinstance(best["code"], str) else ""
    text = (
        f"**{best['device']}** (run `{best['run']}`{code}, {best['config']}): "
        f"**{best['fastest']}** was fastest at "
        f"{fmt_ms(best['fastest_ms'], best['fastest_q1'], best['fastest_q3'], 'ms')}, "
        f"**{fmt_ratio(best['ratio'])}** faster than the next, {best['runner_up']}"
    )
    extras = [
        f"{fmt_ratio(best[f'vs {b}'])} faster than {b}"
        for b in MOE_BASELINES
        if not pd.isna(best.get(f"vs {b}")) and b not in (best["fastest"], best["runner_up"])
    ]
    if extras:
        text += "; " + ", ".join(extras)
    text += "."
    if not pd.isna(best.get("capacity_ms")):
        text += (f" Capacity routing, which drops the tokens over each expert's capacity, took "
                 f"{fmt_ms(best['capacity_ms'])} ms.")
    return text


def rbf_memory(table: pd.DataFrame) -> Finding:
    """Peak memory growth with n per RBF implementation (peak-memory and max-n ladders)."""
    rows = table[(table["family"] == "rbf")
                 & table["suite"].isin(["kernel_mv_peak", "kernel_mv_max_n"])
                 & table["max_n"].isna()]
    growth = analysis.memory_growth(rows)
    sentences = []
    if not growth.empty:
        for device, per_device in growth.groupby("device", sort=False):
            peak = per_device[per_device["suite"] == "kernel_mv_peak"]
            focus = peak if not peak.empty else per_device
            for op, per_op in focus.groupby("op", sort=True):
                parts = [_growth_phrase(r) for _, r in per_op.sort_values("label").iterrows()]
                sentences.append(
                    f"**{device}**, {focus['suite'].iloc[0]} {op} "
                    f"({per_op['config'].iloc[0]}): " + "; ".join(parts) + "."
                )
    display = pd.DataFrame({
        "GPU": growth["device"].map(analysis.short_gpu),
        "run": growth["run"],
        "suite": growth["suite"],
        "op": growth["op"],
        "config": growth["config"],
        "impl": growth["label"],
        "n measured": [f"{fmt_int(r.n_min)} – {fmt_int(r.n_max)}" for r in growth.itertuples()],
        "peak MiB at smallest n": growth["peak_min"].map(lambda v: fmt_num(v, 3)),
        "peak MiB at largest n": growth["peak_max"].map(lambda v: fmt_num(v, 3)),
        "grows like n^": growth["exponent"].map(lambda e: "" if pd.isna(e) else f"{e:.2f}"),
        "first failure at n": growth["failed_at"].map(fmt_int),
        "failure": growth["failure"].map(analysis.failure_kind),
    }) if not growth.empty else pd.DataFrame()
    return Finding(sentences, display, rows)


def _growth_phrase(row: pd.Series) -> str:
    text = (f"**{row['label']}** {fmt_num(row['peak_min'], 3)} → "
            f"{fmt_num(row['peak_max'], 3)} MiB "
            f"for n {fmt_int(row['n_min'])} → {fmt_int(row['n_max'])}")
    if not math.isnan(row["exponent"]):
        text += f" (~n^{row['exponent']:.2f})"
    if not pd.isna(row["failed_at"]):
        kind = "timed out" if "timeout" in row["failure"].lower() else "failed"
        oom = " (out of memory)" if "memory" in row["failure"].lower() else ""
        text += f", {kind}{oom} at n {fmt_int(row['failed_at'])}"
    return text


def decoder_fastest(table: pd.DataFrame) -> list[str]:
    """Per run and op of the MoE decoder suite: the fastest impl/dispatch at each token count,
    and its lead over the runner-up."""
    rows = table[(table["family"] == "moe") & (table["suite"] == "decoder")]
    ranked = analysis.rank_within_run(rows, ["config", "dtype", "op", "tokens"])
    sentences = []
    for (device, run, op), per_op in ranked.groupby(["device", "run", "op"], sort=False):
        parts = [
            f"{fmt_size(r.tokens)} tokens **{r.fastest}** "
            f"{fmt_ms(r.fastest_ms, r.fastest_q1, r.fastest_q3, 'ms')} "
            f"({lead_phrase(r.ratio, r.runner_up)})"
            for r in per_op.sort_values("tokens").itertuples()
        ]
        sentences.append(f"MoE decoder {op} on **{device}** (run `{run}`): "
                         + "; ".join(parts) + ".")
    return sentences


def lead_phrase(ratio: float, runner_up: str) -> str:
    """'1.21× ahead of X', or 'tied with X' when the medians are within 1%."""
    if ratio < 1.01:
        return f"within 1% of {runner_up}"
    return f"{fmt_ratio(ratio)} ahead of {runner_up}"


def rbf_fastest_at_largest_n(table: pd.DataFrame) -> list[str]:
    """Per run of kernel_mv: at its largest n, how often each impl was fastest and the range of
    its lead over xla."""
    rows = table[(table["family"] == "rbf") & (table["suite"] == "kernel_mv")]
    sentences = []
    for (device, run), per_run in rows.groupby(["device", "run"], sort=False):
        largest = per_run[per_run["n"] == per_run["n"].max()]
        ranked = analysis.rank_within_run(largest, ["config", "op", "n"])
        if ranked.empty:
            continue
        wins = ranked["fastest"].value_counts()
        speed = analysis.speedups(largest, ["config", "op", "n"], "xla")
        parts = []
        for label, count in wins.items():
            lead = speed[speed["label"] == label]["speedup"]
            span = (f" ({fmt_ratio(lead.min())}–{fmt_ratio(lead.max())} vs xla)"
                    if label != "xla" and not lead.empty else "")
            parts.append(f"**{label}** fastest in {count} of {len(ranked)} cases{span}")
        sentences.append(
            f"RBF kernel_mv on **{device}** at n = {fmt_int(largest['n'].iloc[0])} (run `{run}`): "
            + "; ".join(parts) + "."
        )
    return sentences


def ranked_display(ranked: pd.DataFrame, case_columns: tuple[str, ...] = ()) -> pd.DataFrame:
    """The table of `rank_exact_moe` as shown on the pages (``case_columns``: extra case
    fields to show, e.g. dtype, op, tokens)."""
    if ranked.empty:
        return pd.DataFrame()
    columns = {
        "GPU": ranked["device"].map(analysis.short_gpu),
        "run (code)": [f"{r.run} ({r.code})" if isinstance(r.code, str) else r.run
                       for r in ranked.itertuples()],
        "config": ranked["config"],
    }
    for field in case_columns:
        columns[field] = ranked[field].map(fmt_int) if field == "tokens" else ranked[field]
    columns.update({
        "fastest exact impl": ranked["fastest"],
        "median ms (q1–q3)": [fmt_ms(r.fastest_ms, r.fastest_q1, r.fastest_q3)
                              for r in ranked.itertuples()],
        "runner-up": ranked["runner_up"],
        "runner-up slower by": ranked["ratio"].map(fmt_ratio),
        "dense routing slower by": ranked["vs dense routing"].map(fmt_ratio),
        "ragged_dot slower by": ranked["vs ragged_dot/sorted"].map(fmt_ratio),
        "capacity routing ms": ranked["capacity_ms"].map(fmt_ms),
        "failed cases": ranked["failed"],
    })
    return pd.DataFrame(columns)
