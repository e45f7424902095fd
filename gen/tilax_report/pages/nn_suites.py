"""NN suites: the seed's whole-network benchmarks of another codebase's kernels (the RTX 3090
file: transformer, diffusion, moe, ssm, unet), shown as data, error rows included. The page
draws no conclusion from them: they are not tilax's kernels."""

from __future__ import annotations

import re

import altair as alt
import pandas as pd

from .. import analysis, charts
from ..load import StoredResults
from ..prepared import prepared
from ..render import Page, fmt_int, join_names, ms_cell, plural, short_error

PATH = "reports/nn-suites.md"
TITLE = "NN suites"
SLUG = "nn-suites"
COMMIT_ID = re.compile(r"\b(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
SUITE_TEXT = {
    "transformer": "a transformer block per attention variant",
    "diffusion": "a diffusion transformer block per attention variant",
    "moe": "the MoE layer inside a network, per implementation",
    "ssm": "state-space / linear-recurrence cells",
    "unet": "a small UNet, by image resolution",
}


def build(results: StoredResults) -> str:
    table = prepared(results).table
    nn = table[table["family"] == "nn"]
    files = join_names([f"`{f}`" for f in sorted(nn["source_file"].unique())]) or "no file"
    page = Page(SLUG, TITLE)
    page.md(
        f"**The seed's results for kernels of another codebase, shown as data** ({files}): "
        "attention variants, state-space and recurrent cells, a UNet and an MoE layer inside "
        "whole networks, as that codebase built them. They are not tilax's kernels, and no "
        "claim about tilax is drawn from them; tilax's own MoE and RBF results are on the "
        "other report pages."
    )
    page.md(
        "What each table answers: the time of one forward call and one train step of each "
        "network variant, float32 and bfloat16, batch 8, at each size the seed measured. "
        "Times are medians (q1–q3) with their rounds; failed cases keep their error."
    )
    if nn.empty:
        page.md("No stored run has NN suite rows.")
        return page.render()
    notes = nn.dropna(subset=["run_note"]).drop_duplicates(["suite", "run_note"])
    for suite in _suite_order(nn):
        rows = nn[nn["suite"] == suite]
        _suite_section(page, suite, rows, notes[notes["suite"] == suite])
    return page.render()


def _suite_order(nn: pd.DataFrame) -> list[str]:
    known = [s for s in SUITE_TEXT if s in set(nn["suite"])]
    return known + sorted(set(nn["suite"]) - set(known))


def _suite_section(page: Page, suite: str, rows: pd.DataFrame, notes: pd.DataFrame) -> None:
    page.md(f"## {suite}\n")
    page.md(f"{SUITE_TEXT.get(suite, suite).capitalize()}.")
    for note in notes["run_note"]:
        page.md(f"*Note stored with the run:* {_without_commits(note)}")
    size = "tokens" if rows["tokens"].notna().any() else "resolution"
    has_variants = rows["impl"].notna().any()
    rows = rows.assign(variant=rows["impl"].fillna(suite))
    good = analysis.timed(rows)
    if good[size].nunique() >= 2:
        chart = charts.lines(
            good, x=size, x_title=size, color="variant",
            color_title="variant" if has_variants else suite,
            row=alt.Row("dtype:N", title=None), column=alt.Column("op:N", title=None),
            tips=["run", "q1_ms", "q3_ms", "params", "compile_s"],
            x_format="~s" if size == "tokens" else "d", width=250, height=160,
            title=f"{rows['device'].iloc[0]}: {suite} median time vs {size}",
        )
        page.chart(chart, rows, _failed_note(rows))
    cells = [ms_cell(r.median_ms, r.q1_ms, r.q3_ms, r.rounds) if r.status == "measured" else
             f"failed ({analysis.failure_kind(r.error)})" if r.status == "failed" else
             "skipped" for r in rows.itertuples()]
    grid = rows.assign(cell=cells, column=rows["dtype"] + " · " + rows["op"])
    display = grid.pivot_table(index=["variant", size], columns="column", values="cell",
                               aggfunc="first").reset_index()
    display[size] = display[size].map(fmt_int)
    page.table(display.fillna(""), rows, "Milliseconds per call.", name=f"nn-{suite}")
    failed = analysis.failures(rows)
    if not failed.empty:
        page.table(pd.DataFrame({
            "variant": failed["variant"], size: failed[size].map(fmt_int),
            "dtype": failed["dtype"], "op": failed["op"], "error": failed["error"].map(short_error),
        }), failed, "Failed cases.", name=f"nn-{suite}-failures")


def _without_commits(note: str) -> str:
    """A stored note without the other codebase's commit ids, which name nothing here."""
    return COMMIT_ID.sub("a commit of that codebase", note)


def _failed_note(rows: pd.DataFrame) -> str:
    failed = analysis.failures(rows)
    return f"{plural(len(failed), 'failed case')} not drawn; see the table." if len(failed) else ""
