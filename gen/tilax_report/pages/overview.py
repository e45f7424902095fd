"""Overview: the headline findings from the newest runs, the run list, and what each file holds
(measured, failed, skipped)."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .. import analysis, charts, front, headlines
from ..load import StoredResults
from ..prepared import prepared
from ..render import Page, fmt_int, join_names, run_link
from . import _shared

PATH = "reports/index.md"
TITLE = "Overview"
SLUG = "overview"
STATUS_COLOURS = {"measured": "#4c78a8", "failed": "#e45756", "skipped": "#bab0ac"}


def build(results: StoredResults) -> str:
    ready = prepared(results)
    table, catalogue = ready.table, ready.catalogue
    page = Page(SLUG, "Benchmark reports")
    devices = sorted(table["device"].dropna().unique())
    page.md(
        "What the stored runs say about choosing an implementation: tilax against its peers, "
        "the fastest MoE layer on each GPU and how the RBF kernels' memory grows, from the "
        "newest run on each GPU; the pages in the menu answer one question each and fold "
        f"earlier runs away. Generated from the {len(results.files)} stored result files in "
        f"`data/results/` ({fmt_int(len(table))} table rows, {len(catalogue)} runs on "
        f"{join_names(devices)}). Times are **medians** (q1–q3) with their rounds; ratios are "
        "within one stored file (one process on one GPU); rows are **measured**, **failed** "
        "or **skipped**, kept apart. " + _shared.VERDICTS
    )
    page.md("## tilax against its peers\n")
    page.md(front.boxed(front.headline_markdown(results, front.OVERVIEW_LINKS)))
    _moe_headline(page, table, ready.order, ready.dates)
    _rbf_headline(page, table, ready)
    _findings_in_force(page, table, ready)
    _run_list(page, catalogue, table)
    page.md("Stored rows per file and status: [raw data](raw-data.md); column meanings: "
            "[table schema](schema.md).")
    return page.render()


def _moe_headline(page: Page, table: pd.DataFrame, order: pd.Series, dates: pd.Series) -> None:
    finding = headlines.moe_train_32k(table, order)
    page.md("## Fastest MoE layer: 32k-token bf16 train step\n")
    if finding.chosen.empty:
        page.md("No stored run has MoE layer train steps at 32 768 tokens in bfloat16 measured "
                "for two implementations.")
        return
    page.md("\n".join(f"- {_shared.moe_headline(best, dates)}"
                      for _, best in finding.chosen.iterrows()))
    page.md(
        "Ranked among the exact layers (dropless and dense routing) within each stored file; "
        "each GPU's sentence quotes its newest run with this case. Details: "
        "[MoE layer](moe-layer.md)."
    )
    chosen = finding.chosen[["source_file", "run"]].apply(tuple, axis=1)
    keyed = finding.ranked[["source_file", "run"]].apply(tuple, axis=1)
    newest = finding.ranked[keyed.isin(set(chosen))]
    earlier = finding.ranked[~keyed.isin(set(chosen))]
    page.table(_shared.ranked_display(newest), finding.rows, name="headline-moe-32k",
               key_columns=4)
    if not earlier.empty:
        page.table(_shared.ranked_display(earlier), finding.rows,
                   name="headline-moe-32k-earlier", key_columns=4,
                   collapsed=f"Earlier runs with this case ({len(earlier)} rows)")
    for _, best in finding.chosen.iterrows():
        rows = finding.rows[(finding.rows["run"] == best["run"])
                            & (finding.rows["source_file"] == best["source_file"])
                            & (finding.rows["config"] == best["config"])]
        chart = charts.bars(
            analysis.timed(rows), category="label", category_title="implementation",
            tips=["run", "routing", "q1_ms", "q3_ms", "rounds"], log=True,
            title=f"{analysis.short_gpu(best['device'])}: 32k bf16 train step, "
                  f"{best['config']}",
        )
        page.chart(chart, rows, f"Run {best['run']}. Dots: median; black rule: q1–q3; log "
                                "scale.")


def _rbf_headline(page: Page, table: pd.DataFrame, ready) -> None:
    rows, growth = headlines.rbf_memory(table)
    page.md("## RBF kernels: how peak memory grows with n\n")
    if growth.empty:
        page.md("No stored run has RBF peak-memory measurements.")
        return
    newest = {run for _, run, _ in _shared.by_run_newest_first(growth, ready.order)[0]}
    page.md("\n".join(f"- {s}" for s in
                      _shared.memory_sentences(growth[growth["run"].isin(newest)], ready.dates)))
    page.md(
        "Peak device memory (`peak_bytes_in_use`) of one call in a fresh process, n = m. The "
        "exponent is a least-squares fit of log(peak) on log(n) over the sizes that ran. "
        "Details and earlier runs: [RBF kernels](rbf.md)."
    )
    page.table(_shared.memory_display(growth[growth["run"].isin(newest)]),
               rows[rows["run"].isin(newest)], name="headline-rbf-memory")
    shown = rows[rows["run"].isin(newest)]
    for (_source, device), group in shown.groupby(["source_file", "device"], sort=False):
        peak = group[group["suite"] == "kernel_mv_peak"]
        group = peak if not peak.empty else group
        chart = charts.ladder(
            group, x="n", x_title="n (= m)", color="label", color_title="implementation",
            column=alt.Column("op:N", title=None), tips=["run", "config", "suite"],
            width=260, height=190, title=f"{analysis.short_gpu(device)}: peak memory vs n",
        )
        page.chart(chart, group, "Log–log; a cross on the top edge marks a failed size.")


def _findings_in_force(page: Page, table: pd.DataFrame, ready) -> None:
    """The decoder and kernel_mv findings of each GPU's newest run (earlier runs' findings
    are on the suites' pages, folded)."""
    decoder = headlines.decoder_ranked(table)
    wins = headlines.rbf_wins_at_largest_n(table)
    sentences = []
    if not decoder.empty:
        newest = {run for _, run, _ in _shared.by_run_newest_first(decoder, ready.order)[0]}
        sentences += _shared.decoder_sentences(decoder[decoder["run"].isin(newest)],
                                               ready.dates)
    if not wins.empty:
        newest = {run for _, run, _ in _shared.by_run_newest_first(wins, ready.order)[0]}
        sentences += _shared.rbf_win_sentences(wins[wins["run"].isin(newest)], ready.dates)
    if sentences:
        page.md("## Findings in force\n")
        page.md("From each GPU's newest run of the suite; earlier runs are on the "
                "[MoE decoder](moe-decoder.md) and [RBF kernels](rbf.md) pages.")
        page.md("\n".join(f"- {s}" for s in sentences))


def _run_list(page: Page, catalogue: pd.DataFrame, table: pd.DataFrame) -> None:
    page.md("## Runs\n")
    page.md(
        f"{len(catalogue)} runs, newest first (runs without a recorded date last). A run is "
        "everything measured at one commit on one GPU: our own runs may be stored as several "
        "files (one per device call), the seed files hold several runs each. Each run's "
        "environment, files and skipped cases are on the [runs page](runs.md)."
    )
    display = pd.DataFrame({
        "run": [run_link(r) for r in catalogue["run"]],
        "GPU": catalogue["device"].map(analysis.short_gpu),
        "date": catalogue["date"].fillna("—"),
        "measured": catalogue["measured"],
        "failed": catalogue["failed"],
        "skipped": catalogue["skipped"],
        "commit": catalogue["commit"].fillna(""),
        "files": catalogue["files"].map(len),
        "suites": catalogue["suites"],
    })
    page.table(display, table, "Rows counted per stored row.", name="run-list",
               markdown_columns=("run",), key_columns=6,
               collapsed=f"All {len(display)} runs, newest first")


