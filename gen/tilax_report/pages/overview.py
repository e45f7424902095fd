"""Overview: the headline findings from the newest runs, the run list, and what each file holds
(measured, failed, skipped)."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .. import analysis, charts, headlines, runs
from ..load import StoredResults
from ..render import Page, fmt_int, join_names, run_link
from . import _shared

PATH = "reports/index.md"
TITLE = "Overview"
SLUG = "overview"
STATUS_COLOURS = {"measured": "#4c78a8", "failed": "#e45756", "skipped": "#bab0ac"}


def build(results: StoredResults) -> str:
    table = analysis.with_labels(results.table)
    catalogue = runs.catalogue(table)
    order = pd.Series(catalogue["order"].to_numpy(), index=catalogue["run"])
    dates = pd.Series(catalogue["date"].to_numpy(), index=catalogue["run"])
    page = Page(SLUG, "Benchmark reports")
    devices = sorted(table["device"].dropna().unique())
    page.md(
        f"Generated at build time from the {len(results.files)} stored result files in "
        f"`data/results/` ({fmt_int(len(table))} table rows, {len(catalogue)} runs on "
        f"{join_names(devices)}). Times are **medians** with the first and third quartiles "
        "(q1–q3) and the number of rounds. Speeds are compared only as **ratios within one "
        "stored file** (one process on one GPU); *N×* means N times faster. Every stored row "
        "is **measured**, **failed** (attempted: out of memory, timeout, error) or "
        "**skipped** (never attempted, e.g. the run's time budget ran out), and the pages keep "
        "the three apart. Headlines quote the **newest run** on each GPU that has the rows "
        "they need."
    )
    page.md(_shared.NOISE_RULE)
    _moe_headline(page, table, order, dates)
    _rbf_headline(page, table, dates)
    _more_findings(page, table, dates)
    _run_list(page, catalogue, table)
    _status(page, table)
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
        "each GPU's sentence quotes its newest run with this case. Every run with the case is "
        "in the table. Details: [MoE layer](moe-layer.md)."
    )
    page.table(_shared.ranked_display(finding.ranked), finding.rows, name="headline-moe-32k",
               key_columns=4)
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
        page.chart(chart, rows, f"Run {best['run']}. Bars: median; black rule: q1–q3; log "
                                "scale.")


def _rbf_headline(page: Page, table: pd.DataFrame, dates: pd.Series) -> None:
    rows, growth = headlines.rbf_memory(table)
    page.md("## RBF kernels: how peak memory grows with n\n")
    if growth.empty:
        page.md("No stored run has RBF peak-memory measurements.")
        return
    page.md("\n".join(f"- {s}" for s in _shared.memory_sentences(growth, dates)))
    page.md(
        "Peak device memory (`peak_bytes_in_use`) of one call in a fresh process, n = m. The "
        "exponent is a least-squares fit of log(peak) on log(n) over the sizes that ran. "
        "Details: [RBF kernels](rbf.md)."
    )
    page.table(_shared.memory_display(growth), rows, name="headline-rbf-memory")
    for (_source, device), group in rows.groupby(["source_file", "device"], sort=False):
        peak = group[group["suite"] == "kernel_mv_peak"]
        group = peak if not peak.empty else group
        chart = charts.ladder(
            group, x="n", x_title="n (= m)", color="label", color_title="implementation",
            column=alt.Column("op:N", title=None), tips=["run", "config", "suite"],
            width=260, height=190, title=f"{analysis.short_gpu(device)}: peak memory vs n",
        )
        page.chart(chart, group, "Log–log; a cross on the top edge marks a failed size.")


def _more_findings(page: Page, table: pd.DataFrame, dates: pd.Series) -> None:
    sentences = (_shared.decoder_sentences(headlines.decoder_ranked(table), dates)
                 + _shared.rbf_win_sentences(headlines.rbf_wins_at_largest_n(table), dates))
    if sentences:
        page.md("## More findings\n")
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
               markdown_columns=("run",), key_columns=6)


def _status(page: Page, table: pd.DataFrame) -> None:
    page.md("## Rows per run and suite\n")
    counts = analysis.status_counts(table.drop_duplicates(["source_file", "source_row"]),
                                    ["run", "suite"])
    long = counts.melt(id_vars=["run", "suite"], var_name="status", value_name="rows")
    long = long[long["rows"] > 0]
    long["run · suite"] = long["run"] + " · " + long["suite"]
    chart = (
        alt.Chart(long)
        .mark_bar()
        .encode(
            alt.Y("run · suite:N", title=None, sort=None, axis=alt.Axis(labelLimit=320)),
            alt.X("rows:Q", title="stored rows", stack="zero"),
            alt.Color("status:N", title="status",
                      scale=alt.Scale(domain=list(STATUS_COLOURS),
                                      range=list(STATUS_COLOURS.values()))),
            alt.Order("status_order:Q"),
            tooltip=charts.tooltip(["run", "suite", "status", "rows"]),
        )
        .transform_calculate(status_order="indexof(['measured','failed','skipped'], "
                                          "datum.status)")
        .properties(width=300, height=alt.Step(14))
    )
    page.chart(charts.finish(chart, "Stored rows per run and suite, by status"), table,
               "Measured: a time; failed: attempted, with the error; skipped: never "
               "attempted, with why.")
    page.md("All files: [raw data](raw-data.md); column meanings: [table schema](schema.md).")
