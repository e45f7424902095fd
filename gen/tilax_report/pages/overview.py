"""Overview: every stored run, the headline findings, and where to read more."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .. import analysis, charts, headlines
from ..load import StoredResults
from ..render import Page, fmt_int, join_names

SLUG = "overview"
TITLE = "Benchmark reports"


def build(results: StoredResults) -> str:
    table = analysis.with_labels(results.table)
    page = Page(SLUG, TITLE)
    devices = sorted(table["device"].dropna().unique())
    page.md(
        f"Generated at build time from the {len(results.files)} stored result files in "
        f"`data/results/` ({fmt_int(len(table))} table rows, {table['run'].nunique()} runs on "
        f"{join_names(devices)}). Times are **medians**, with the first and third quartiles in "
        "parentheses where the file stored them. Speeds are compared only as **ratios within "
        "one run on one GPU**; *N×* means N times faster. Failed cases (out of memory, "
        "timeouts, compile errors) are kept and listed as failures."
    )
    _moe_headline(page, table)
    _rbf_headline(page, table)
    _more_findings(page, table)
    _runs(page, results, table)
    _files(page, results, table)
    return page.render()


def _moe_headline(page: Page, table: pd.DataFrame) -> None:
    finding = headlines.moe_train_32k(table)
    page.md("## Fastest MoE layer: 32k-token bf16 train step\n")
    if not finding.sentences:
        page.md("No stored run has MoE layer train steps at 32 768 tokens in bfloat16.")
        return
    page.md("\n".join(f"- {s}" for s in finding.sentences))
    page.md(
        "Ranked among the exact layers (dropless and dense routing); every stored run with this "
        "case is listed, each ranked within itself. Details: [MoE layer](moe-layer.md)."
    )
    page.table(finding.table, finding.rows, name="headline-moe-32k")
    ranked = headlines.rank_exact_moe(finding.rows, analysis.MOE_CASE)
    for _, best in analysis.primary_runs(ranked).iterrows():
        rows = finding.rows[(finding.rows["run"] == best["run"])
                            & (finding.rows["source_file"] == best["source_file"])
                            & (finding.rows["config"] == best["config"])]
        shown = analysis.timed(rows)
        chart = charts.bars(
            shown, category="label", category_title="implementation",
            tips=["run", "routing", "q1_ms", "q3_ms"], log=True,
            title=f"{best['device']}: 32k-token bf16 train step ({best['config']}), "
                  f"run {best['run']}",
        )
        page.chart(chart, rows, "Bars: median; black rule: q1–q3; log scale.")


def _rbf_headline(page: Page, table: pd.DataFrame) -> None:
    finding = headlines.rbf_memory(table)
    page.md("## RBF kernels: how peak memory grows with n\n")
    if not finding.sentences:
        page.md("No stored run has RBF peak-memory measurements.")
        return
    page.md("\n".join(f"- {s}" for s in finding.sentences))
    page.md(
        "Peak device memory (`peak_bytes_in_use`) of one call in a fresh process, n = m. The "
        "exponent is a least-squares fit of log(peak) on log(n) over the sizes that ran. "
        "Details: [RBF kernels](rbf.md)."
    )
    page.table(finding.table, finding.rows, name="headline-rbf-memory")
    for device, rows in finding.rows.groupby("device", sort=False):
        peak = rows[rows["suite"] == "kernel_mv_peak"]
        rows = peak if not peak.empty else rows
        chart = charts.ladder(
            rows, x="n", x_title="n (= m)", color="label", color_title="implementation",
            column=alt.Column("op:N", title=None), tips=["run", "config", "suite"],
            width=260, height=190, title=f"{device}: peak memory vs n",
        )
        page.chart(chart, rows, "Log–log; a cross on the top edge marks a failed size.")


def _more_findings(page: Page, table: pd.DataFrame) -> None:
    sentences = headlines.decoder_fastest(table) + headlines.rbf_fastest_at_largest_n(table)
    if sentences:
        page.md("## More findings\n")
        page.md("\n".join(f"- {s}" for s in sentences))


def _runs(page: Page, results: StoredResults, table: pd.DataFrame) -> None:
    page.md("## Stored runs\n")
    runs = (
        table.groupby(["source_file", "run"], sort=False, dropna=False)
        .agg(
            GPU=("device", "first"), jax=("jax", "first"), date=("date", "first"),
            code=("code", lambda s: ", ".join(sorted(s.dropna().unique()))),
            suites=("suite", lambda s: ", ".join(sorted(s.dropna().unique()))),
            rows=("source_row", "nunique"),
            failed=("status", lambda s: int((s != "ok").sum())),
            note=("run_note", "first"),
        )
        .reset_index()
    )
    # Failed rows counted once per stored row (the H100 file stores two ops in one row).
    failed_rows = (table[table["status"] != "ok"].groupby(["source_file", "run"])["source_row"]
                   .nunique())
    runs["failed"] = [int(failed_rows.get((f, r), 0)) for f, r in
                      zip(runs["source_file"], runs["run"], strict=True)]
    runs["GPU"] = runs["GPU"].map(analysis.short_gpu)
    runs["date"] = runs["date"].fillna("—")
    runs = runs.rename(columns={"source_file": "file", "rows": "stored rows",
                                "failed": "failed rows"})
    runs = runs[["file", "run", "code", "GPU", "jax", "date", "suites", "stored rows",
                 "failed rows", "note"]]
    page.md(
        f"{len(runs)} runs in {len(results.files)} files (date: — where the file does not record "
        "it). A run is one benchmark invocation on "
        "one machine; *code* says which code it measured where the file records it (the MoE "
        "A/B runs compare `before` with `final`)."
    )
    for name, listed in results.listed_runs.items():
        in_rows = table.loc[table["source_file"] == name, "run"].unique()
        missing = sorted(set(listed) - set(in_rows))
        unlisted = sorted(set(in_rows) - set(listed))
        text = (f"`{name}`: its `config.sources` lists {len(listed)} runs and its rows carry "
                f"{len(in_rows)} distinct run ids")
        if missing:
            text += f"; listed without rows: {', '.join(missing)}"
        if unlisted:
            text += f"; rows of unlisted runs: {', '.join(unlisted)}"
        page.md(text + ".")
    runs["note"] = runs["note"].fillna("").map(lambda t: t if len(t) <= 90 else t[:89] + "…")
    page.table(runs.fillna(""), table, name="stored-runs")


def _files(page: Page, results: StoredResults, table: pd.DataFrame) -> None:
    page.md("## Rows per file and suite\n")
    counts = (
        table.assign(outcome=table["status"].where(table["status"] == "ok", "failed"))
        .groupby(["source_file", "family", "suite", "outcome"], dropna=False)
        .size().rename("rows").reset_index()
    )
    counts["file / suite"] = counts["source_file"] + " · " + counts["suite"]
    chart = (
        alt.Chart(counts)
        .mark_bar()
        .encode(
            alt.Y("file / suite:N", title=None, sort=None),
            alt.X("rows:Q", title="table rows"),
            alt.Color("outcome:N", title="outcome",
                      scale=alt.Scale(domain=["ok", "failed"], range=["#4c78a8", "#e45756"])),
            tooltip=charts.tooltip(["source_file", "family", "suite", "outcome", "rows"]),
        )
        .properties(width=520, height=alt.Step(14))
    )
    page.chart(charts.finish(chart, "Table rows per stored file and suite"), table)
    page.md(
        "The H100 decoder file stores the forward and train-step times of a case in one row; "
        "the table splits it into two rows, so its table rows are twice its stored rows. "
        "All files: [raw data](raw-data.md); column meanings: [table schema](schema.md)."
    )
