"""History: each benchmark case measured in more than one run on the same GPU, as a timeline,
and its changes between consecutive runs, flagged where they are beyond the noise."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .. import analysis, charts, history, runs
from ..load import StoredResults
from ..render import (
    Page,
    change_phrase,
    fmt_int,
    fmt_ms,
    fmt_ratio,
    plural,
    rounds_cell,
    run_link,
)
from . import _shared

PATH = "reports/history.md"
TITLE = "History"
SLUG = "history"
VERDICT_COLOURS = {"slower": "#e45756", "faster": "#4c78a8", "no clear change": "#bab0ac",
                   "noise unknown": "#f2cf5b"}
# Flagged changes listed in the open table before it folds.
OPEN_ROWS = 30


def build(results: StoredResults) -> str:
    table = analysis.with_labels(results.table)
    order = runs.run_order(table)
    points = history.timeline(table, order)
    change_rows = history.changes(points)
    page = Page(SLUG, TITLE)
    page.md(
        "The same benchmark case (suite, implementation, shapes, dtype, op) measured in more "
        "than one run **on the same GPU**, in the order the runs were made, as "
        "asv and conbench show it: a timeline of its median "
        "(with q1–q3), and every change between consecutive runs that measured it, flagged "
        "as *slower* or *faster* only where it is beyond the noise. Runs on different GPUs are "
        "never in one timeline; runs without a recorded date (the seed files) cannot be "
        "placed in time and are left out. A change between runs is a change of the code "
        "**and** of everything else on the machine (driver, library versions): the runs "
        "page lists both."
    )
    page.md(_shared.NOISE_RULE.replace("faster than B", "slower than in the run before"))
    if change_rows.empty:
        page.md("No case has been measured in two dated runs on the same GPU yet: there is no "
                "history to show. A second run of a suite on the same GPU will appear here.")
        return page.render()
    change_rows = change_rows.assign(case=_case_text(change_rows))
    points = points.assign(case=_case_text(points))
    _run_pairs(page, change_rows, table)
    _flagged(page, change_rows, table)
    for device, per_device in points.groupby("device", sort=False):
        _timeline(page, device, per_device, change_rows[change_rows["device"] == device],
                  table[table["device"] == device])
    return page.render()


def _case_text(frame: pd.DataFrame) -> pd.Series:
    """'layer · pallas/sorted · E8 top-2 d512 h1024 · bfloat16 train_step · 32k'."""
    parts = []
    for row in frame.itertuples():
        size = [f"{name} {fmt_int(getattr(row, name))}" for name in ("tokens", "n")
                if not pd.isna(getattr(row, name))]
        knobs = [f"{name} {getattr(row, name)}" for name in
                 ("piece", "part", "exchange", "devices", "block_m", "block_q", "block_k",
                  "block_o", "precision", "repeat", "path", "kernel", "block_p", "block_l",
                  "num_warps", "num_stages")
                 if not pd.isna(getattr(row, name))]
        bits = [row.suite, row.label, row.config, f"{row.dtype} {row.op}", *size, *knobs]
        parts.append(" · ".join(str(b) for b in bits if isinstance(b, str) and b))
    return pd.Series(parts, index=frame.index, dtype="object")


def _verdict(frame: pd.DataFrame) -> pd.Series:
    clear = frame["clear"]
    return pd.Series([
        "noise unknown" if c is None or pd.isna(c) else
        "no clear change" if not c else "slower" if r > 1 else "faster"
        for c, r in zip(clear, frame["ratio"], strict=True)], index=frame.index)


def _run_pairs(page: Page, change_rows: pd.DataFrame, table: pd.DataFrame) -> None:
    page.md("## Changes between consecutive runs\n")
    pairs = history.run_pairs(change_rows)
    sentences = []
    for pair in pairs.itertuples():
        parts = []
        if pair.slower:
            parts.append(f"**{pair.slower} slower** (median {_percent(pair.slower_ratio)})")
        if pair.faster:
            parts.append(f"**{pair.faster} faster** (median {_percent(pair.faster_ratio)})")
        if pair.tie:
            parts.append(f"{pair.tie} with no clear change")
        if pair.unjudged:
            parts.append(f"{pair.unjudged} not judged (no spread stored)")
        sentences.append(
            f"**{analysis.short_gpu(pair.device)}**, run {run_link(pair.before_run)} "
            f"({pair.before_date}, commit `{pair.before_commit}`) → run "
            f"{run_link(pair.after_run)} ({pair.after_date}, commit `{pair.after_commit}`): "
            f"{plural(pair.compared, 'case')} measured in both; " + ", ".join(parts) + ".")
    page.md("\n".join(f"- {s}" for s in sentences))


def _percent(ratio: float) -> str:
    return f"{fmt_ratio(ratio)}, {(ratio - 1) * 100:+.0f}%"


def _flagged(page: Page, change_rows: pd.DataFrame, table: pd.DataFrame) -> None:
    flagged = change_rows[change_rows["clear"].eq(True)].copy()
    page.md("## Flagged changes\n")
    if flagged.empty:
        page.md("No change between consecutive runs is beyond the noise.")
        return
    flagged["size"] = (flagged["ratio"] - 1).abs()
    flagged = flagged.sort_values(["size", "case"], ascending=[False, True])
    page.md(f"{plural(len(flagged), 'case')} changed beyond the noise between consecutive runs "
            "on the same GPU, largest change first.")
    display = pd.DataFrame({
        "case": flagged["case"],
        "change": [change_phrase(r, c) for r, c in zip(flagged["ratio"], flagged["clear"],
                                                        strict=True)],
        "before ms (q1–q3)": [fmt_ms(r.before_median_ms, r.before_q1_ms, r.before_q3_ms)
                              for r in flagged.itertuples()],
        "after ms (q1–q3)": [fmt_ms(r.after_median_ms, r.after_q1_ms, r.after_q3_ms)
                             for r in flagged.itertuples()],
        "rounds": [f"{rounds_cell(b)} → {rounds_cell(a)}" for b, a in
                   zip(flagged["before_rounds"], flagged["after_rounds"], strict=True)],
        "runs": flagged["before_run"] + " → " + flagged["after_run"],
        "commits": flagged["before_commit"].fillna("?") + ".." +
                   flagged["after_commit"].fillna("?"),
        "GPU": flagged["device"].map(analysis.short_gpu),
    })
    runs_behind = table[table["run"].isin(set(flagged["before_run"]) | set(flagged["after_run"]))]
    page.table(display, runs_behind, "Before: the earlier run; after: the next run on the same "
               "GPU that measured the case.", name="history-flagged", key_columns=3,
               collapsed=f"All {len(flagged)} flagged changes" if len(flagged) > OPEN_ROWS
               else None)


def _timeline(page: Page, device: str, points: pd.DataFrame, change_rows: pd.DataFrame,
              rows: pd.DataFrame) -> None:
    gpu = analysis.short_gpu(device)
    page.md(f"## {gpu}\n")
    points = points.sort_values("order")
    points = points.assign(
        run_label=points["date"] + " · " + points["commit"].fillna(points["run"]))
    run_labels = list(dict.fromkeys(points["run_label"]))
    change_rows = change_rows.assign(
        verdict=_verdict(change_rows),
        pair=change_rows["before_commit"].fillna("?") + " → " +
             change_rows["after_commit"].fillna("?"))
    strip = (
        alt.Chart(change_rows)
        .mark_point(filled=True, size=50, opacity=0.8)
        .encode(
            alt.X("ratio:Q", title="after / before (median time, log scale)",
                  scale=alt.Scale(type="log", nice=False, padding=12)),
            alt.Y("pair:N", title="commits", sort=None),
            alt.YOffset("verdict:N"),
            alt.Color("verdict:N", title="verdict",
                      scale=alt.Scale(domain=list(VERDICT_COLOURS),
                                      range=list(VERDICT_COLOURS.values()))),
            tooltip=charts.tooltip(["case", alt.Tooltip("ratio", format=".3f"), "verdict",
                                    "before_run", "after_run", "method"]),
        )
        .properties(width=460, height=alt.Step(18))
    )
    rule = alt.Chart().mark_rule(strokeDash=[4, 3], color="#555").encode(x=alt.datum(1))
    page.chart(charts.finish(alt.layer(strip, rule), f"{gpu}: every change between consecutive "
                             "runs"), rows[rows["run"].isin(set(points["run"]))],
               "One point per case; right of the dashed line: slower than the run before.")
    cases = list(points.groupby("case")["median_ms"].count().sort_index().index)
    biggest = change_rows.assign(size=(change_rows["ratio"] - 1).abs()).sort_values(
        "size", ascending=False)["case"].iloc[0]
    choose = alt.param(name="shown_case", value=biggest,
                       bind=alt.binding_select(options=cases, name="case "))
    base = alt.Chart(points).transform_filter(alt.datum.case == choose).encode(
        alt.X("run_label:N", title="run (date · commit)", sort=run_labels,
              axis=alt.Axis(labelAngle=-30, labelLimit=220)))
    y_scale = alt.Scale(type="log", nice=False, padding=12)
    timeline = alt.layer(
        base.mark_line(color="#4c78a8").encode(
            alt.Y("median_ms:Q", title="median time (ms)", scale=y_scale)),
        base.mark_point(filled=True, size=60, color="#4c78a8").encode(
            alt.Y("median_ms:Q", scale=y_scale),
            tooltip=charts.tooltip(["case", "run", "commit", "date", "median_ms", "q1_ms",
                                    "q3_ms", "rounds", "source_file"])),
        base.mark_rule(strokeWidth=2, color="#4c78a8").encode(
            alt.Y("q1_ms:Q", scale=y_scale), alt.Y2("q3_ms:Q")),
    ).add_params(choose).properties(width=460, height=220)
    page.chart(charts.finish(timeline, f"{gpu}: one case over time"), rows[
        rows["run"].isin(set(points["run"]))],
        f"Choose the case in the list under the chart ({plural(len(cases), 'case')} measured "
        "in two or more runs on this GPU; it opens on the largest change). Point: median; "
        "rule: q1–q3.")
