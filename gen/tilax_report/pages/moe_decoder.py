"""MoE decoder layer (64 experts, top-8, width 128, shared expert 1024): impl x dispatch per
token count, speedups, numerics, failures. The stored H100 run, and any later run of the
`decoder` suite."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .. import analysis, charts, headlines
from ..load import StoredResults
from ..prepared import prepared
from ..render import (
    Page,
    case_label,
    fmt_int,
    fmt_num,
    fmt_ratio,
    fmt_size,
    ms_cell,
    plural,
    run_link,
    skip_gist,
)
from . import _shared

PATH = "reports/moe-decoder.md"
TITLE = "MoE decoder"
SLUG = "moe-decoder"
REFERENCE = "triton/sorted"


def build(results: StoredResults) -> str:
    ready = prepared(results)
    table = ready.table
    decoder = table[(table["family"] == "moe") & (table["suite"] == "decoder")]
    page = Page(SLUG, TITLE)
    page.md(
        "Which implementation runs a decoder-sized MoE layer fastest: d_model 512, 64 experts "
        "of width 128, top-8 routing and a shared expert of width 1024, dropless, bfloat16, "
        "forward and train step (value and grad with respect to parameters and input), at "
        "each token count. The newest run on each GPU comes first, with its table and "
        "charts; earlier runs are folded under *Earlier runs* (and followed over time on the "
        "[history page](history.md)). Ratios are within one stored file. "
        + _shared.VERDICTS
    )
    if decoder.empty:
        page.md("No stored run has the decoder suite.")
        return page.render()
    newest, earlier = _shared.by_run_newest_first(decoder, ready.order)
    ranked = headlines.decoder_ranked(table)
    newest_runs = {run for _, run, _ in newest}
    findings = _shared.decoder_sentences(ranked[ranked["run"].isin(newest_runs)], ready.dates)
    page.md("\n".join(f"- {s}" for s in findings))
    # One section per run (its files together); the ratios inside stay within each file.
    for _, _, rows in newest:
        _section(page, rows)
    with page.collapsed(_shared.earlier_summary(earlier)):
        for _, _, rows in earlier:
            _section(page, rows)
    return page.render()


def _section(page: Page, rows: pd.DataFrame) -> None:
    if analysis.timed(rows).empty:
        _unmeasured_sentence(page, rows)
    else:
        _run_section(page, rows)


def _unmeasured_sentence(page: Page, rows: pd.DataFrame) -> None:
    """A file whose decoder rows have no time: one sentence, not a grid of empty cells."""
    per_row = rows.drop_duplicates(["source_file", "source_row"])
    counts = per_row["status"].value_counts()
    reasons = per_row.loc[per_row["status"] == "skipped", "error"].map(skip_gist)
    why = f" ({reasons.mode().iloc[0]})" if not reasons.empty else ""
    failed = (f" and {plural(int(counts.get('failed', 0)), 'case')} failed"
              if counts.get("failed") else "")
    page.heading(2, f"{rows['device'].iloc[0]}, run `{rows['run'].iloc[0]}`")
    page.md(
        f"Nothing measured: of its {plural(len(per_row), 'decoder case')} in "
        f"{', '.join(f'`{f}`' for f in sorted(rows['source_file'].unique()))}, "
        f"{int(counts.get('skipped', 0))} were skipped"
        f"{why}{failed}. See run {run_link(rows['run'].iloc[0])}.")


def _run_section(page: Page, rows: pd.DataFrame) -> None:
    device, run = rows["device"].iloc[0], rows["run"].iloc[0]
    page.heading(2, f"{device}, run `{run}`")
    if isinstance(rows["run_note"].iloc[0], str):
        page.md(f"*{rows['run_note'].iloc[0]}*")
    spread = rows["q1_ms"].notna().any()
    if not spread:
        page.md("This file stored one time per case (no quartiles).")
    cell = [
        ms_cell(r.median_ms, r.q1_ms, r.q3_ms, r.rounds, r.repeats, r.repeat_min_ms,
                r.repeat_max_ms) if r.status == "measured" else
        f"failed ({analysis.failure_kind(r.error)})" if r.status == "failed" else "skipped"
        for r in rows.itertuples()
    ]
    grid = rows.assign(cell=cell, column=rows["op"] + " · " + rows["tokens"].map(fmt_int))
    order = [f"{op} · {fmt_int(t)}" for op in ("forward", "train_step")
             for t in sorted(rows["tokens"].dropna().unique())]
    display = grid.pivot_table(index="label", columns="column", values="cell", aggfunc="first")
    display = display.reindex(columns=[c for c in order if c in display.columns]).reset_index()
    page.table(display.rename(columns={"label": "impl/dispatch"}).fillna(""), rows,
               "Milliseconds per call, median (q1–q3), by op and tokens.",
               name=f"decoder-grid-{run}", key_columns=3)
    good = analysis.timed(rows)
    good = good.assign(tokens_label=good["tokens"].map(fmt_size))
    chart = charts.bars(
        good, category="label", category_title=None, log=True,
        row=alt.Row("tokens_label:N", title="tokens", sort=list(dict.fromkeys(
            good.sort_values("tokens")["tokens_label"]))),
        column=alt.Column("op:N", title=None), tips=["run", "tokens", "q1_ms", "q3_ms"],
        width=240, title=f"{device}: decoder time per impl/dispatch",
    )
    page.chart(chart, rows, "Log scale; failed cases are not drawn (see below).")
    speed = analysis.speedups(rows, ["config", "dtype", "op", "tokens"], REFERENCE)
    if not speed.empty:
        speed = speed.sort_values(["op", "tokens"])
        speed = speed.assign(text=[fmt_ratio(v) if c is not False else f"~{fmt_ratio(v)}"
                                   for v, c in zip(speed["speedup"], speed["clear"],
                                                   strict=True)],
                             case=[case_label(None, r.op, r.tokens) for r in speed.itertuples()])
        chart = charts.heatmap(
            speed, x="case", x_title=None, x_sort=list(dict.fromkeys(speed["case"])),
            y="label", y_title=None, value="speedup",
            value_title=f"× vs {REFERENCE}", text="text", log=True, domain_mid=1,
            scheme="redblue", cell=70, tips=["run", "median_ms"],
            title=f"Speedup vs {REFERENCE} (within the run)",
        )
        page.chart(chart, rows, "Blue: faster than triton/sorted; red: slower (colours "
                                "saturate at 4×); ~: no clear difference (within the noise).")
    _numerics(page, rows)
    _shared.power_table(page, rows, {"label": "impl/dispatch", "op": "op", "tokens": "tokens"},
                        name=f"decoder-{run}")
    if (rows["status"] != "measured").any():
        _shared.not_measured(page, rows, "decoder case",
                             {"label": "impl/dispatch", "op": "op", "tokens": "tokens"},
                             name=f"decoder-{run}", heading="### Not measured in this run")


def _numerics(page: Page, rows: pd.DataFrame) -> None:
    metrics = {"rel_err_out": "output", "rel_err_grad_x": "grad x",
               "rel_err_grad_params": "grad params"}
    rows = rows[rows[list(metrics)].notna().any(axis=1)].drop_duplicates(
        ["source_row", "label", "tokens"])
    if rows.empty:
        return
    reference = ", ".join(sorted(rows["rel_err_ref"].dropna().unique()))
    display = rows[["label", "tokens", *metrics]].rename(columns=metrics)
    display["tokens"] = display["tokens"].map(fmt_int)
    for name in metrics.values():
        display[name] = display[name].map(lambda v: fmt_num(v, 3))
    page.table(display.rename(columns={"label": "impl/dispatch"}), rows,
               f"Relative errors vs {reference}.",
               collapsed=f"Numerics: relative errors vs {reference} ({len(display)} cases)")
