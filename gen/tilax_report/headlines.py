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
    """Per run of kernel_mv that timed xla, at the largest n where it did: per implementation,
    the cases it was clearly fastest in, the ties, and the range of its speedup over xla (a
    run of tilax's kernel alone, e.g. its precisions, answers no question of this kind)."""
    rows = analysis.claimable(table[(table["family"] == "rbf")
                                    & (table["suite"] == "kernel_mv")])
    out = []
    for (run, device), per_run in rows.groupby(["run", "device"], sort=False):
        with_xla = per_run[per_run["label"] == "xla"]
        if with_xla.empty:
            continue
        source = with_xla["source_file"].iloc[0]
        largest = per_run[per_run["n"] == with_xla["n"].max()]
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


# The peer headline: tilax's MoE layer against the other implementations of the same layer,
# bf16 train step, on the GPU below. Settings are the table's rows, in order: (config label as
# analysis.with_labels writes it, tokens).
PEER_GPU = "NVIDIA H200"
PEER_CASE = {"dtype": "bfloat16", "op": "train_step", "routing": "dropless"}
PEER_SETTINGS = [
    ("E8 top-2 d512 h1024", 131072),
    ("E8 top-2 d512 h1024", 32768),
    ("E64 top-8 d512 h128 shared 1024", 16384),
    ("E64 top-8 d512 h128 shared 1024", 131072),
]
# The suite each setting's peer rows come from: the layer suite also holds E64 top-8 rows (the
# softmax twins of its DeepSeek-style router rows, without the decoder suite's peers), which
# must not stand in for the decoder's comparison.
PEER_SUITES = {"E8 top-2 d512 h1024": "layer", "E64 top-8 d512 h128 shared 1024": "decoder"}
DEFAULT_COLUMN = "tilax default"
FASTEST_COLUMN = "tilax fastest"
# The peers' columns: column -> label (analysis.with_labels).
PEER_COLUMNS = {
    "PyTorch compiled": "torch_grouped_mm_compile",
    "tokamax": "tokamax",
    "lax.ragged_dot": "ragged_dot/sorted",
}
PALLAS_IMPLS = ("pallas", "triton", "mosaic")
# What impl="auto", dispatch="sorted" (MoEConfig's defaults) runs, per GPU: the backend of the
# package's rules table (tilax.moe.rules: each row names its stored run), Triton where no
# rule holds. tests/packaging/test_readme_numbers.py holds this against the rules table.
MOSAIC_DEFAULT_GPUS = ("NVIDIA H200",)


def default_label(device: str) -> str:
    """The label of the stored row that tilax's defaults run on ``device``."""
    return "mosaic/sorted" if device in MOSAIC_DEFAULT_GPUS else "triton/sorted"


@dataclass
class PeerHeadline:
    run: str
    device: str
    cells: pd.DataFrame  # one row per setting x column: the stored row shown there (or none)
    rows: pd.DataFrame  # every tidy row of the chosen files at the settings (source lines)


def peer_setting_rows(table: pd.DataFrame) -> pd.DataFrame:
    rows = table[table["family"] == "moe"]
    rows = rows[(rows["device"] == PEER_GPU) & rows["suite"].isin(["layer", "decoder"])]
    for field, value in PEER_CASE.items():
        rows = rows[rows[field] == value]
    for option in ("recompute", "deterministic"):  # the options' rows are not the default's
        rows = rows[rows[option].isna() | ~rows[option].fillna(False).astype(bool)]
    keep = pd.Series(False, index=rows.index)
    for config, tokens in PEER_SETTINGS:
        keep |= ((rows["config"] == config) & (rows["tokens"] == tokens)
                 & (rows["suite"] == PEER_SUITES[config]))
    return rows[keep]


def _column_row(rows: pd.DataFrame, column: str, device: str) -> pd.Series | None:
    """The row of ``rows`` (one run, one setting) that ``column`` shows, or None. A time
    must be claimable (`analysis.claimable`: a superseded peer row never feeds a headline)."""
    if column == FASTEST_COLUMN:
        pallas = analysis.claimable(rows[rows["impl"].isin(PALLAS_IMPLS)])
        return pallas.sort_values("median_ms").iloc[0] if not pallas.empty else None
    label = default_label(device) if column == DEFAULT_COLUMN else PEER_COLUMNS[column]
    found = rows[rows["label"] == label]
    if found.empty or (found["status"] == "measured").any() and analysis.claimable(
            found).empty:
        return None
    good = analysis.claimable(found)
    return good.iloc[0] if not good.empty else found.iloc[0]


COLUMNS = [DEFAULT_COLUMN, FASTEST_COLUMN, *PEER_COLUMNS]


def _setting_cells(rows: pd.DataFrame, device: str) -> dict[str, pd.Series] | None:
    """The cells of one run at one setting when it holds every column (a claimable time for
    tilax's default; a row for each peer, whatever its status, its time measured in a file
    with the default's: ratios only within one process), else None."""
    cells = {column: _column_row(rows, column, device) for column in COLUMNS}
    if any(cell is None for cell in cells.values()) or cells[DEFAULT_COLUMN]["status"] != (
            "measured"):
        return None
    default_files = set(cells[DEFAULT_COLUMN]["source_files"])
    for cell in cells.values():
        if cell["status"] == "measured" and not default_files & set(cell["source_files"]):
            return None
    return cells


def peer_headline(table: pd.DataFrame, run_order: pd.Series) -> PeerHeadline | None:
    """The newest run on `PEER_GPU` that holds every column at every setting."""
    rows = peer_setting_rows(table)
    candidates = sorted(rows["run"].unique(), key=lambda r: -run_order.get(r, -1))
    for run in candidates:
        in_run = rows[rows["run"] == run]
        records, sources = [], []
        for config, tokens in PEER_SETTINGS:
            setting = in_run[(in_run["config"] == config) & (in_run["tokens"] == tokens)]
            cells = _setting_cells(setting, PEER_GPU)
            if cells is None:
                break
            sources.append(setting)
            for column, cell in cells.items():
                records.append({"setting": config, "tokens": tokens, "column": column,
                                **cell.to_dict()})
        else:
            return PeerHeadline(run, PEER_GPU, pd.DataFrame(records), pd.concat(sources))
    return None


# The RBF headline: tilax's kernel sum against plain XLA and the peers that ran, forward and
# forward + backward, at the largest n of the newest run on `PEER_GPU` that timed both.
RBF_TILAX = "pallas"
RBF_COLUMNS = {
    "tilax (pallas)": "pallas",
    "chunked XLA": "xla",
    "dense XLA": "dense",
    "dense PyTorch": "torch_dense",
    "KeOps": "keops",
}
RBF_OPS = ("fwd", "fwd_bwd")


@dataclass
class RbfHeadline:
    run: str
    device: str
    source_file: str
    config: str
    n: int
    cells: pd.DataFrame  # one row per op x column that has a stored row
    rows: pd.DataFrame


def rbf_headline(table: pd.DataFrame, run_order: pd.Series) -> RbfHeadline | None:
    """The newest run on `PEER_GPU` whose kernel_mv rows time tilax and XLA both ways (fwd,
    fwd_bwd) in one file, at its largest such n (then the config with the most columns)."""
    rows = table[(table["family"] == "rbf") & (table["suite"] == "kernel_mv")
                 & (table["device"] == PEER_GPU) & table["label"].isin(RBF_COLUMNS.values())]
    good = analysis.claimable(rows)
    keys = ["run", "config", "n"]
    both = good.groupby(keys)["label"].agg(
        lambda s: {RBF_TILAX, "xla"} <= set(s) and s.size >= 2 * len(RBF_OPS)).reset_index()
    both = both[both["label"]]
    if both.empty:
        return None
    both = both.assign(
        _when=-both["run"].map(run_order).fillna(-1),
        _labels=[-rows[(rows["run"] == r.run) & (rows["config"] == r.config)
                       & (rows["n"] == r.n)]["label"].nunique() for r in both.itertuples()],
        _n=-both["n"],
    ).sort_values(["_when", "_n", "_labels", "run"])
    best = both.iloc[0]
    case = rows[(rows["run"] == best["run"]) & (rows["config"] == best["config"])
                & (rows["n"] == best["n"]) & rows["op"].isin(RBF_OPS)]
    tilax_files = {f for files in case.loc[case["label"] == RBF_TILAX, "source_files"]
                   for f in files}
    records = []
    for op in RBF_OPS:
        for column, label in RBF_COLUMNS.items():
            found = case[(case["op"] == op) & (case["label"] == label)]
            if found.empty:
                continue
            row = found.iloc[0]
            other_process = row["status"] == "measured" and not (
                tilax_files & set(row["source_files"]))
            superseded = pd.notna(row.get("superseded")) and bool(row.get("superseded"))
            if other_process or superseded:
                continue  # no ratio across processes, no claim from a superseded row
            records.append({"column": column, **row.to_dict()})
    source = case.loc[case["label"] == RBF_TILAX, "source_file"].iloc[0]
    return RbfHeadline(best["run"], PEER_GPU, source, best["config"], int(best["n"]),
                       pd.DataFrame(records), case)
