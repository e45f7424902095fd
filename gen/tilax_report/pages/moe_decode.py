"""MoE decode (suite ``decode``): small-batch bf16 forwards, bound by reading the touched
experts' weights. Per run and layer shape: each impl's time per token count, the touched weights'
bytes per second and their share of the GPU's copy bandwidth measured in the same file, and
tilax's ``auto`` against the fastest peer; failed and skipped rows kept apart."""

from __future__ import annotations

import pandas as pd

from .. import analysis, charts
from ..load import StoredResults
from ..prepared import prepared
from ..render import Page, fmt_int, fmt_num, fmt_ratio, plural
from . import _shared

PATH = "reports/moe-decode.md"
TITLE = "MoE decode"
SLUG = "moe-decode"
COPY = "copy_bandwidth"
TILAX = "auto"
PEERS = ("ragged_dot/sorted", "tokamax", "torch_grouped_mm", "torch_grouped_mm_compile")
#: The issue's target: the touched weights stream at this share of the copy bandwidth or more.
TARGET_SHARE = 0.70
NOTHING_STORED = (
    "No run of the decode suite is stored yet (`nox -s bench -- --bench-suite decode`)."
)


def copy_bandwidth(rows: pd.DataFrame) -> pd.Series:
    """source file -> the GPU's copy bandwidth measured in it (GB/s): the median of the file's
    measured ``copy_bandwidth`` rows (the suite's first and last row), from the per-file rows."""
    copies = rows[(rows["impl"] == COPY) & (rows["status"] == "measured") & rows["gbps"].notna()]
    return copies.groupby("source_file")["gbps"].median()


def with_shares(layer: pd.DataFrame, bandwidth: pd.Series) -> pd.DataFrame:
    """``layer`` rows with ``copy_gbps`` (of the row's own file) and ``share`` (touched-weight
    GB/s over it): each ratio stays within one file."""
    copy_gbps = layer["source_file"].map(bandwidth)
    return layer.assign(copy_gbps=copy_gbps, share=layer["touched_weight_gbps"] / copy_gbps)


def versus_peers(layer: pd.DataFrame) -> pd.DataFrame:
    """Per config and token count of one file: ``auto``'s time, the fastest measured peer's
    and their ratio (the peer's time over auto's: above 1, auto is faster)."""
    timed = analysis.timed(layer)
    out = []
    for (config, tokens, source), group in timed.groupby(["config", "tokens", "source_file"]):
        ours = group[group["label"] == TILAX]
        peers = group[group["label"].isin(PEERS)]
        if ours.empty or peers.empty:
            continue
        best = peers.loc[peers["median_ms"].idxmin()]
        out.append(
            {
                "config": config,
                "tokens": int(tokens),
                "source_file": source,
                "auto_us": ours["median_ms"].iloc[0] * 1e3,
                "peer": best["label"],
                "peer_us": best["median_ms"] * 1e3,
                "speedup": best["median_ms"] / ours["median_ms"].iloc[0],
                "share": ours["share"].iloc[0],
            }
        )
    return pd.DataFrame(out)


def build(results: StoredResults) -> str:
    ready = prepared(results)
    table = ready.table
    decode = table[(table["family"] == "moe") & (table["suite"] == "decode")]
    page = Page(SLUG, TITLE)
    if decode.empty:
        page.md(NOTHING_STORED)
        return page.render()
    page.md(
        "How fast a MoE layer's forward runs at 1 to 512 tokens, where it is bound by reading "
        "the weights of the experts the batch routes to, not by its FLOPs: a Qwen3-30B-A3B-"
        "like layer (128 experts, top-8, d 2048, h 768) and a Mixtral-like one (8 experts, "
        "top-2, d 4096, h 14336), bfloat16, with `lax.ragged_dot`, tokamax and PyTorch "
        "`_grouped_mm` (eager and compiled) in the same process. **Touched GB/s** is the bytes "
        "of the touched experts' `w_gate`, `w_up` and `w_down` (and the router) over the "
        "median time; **% copy** is that over the GPU's device-to-device copy bandwidth "
        "measured in the same file (a 1 GiB buffer copied, bytes read and written over the "
        f"time): the floor of a forward's time is the touched bytes at 100%. The target is "
        f"{TARGET_SHARE:.0%} or more from 16 tokens on, and `auto` no slower than the fastest "
        "peer at every size. The newest run on each GPU comes first. " + _shared.VERDICTS
    )
    bandwidth = copy_bandwidth(results.rows)
    layer = with_shares(decode[decode["impl"] != COPY], bandwidth)
    _shared.sections_newest_first(
        page, layer, ready.order, lambda _, __, rows: _run_section(page, rows, bandwidth))
    return page.render()


def _cell(row) -> str:
    if row.status == "failed":
        return f"failed ({analysis.failure_kind(row.error)})"
    if row.status != "measured" or pd.isna(row.median_ms):
        return "skipped"
    text = f"{fmt_num(row.median_ms * 1e3, 3)} µs"
    if pd.notna(row.touched_weight_gbps):
        text += f" · {fmt_int(round(row.touched_weight_gbps))} GB/s"
    if pd.notna(row.share):
        text += f" ({row.share:.0%})"
    return text


def _run_section(page: Page, rows: pd.DataFrame, bandwidth: pd.Series) -> None:
    device, run = rows["device"].iloc[0], rows["run"].iloc[0]
    page.heading(2, f"{device}, run `{run}`")
    files = sorted(rows["source_file"].unique())
    measured = [f"{fmt_int(round(bandwidth[f]))} GB/s (`{f}`)" for f in files if f in bandwidth]
    page.md(
        "Copy bandwidth measured in the run: "
        + (", ".join(measured) if measured else "none stored (no share is computed).")
    )
    for config in analysis.config_order(rows):
        shape = rows[rows["config"] == config]
        page.heading(3, config)
        grid = shape.assign(
            cell=[_cell(r) for r in shape.itertuples()],
            column=shape["tokens"].map(lambda t: f"T {fmt_int(t)}"),
        )
        order = [f"T {fmt_int(t)}" for t in sorted(shape["tokens"].dropna().unique())]
        display = grid.pivot_table(index="label", columns="column", values="cell", aggfunc="first")
        display = display.reindex(columns=[c for c in order if c in display.columns])
        page.table(
            display.reset_index().rename(columns={"label": "impl"}).fillna(""),
            shape,
            "Median time of one forward; touched-weight GB/s and (in brackets) its "
            "share of the copy bandwidth of the same file.",
            name=f"decode-{run}-{config}".replace(" ", "-"),
            key_columns=2,
        )
        timed = analysis.timed(shape)
        timed = timed[timed["share"].notna()].assign(percent=lambda f: f["share"] * 100)
        chart = charts.lines(
            timed,
            x="tokens",
            x_title="tokens",
            color="label",
            color_title="impl",
            y="percent",
            y_title="touched weights, % of copy bandwidth",
            log_y=False,
            spread=False,
            tips=["median_ms", "touched_weight_gbps", "copy_gbps"],
            title=f"{device}, {config}: touched-weight bandwidth",
        )
        page.chart(chart, shape, f"The target: {TARGET_SHARE:.0%} or more from 16 tokens on.")
        peers = versus_peers(shape)
        if peers.empty:
            continue
        peers = peers.sort_values("tokens")
        display = pd.DataFrame(
            {
                "tokens": peers["tokens"].map(fmt_int),
                "auto": peers["auto_us"].map(lambda v: f"{fmt_num(v, 3)} µs"),
                "fastest peer": [
                    f"{p} {fmt_num(v, 3)} µs"
                    for p, v in zip(peers["peer"], peers["peer_us"], strict=True)
                ],
                "peer / auto": peers["speedup"].map(fmt_ratio),
                "auto % copy": peers["share"].map(lambda v: "" if pd.isna(v) else f"{v:.0%}"),
            }
        )
        page.table(
            display,
            shape,
            "auto against the fastest peer of the same file (above 1×: auto is faster).",
            name=f"decode-peers-{run}-{config}".replace(" ", "-"),
            key_columns=2,
        )
    if (rows["status"] != "measured").any():
        _shared.not_measured(
            page,
            rows,
            "decode case",
            {"label": "impl", "config": "layer", "tokens": "tokens"},
            name=f"decode-{run}",
            heading="### Not measured in this run",
        )
    else:
        page.md(f"All {plural(len(rows), 'decode case')} of this run were measured.")
