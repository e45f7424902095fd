"""NN suites: the wider network benchmarks of the RTX 3090 file (transformer, diffusion, moe,
ssm, unet), including their error rows."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .. import analysis, charts
from ..load import StoredResults
from ..render import Page, fmt_int, fmt_time, ms_cell, plural, short_error, verdict_phrase
from . import _shared

PATH = "reports/nn-suites.md"
TITLE = "NN suites"
SLUG = "nn-suites"
SUITE_TEXT = {
    "transformer": "a transformer block per attention variant",
    "diffusion": "a diffusion transformer block per attention variant",
    "moe": "the MoE layer inside a network, per implementation",
    "ssm": "state-space / linear-recurrence cells",
    "unet": "a small UNet, by image resolution",
}


def build(results: StoredResults) -> str:
    table = analysis.with_labels(results.table)
    nn = table[table["family"] == "nn"]
    page = Page(SLUG, TITLE)
    page.md(
        "Whole-network benchmarks: forward and train step, float32 and bfloat16, batch 8. The "
        "variant compared is the attention implementation (transformer, diffusion), the MoE "
        "implementation (moe) or the recurrent cell (ssm). Times are medians (q1–q3); ratios "
        "are within the run."
    )
    page.md(_shared.NOISE_RULE)
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
        page.md(f"*Note stored with the run:* {note}")
    size = "tokens" if rows["tokens"].notna().any() else "resolution"
    has_variants = rows["impl"].notna().any()
    rows = rows.assign(variant=rows["impl"].fillna(suite))
    good = analysis.timed(rows)
    ranked = analysis.rank_within_run(rows.assign(label=rows["variant"]),
                                      ["dtype", "op", size])
    if not ranked.empty:
        top = ranked[ranked[size] == ranked[size].max()]
        parts = [f"{r.dtype} {r.op}: **{r.fastest}** "
                 f"{fmt_time(r.fastest_ms, r.fastest_q1, r.fastest_q3, r.fastest_rounds)}, "
                 f"{verdict_phrase(r.ratio, r.clear, r.runner_up)}" for r in top.itertuples()]
        page.md(f"At {size} {fmt_int(top[size].iloc[0])}: " + "; ".join(parts) + ".")
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


def _failed_note(rows: pd.DataFrame) -> str:
    failed = analysis.failures(rows)
    return f"{plural(len(failed), 'failed case')} not drawn; see the table." if len(failed) else ""
