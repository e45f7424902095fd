"""The findings the site puts up front, computed from the stored rows (never typed in).

Numbers only (pages/_shared.py words them):

- which MoE layer implementation was fastest for 32k-token bf16 train steps, per GPU, from the
  newest run on that GPU that measured the case (ratios within one file);
- how peak memory grows with n for the RBF implementations;
- the fastest decoder implementation per token count, and the kernel_mv winners at the largest n.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from . import analysis

HEADLINE_CASE = {"tokens": 32768, "dtype": "bfloat16", "op": "train_step"}
MOE_BASELINES = ("dense routing", "ragged_dot/sorted")


@dataclass
class Finding:
    rows: pd.DataFrame  # the tidy rows behind it (for source lines and charts)
    ranked: pd.DataFrame  # one row per run and case (analysis.rank_within_run and more)
    chosen: pd.DataFrame  # the rows of ``ranked`` the headline quotes


def moe_layer_rows(table: pd.DataFrame) -> pd.DataFrame:
    return table[(table["family"] == "moe") & (table["suite"] == "layer")]


def moe_train_32k(table: pd.DataFrame, run_order: pd.Series) -> Finding:
    """The 32k-token bf16 train step, ranked within every run and config; per GPU, the newest
    run that measured it."""
    rows = moe_layer_rows(table)
    for field, value in HEADLINE_CASE.items():
        rows = rows[rows[field] == value]
    ranked = rank_exact_moe(rows, analysis.MOE_CASE)
    return Finding(rows, ranked, analysis.newest_per_device(ranked, run_order))


def rank_exact_moe(rows: pd.DataFrame, case: list[str]) -> pd.DataFrame:
    """Rank MoE layer implementations within each file, run and case, leaving capacity routing
    (it drops tokens, so it computes a different function) out of the ranking but reporting its
    time, and adding the slowdown of the dense-routing and ragged_dot baselines."""
    exact = rows[rows["routing"] != "capacity"]
    ranked = analysis.rank_within_run(exact, case)
    if ranked.empty:
        return ranked
    keys = [*analysis.RUN_KEYS, *case]
    for baseline in MOE_BASELINES:
        speed = analysis.speedups(exact, case, baseline)
        speed = speed[speed["label"] != baseline]
        merged = ranked[[*keys, "fastest"]].merge(
            speed[[*keys, "label", "speedup", "clear"]].rename(columns={"label": "fastest"}),
            on=[*keys, "fastest"], how="left")
        ranked[f"vs {baseline}"] = merged["speedup"].to_numpy()
        ranked[f"vs {baseline} clear"] = merged["clear"].to_numpy()
    capacity = analysis.timed(rows[rows["routing"] == "capacity"])
    capacity = capacity[[*keys, "median_ms", "q1_ms", "q3_ms", "rounds"]]
    merged = ranked[keys].merge(capacity.drop_duplicates(subset=keys), on=keys, how="left")
    for column in ("median_ms", "q1_ms", "q3_ms", "rounds"):
        ranked[f"capacity_{column}"] = merged[column].to_numpy()
    return ranked


def rbf_memory_rows(table: pd.DataFrame) -> pd.DataFrame:
    return table[(table["family"] == "rbf")
                 & table["suite"].isin(["kernel_mv_peak", "kernel_mv_max_n"])
                 & ~table["summary"].fillna(False).astype(bool)]


def rbf_memory(table: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Peak memory growth with n per RBF implementation: (rows, growth per ladder)."""
    rows = rbf_memory_rows(table)
    return rows, analysis.memory_growth(rows)


def decoder_ranked(table: pd.DataFrame) -> pd.DataFrame:
    """Per file, run and op of the MoE decoder suite: the fastest impl/dispatch at each token
    count and its lead over the runner-up."""
    rows = table[(table["family"] == "moe") & (table["suite"] == "decoder")]
    return analysis.rank_within_run(rows, ["config", "dtype", "op", "tokens"])


def rbf_wins_at_largest_n(table: pd.DataFrame) -> pd.DataFrame:
    """Per file and run of kernel_mv, at its largest measured n: per implementation, the cases
    it was clearly fastest in, the ties, and the range of its speedup over xla."""
    rows = analysis.timed(table[(table["family"] == "rbf") & (table["suite"] == "kernel_mv")])
    out = []
    for (source, run, device), per_run in rows.groupby(["source_file", "run", "device"],
                                                       sort=False):
        largest = per_run[per_run["n"] == per_run["n"].max()]
        ranked = analysis.rank_within_run(largest, ["config", "op", "n"])
        if ranked.empty:
            continue
        speed = analysis.speedups(largest, ["config", "op", "n"], "xla")
        for label, wins in ranked.groupby("fastest"):
            lead = speed[speed["label"] == label]["speedup"]
            out.append({
                "source_file": source, "run": run, "device": device,
                "n": largest["n"].iloc[0], "cases": len(ranked), "label": label,
                "clear_wins": int(wins["clear"].eq(True).sum()),
                "tied_wins": int((~wins["clear"].eq(True)).sum()),
                "xla_lo": lead.min() if label != "xla" and not lead.empty else float("nan"),
                "xla_hi": lead.max() if label != "xla" and not lead.empty else float("nan"),
            })
    return pd.DataFrame(out)
