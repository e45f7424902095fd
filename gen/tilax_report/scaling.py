"""Expert parallelism (suite ``ep``): the link's bandwidth, weak-scaling efficiency and the
exchange's share of the step, from the stored rows.

Numbers and keys only; pages/moe_ep.py words them. Every ratio pairs two rows of one stored file
(one process, one run, one GPU kind) through `analysis.speedups`, so it has the same quartile
bounds and noise-aware verdict (`verdict`) as every other within-file ratio of the site:

- **weak-scaling efficiency** of an n-GPU ``step`` row: its tokens/s over n times the tokens/s
  of the one-GPU ``step`` row of the same layer, implementation, dtype and tokens per GPU,
  ``(tokens_n / median_n) / (n * tokens_1 / median_1)``. Weak scaling keeps the tokens per GPU
  fixed (``tokens_n = n * tokens_1``), so this is ``median_1 / median_n``; its bounds are
  ``q1_1 / q3_n`` and ``q3_1 / q1_n``, and ``clear`` says whether the two step times differ
  beyond the noise (whether the efficiency differs from 1).
- **exchange share** of an n-GPU ``step`` row: the median of the ``exchange`` row of the same
  layer, tokens, GPUs and transport over the step's median, bounds ``q1_x / q3_step`` and
  ``q3_x / q1_step``.
- **overlap** of an n-GPU ``step`` row with both: its median over the larger of the one-GPU
  step's (the expert compute of one GPU's share of the tokens) and the exchange row's,
  ``median_n / max(median_1, median_x)``, bounds ``q1_n / max(q3_1, q3_x)`` and
  ``q3_n / max(q1_1, q1_x)``: 1 when the smaller of compute and exchange hides entirely behind
  the larger, ``1 + min / max`` when they run one after the other. Issue 14's target for a
  link slower than NVLink is at most 1.15.

Tokens per second are ``tokens / median`` (what the bench stores as ``tokens_per_s``, from the
same median); link bandwidth is the stored ``gbps`` (``bytes / median``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from . import analysis, verdict

# What a step row and its one-GPU reference share (besides file, run and GPU).
STEP_CASE = ["config", "impl", "dispatch", "routing", "dtype", "op", "tokens_per_device"]
# What a step row and its exchange-only row share.
EXCHANGE_CASE = [*STEP_CASE, "devices", "exchange", "tokens"]
ONE_GPU = "one GPU"
# Layer shapes in reading order: fewest experts first.
SHAPE_ORDER = ["experts", "top_k", "d_model", "d_hidden", "shared_hidden"]
ROW = ["source_file", "source_row"]


def ep_rows(table: pd.DataFrame) -> pd.DataFrame:
    """The expert-parallel rows (family moe, suite ep) of a labelled table; a step whose
    exchange ran in chunks (``exchange_chunks`` > 1) is its own transport here,
    ``"<exchange> in <c> chunks"``, so that it is paired and listed apart from the plain one."""
    rows = table[(table["family"] == "moe") & (table["suite"] == "ep")]
    if "exchange_chunks" not in rows:
        return rows
    chunks = rows["exchange_chunks"]
    chunked = chunks.gt(1).fillna(False).to_numpy(dtype=bool)
    named = rows["exchange"].astype("object") + " in " + chunks.astype("string") + " chunks"
    return rows.assign(exchange=rows["exchange"].where(~chunked, named))


def tokens_per_s(rows: pd.DataFrame) -> pd.Series:
    """tokens / median, per second (missing without a time)."""
    return rows["tokens"].astype("float64") / (rows["median_ms"] / 1e3)


def efficiency(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per timed n-GPU step row that has a timed one-GPU step row of the same case in
    the same file: the row's keys, ``tokens_per_s``, ``one_gpu_tokens_per_s``, ``efficiency``
    with ``efficiency_lo``/``_hi`` (from the quartiles), and ``clear``/``method`` (the verdict
    on the two step times)."""
    steps = rows[rows["part"] == "step"]
    one = steps["devices"].eq(1).fillna(False).to_numpy(dtype=bool)
    steps = steps.assign(label=np.where(one, ONE_GPU, "several GPUs"))
    paired = analysis.speedups(steps, STEP_CASE, ONE_GPU)
    paired = paired[paired["devices"].gt(1).fillna(False).to_numpy(dtype=bool)]
    if paired.empty:
        return pd.DataFrame(columns=[*ROW, "tokens_per_s", "one_gpu_tokens_per_s", "efficiency",
                                     "efficiency_lo", "efficiency_hi", "clear", "method"])
    n = paired["devices"].astype("float64")
    mine = tokens_per_s(paired)
    # the one-GPU row's tokens are its tokens per GPU
    reference = paired["tokens_per_device"].astype("float64") / (paired["median_ms_base"] / 1e3)
    # (tokens_n / median_n) / (n * tokens_1 / median_1) = speedup * tokens_n / (n * tokens_1):
    # the speedup's quartile bounds, scaled alike
    scale = paired["tokens"].astype("float64") / (n * paired["tokens_per_device"])
    base = paired[["median_ms_base", "q1_ms_base", "q3_ms_base", "round_ms_base"]].set_axis(
        ["median_ms", "q1_ms", "q3_ms", "round_ms"], axis=1)
    judged = verdict.compare_frames(base, paired)
    return paired.assign(
        tokens_per_s=mine, one_gpu_tokens_per_s=reference, efficiency=mine / (n * reference),
        efficiency_lo=paired["speedup_lo"] * scale, efficiency_hi=paired["speedup_hi"] * scale,
        clear=judged["clear"], method=judged["method"],
    ).reset_index(drop=True)


def exchange_share(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per timed n-GPU step row with a timed exchange row of the same case in the same
    file: the row's keys, ``share`` (exchange median / step median) and ``share_lo``/``_hi``
    (from the quartiles), ``exchange_ms`` (the exchange row's median)."""
    several = rows["devices"].gt(1).fillna(False).to_numpy(dtype=bool)
    pair = rows[rows["part"].isin(["step", "exchange"]).to_numpy(dtype=bool) & several]
    paired = analysis.speedups(pair.assign(label=pair["part"]), EXCHANGE_CASE, "exchange")
    paired = paired[paired["part"] == "step"]
    return paired.assign(share=paired["speedup"], share_lo=paired["speedup_lo"],
                         share_hi=paired["speedup_hi"],
                         exchange_ms=paired["median_ms_base"]).reset_index(drop=True)


def overlap(eff: pd.DataFrame, share: pd.DataFrame) -> pd.DataFrame:
    """From the :func:`efficiency` and :func:`exchange_share` frames of the same rows, one row
    per n-GPU step row in both: ``ROW``, ``overlap`` and ``overlap_lo``/``_hi`` (see the
    module docstring)."""
    base = ["median_ms_base", "q1_ms_base", "q3_ms_base"]
    if eff.empty or share.empty:
        return pd.DataFrame(columns=[*ROW, "overlap", "overlap_lo", "overlap_hi"])
    compute = eff[[*ROW, "median_ms", "q1_ms", "q3_ms", *base]]
    exchange = share[[*ROW, *base]].set_axis([*ROW, "median_x", "q1_x", "q3_x"], axis=1)
    both = compute.merge(exchange, on=ROW)
    return pd.DataFrame({
        **{key: both[key] for key in ROW},
        "overlap": both["median_ms"] / np.maximum(both["median_ms_base"], both["median_x"]),
        "overlap_lo": both["q1_ms"] / np.maximum(both["q3_ms_base"], both["q3_x"]),
        "overlap_hi": both["q3_ms"] / np.maximum(both["q1_ms_base"], both["q1_x"]),
    })


def step_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """Every ``step`` row, whatever its status, with ``tokens_per_s``, its efficiency (missing
    for one GPU and where no pair exists), its exchange share and overlap, and
    ``exchange_status`` / ``exchange_error`` (the status of the exchange row of its case in the
    same file, missing where there is none)."""
    steps = rows[rows["part"] == "step"].copy()
    steps["tokens_per_s"] = tokens_per_s(steps).where(steps["status"] == "measured")
    paired, shared = efficiency(rows), exchange_share(rows)
    eff = paired[[*ROW, "efficiency", "efficiency_lo", "efficiency_hi", "clear", "method"]]
    share = shared[[*ROW, "share", "share_lo", "share_hi", "exchange_ms"]]
    hidden = overlap(paired, shared)
    exchange = rows[rows["part"] == "exchange"]
    keys = [*analysis.RUN_KEYS, *EXCHANGE_CASE]
    exchange = exchange[[*keys, "status", "error"]].drop_duplicates(keys).rename(
        columns={"status": "exchange_status", "error": "exchange_error"})
    out = (steps.merge(eff, on=ROW, how="left").merge(share, on=ROW, how="left")
           .merge(hidden, on=ROW, how="left").merge(exchange, on=keys, how="left"))
    order = ["source_file", *SHAPE_ORDER, "tokens_per_device", "devices", "exchange"]
    return out.sort_values(order, na_position="first").reset_index(drop=True)


def link_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """Every ``link`` row with ``collective`` (its ``exchange``: ``all_to_all`` or
    ``all_gather``), ``mib`` (bytes leaving each GPU per trip, MiB), ``gbps`` (as
    stored; ``bytes / median`` where a measured row lacks it) and ``gbps_lo``/``_hi`` from the
    quartiles (``bytes / q3``, ``bytes / q1``)."""
    link = rows[rows["part"] == "link"].copy()
    link["collective"] = link["exchange"].fillna("all_to_all")
    size = link["bytes"].astype("float64")
    link["mib"] = size / 2**20
    computed = size / (link["median_ms"] / 1e3) / 1e9
    link["gbps"] = link["gbps"].where(link["gbps"].notna(), computed)
    link["gbps"] = link["gbps"].where(link["status"] == "measured")
    link["gbps_lo"] = size / (link["q3_ms"] / 1e3) / 1e9
    link["gbps_hi"] = size / (link["q1_ms"] / 1e3) / 1e9
    return link.sort_values(["source_file", "devices", "collective", "bytes"]).reset_index(
        drop=True)
