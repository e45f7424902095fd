"""History: each benchmark case measured in more than one run on the same GPU, its changes
between consecutive runs, flagged only beyond the noise between runs (measured on identical
code), slower runs first."""

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
    run_anchor,
    run_link,
)

PATH = "reports/history.md"
TITLE = "History"
SLUG = "history"
VERDICT_COLOURS = {"slower": "#e45756", "faster": "#4c78a8", "no clear change": "#bab0ac",
                   "not judged": "#f2cf5b"}
# Run pairs and flagged changes shown open; the rest fold under a summary line.
OPEN_PAIRS = 10
OPEN_FLAGGED = 15
# Run pairs in the chart of every change (the newest ones).
CHART_PAIRS = 12
# Implementations that are tilax's own kernels: the drill-down opens on one of them.
TILAX_IMPLS = ("mosaic", "triton", "pallas", "blocked", "auto")


def build(results: StoredResults) -> str:
    table = analysis.with_labels(results.table)
    order = runs.run_order(results.rows)
    points = history.timeline(table, order)
    change_rows = history.changes(points)
    page = Page(SLUG, TITLE)
    page.md(
        "Has a case got slower or faster from one run to the next on the same GPU? Each "
        "point is a run's one value for a case (the median of its repeats). A change is "
        "flagged only when it passes the within-run test **and** exceeds the case's "
        "run-to-run spread, measured between runs of identical code (same hash of `src/` "
        "and `tests/bench/`); runs of identical code therefore never show a change. Slower "
        "runs come first, then every pair of consecutive runs (newest first), the noise "
        "model, the flagged changes, and one case over time. Undated seed runs cannot be "
        "placed in time and are left out."
    )
    if change_rows.empty:
        page.md("No case has been measured in two dated runs on the same GPU yet: there is no "
                "history to show. A second run of a suite on the same GPU will appear here.")
        return page.render()
    change_rows = change_rows.assign(case=_case_text(change_rows),
                                     verdict=_verdict(change_rows))
    points = points.assign(case=_case_text(points))
    pairs = history.run_pairs(change_rows)
    _slower_runs(page, pairs)
    _run_pairs(page, pairs, change_rows, table)
    _noise(page, results.rows, table)
    _flagged(page, change_rows, table)
    for device, per_device in points.groupby("device", sort=False):
        _drill_down(page, device, per_device, table[table["device"] == device])
    return page.render()


def _case_text(frame: pd.DataFrame) -> pd.Series:
    """'layer · pallas/sorted · E8 top-2 d512 h1024 · bfloat16 train_step · 32k'."""
    parts = []
    for row in frame.itertuples():
        size = [f"{name} {fmt_int(getattr(row, name))}" for name in ("tokens", "n")
                if not pd.isna(getattr(row, name))]
        knobs = [f"{name} {getattr(row, name)}" for name in
                 ("piece", "part", "exchange", "devices", "block_m", "block_q", "block_k",
                  "block_o", "precision", "profile", "repeat", "path", "kernel", "block_p",
                  "block_l", "num_warps", "num_stages")
                 if not pd.isna(getattr(row, name))]
        bits = [row.suite, row.label, row.config, f"{row.dtype} {row.op}", *size, *knobs]
        parts.append(" · ".join(str(b) for b in bits if isinstance(b, str) and b))
    return pd.Series(parts, index=frame.index, dtype="object")


def _verdict(frame: pd.DataFrame) -> pd.Series:
    return pd.Series([
        "not judged" if c is None or pd.isna(c) else
        "no clear change" if not c else "slower" if r > 1 else "faster"
        for c, r in zip(frame["clear"], frame["ratio"], strict=True)], index=frame.index)


def _pair_text(pair) -> str:
    return (f"**{analysis.short_gpu(pair.device)}**, run {run_link(pair.after_run)} "
            f"({pair.after_date}, commit `{pair.after_commit}`) against the run before it, "
            f"{run_link(pair.before_run)} ({pair.before_date}, commit `{pair.before_commit}`)")


def _percent(ratio: float) -> str:
    return f"{fmt_ratio(ratio)}, {(ratio - 1) * 100:+.0f}%"


def _slower_runs(page: Page, pairs: pd.DataFrame) -> None:
    page.md("## Slower runs\n")
    slower = history.regressions(pairs)
    if slower.empty:
        page.md("No run is clearly slower than the run before it on most of the cases both "
                "measured.")
        return
    for pair in slower.itertuples():
        page.md(
            f'!!! danger "Slower run: {pair.after_run}"\n\n'
            f"    {_pair_text(pair)}: **{pair.slower} of {pair.compared} cases clearly "
            f"slower** (median {_percent(pair.slower_ratio)}), "
            f"{plural(int(pair.faster), 'case')} clearly faster. "
            + ("Both runs measured identical code: look at the machine. "
               if pair.same_code else "")
            + "The flagged changes are listed below.\n")


def _commit_link(run: str, commit: object) -> str:
    """The run's commit, linked to its panel on the runs page (short where run ids are long)."""
    text = commit if isinstance(commit, str) else run
    return f"[`{text}`](runs.md#{run_anchor(run)})"


def _files_behind(table: pd.DataFrame, change_rows: pd.DataFrame) -> pd.DataFrame:
    """The tidy rows of the runs and files the compared values come from."""
    files = {f for column in ("before_source_files", "after_source_files")
             for value in change_rows[column] if isinstance(value, tuple) for f in value}
    runs_ = set(change_rows["before_run"]) | set(change_rows["after_run"])
    return table[table["run"].isin(runs_) & table["source_file"].isin(files)]


def _pair_table(pairs: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "GPU": pairs["device"].map(analysis.short_gpu),
        "run → next run": [f"{_commit_link(p.before_run, p.before_commit)} → "
                           f"{_commit_link(p.after_run, p.after_commit)}"
                           for p in pairs.itertuples()],
        "code": ["identical" if same else "changed" for same in pairs["same_code"]],
        "cases": pairs["compared"],
        "slower": pairs["slower"], "faster": pairs["faster"],
        "no clear change": pairs["tie"], "not judged": pairs["unjudged"],
        "median change": pairs["median_ratio"].map(lambda r: f"{(r - 1) * 100:+.1f}%"),
        "dates": pairs["before_date"] + " → " + pairs["after_date"],
    })


def _run_pairs(page: Page, pairs: pd.DataFrame, change_rows: pd.DataFrame,
               table: pd.DataFrame) -> None:
    page.md("## Changes between consecutive runs\n")
    page.md(
        "Each pair of runs that measured some case in common, newest first: how many of "
        "those cases got clearly slower or faster, or stayed within the noise. *Code "
        "identical*: both runs measured the same `src/` and `tests/bench/` (same code "
        "hash), so every difference between them is noise. *Not judged*: a row without a "
        "spread, or a superseded peer row."
    )
    pair_keys = ["device", "before_run", "after_run"]
    for part, name, collapsed in (
            (pairs.head(OPEN_PAIRS), "history-pairs", None),
            (pairs.iloc[OPEN_PAIRS:], "history-pairs-earlier",
             f"{plural(len(pairs) - OPEN_PAIRS, 'earlier pair')} of runs")):
        if part.empty:
            continue
        behind = _files_behind(table, change_rows.merge(part[pair_keys], on=pair_keys))
        page.table(_pair_table(part), behind, name=name, markdown_columns=("run → next run",),
                   key_columns=3, collapsed=collapsed)
    newest = pairs.head(CHART_PAIRS)
    shown = change_rows.merge(newest[pair_keys], on=pair_keys)
    shown = shown.assign(pair=shown["before_commit"].fillna("?") + " → "
                         + shown["after_commit"].fillna("?"))
    pair_order = list(dict.fromkeys(newest["before_commit"].fillna("?") + " → "
                                    + newest["after_commit"].fillna("?")))
    strip = (
        alt.Chart(shown)
        .mark_point(filled=True, size=45, opacity=0.8)
        .encode(
            alt.X("ratio:Q", title="next run / run (median time, log scale)",
                  scale=alt.Scale(type="log", nice=False, padding=12)),
            alt.Y("pair:N", title="commits (newest first)", sort=pair_order),
            alt.YOffset("verdict:N", sort=list(VERDICT_COLOURS)),
            alt.Color("verdict:N", title="verdict",
                      scale=alt.Scale(domain=list(VERDICT_COLOURS),
                                      range=list(VERDICT_COLOURS.values()))),
            tooltip=charts.tooltip(["case", alt.Tooltip("ratio", format=".3f"), "verdict",
                                    "before_run", "after_run", "method",
                                    alt.Tooltip("run_spread", format=".3f")]),
        )
        .properties(width=520, height=min(1000, 30 * len(pair_order) + 20))
    )
    rule = alt.Chart().mark_rule(strokeDash=[4, 3], color="#555").encode(x=alt.datum(1))
    page.chart(charts.finish(alt.layer(strip, rule), "Every change of the newest "
                             f"{plural(len(pair_order), 'pair')} of runs"),
               _files_behind(table, shown),
               "One point per case; right of the dashed line: slower than the run before.")


def _noise(page: Page, rows: pd.DataFrame, table: pd.DataFrame) -> None:
    page.md("## Noise between runs\n")
    groups = history.identical_code_groups(rows)
    if groups.empty:
        page.md("No case has been measured twice with identical code: the run-to-run spread "
                "is unknown, and a change is flagged by the within-run test alone.")
        return
    limits = history.noise_limits(groups)
    sentences = []
    for device, per_device in groups.groupby("device", sort=False):
        widest = per_device.loc[per_device["log_range"].idxmax()]
        faults = int((per_device["log_range"] > limits.loc[device, "fence"]).sum())
        sentences.append(
            f"**{analysis.short_gpu(device)}**: {plural(len(per_device), 'case')} measured "
            f"more than once with identical code ({fmt_int(per_device['measurements'].sum())} "
            f"measurements); their spread, log(max / min), has median "
            f"{per_device['log_range'].median():.1%} and is at most "
            f"{widest['log_range']:.1%} ({widest['suite']} {widest['impl']} "
            f"{widest['op']}: {fmt_ms(widest['min_ms'])}–{fmt_ms(widest['max_ms'])} ms). "
            f"Floor: **{limits.loc[device, 'floor']:.1%}** (the "
            f"{history.FLOOR_QUANTILE:.0%} quantile), the spread of every case without a "
            f"larger one of its own; a spread above {limits.loc[device, 'fence']:.1%} (the "
            "far-out fence) is a fault, not noise"
            + (f" ({plural(faults, 'case')} beyond it)." if faults else "."))
    page.md(
        "Measurements of one case with identical code (several files of one run, or runs "
        "filed under different commits whose code hash is the same) differ by noise alone. "
        "A case's run-to-run spread is the largest such difference, and never below a "
        "floor taken from all of them; a change must exceed it to be flagged. See the "
        "[schema](schema.md#noise-between-runs).")
    page.md("\n".join(f"- {s}" for s in sentences))
    display = analysis.with_labels(groups)
    display = display.assign(case=_case_text(display)).sort_values("log_range", ascending=False)
    page.table(pd.DataFrame({
        "case": display["case"],
        "code hash": display["code_hash"].str[:12],
        "measurements": display["measurements"], "runs": display["runs"],
        "min ms": display["min_ms"].map(fmt_ms), "max ms": display["max_ms"].map(fmt_ms),
        "spread": display["log_range"].map(lambda v: f"{v:.2%}"),
        "GPU": display["device"].map(analysis.short_gpu),
    }), rows[rows["code_hash"].isin(set(groups["code_hash"]))],
        "Every case measured more than once with identical code, widest spread first.",
        name="history-noise", key_columns=3,
        collapsed=f"The {plural(len(groups), 'identical-code group')} behind the spread")


def _flagged_table(flagged: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "case": flagged["case"],
        "change": [change_phrase(r, c) for r, c in zip(flagged["ratio"], flagged["clear"],
                                                        strict=True)],
        "before ms (q1–q3)": [_value(r, "before") for r in flagged.itertuples()],
        "after ms (q1–q3)": [_value(r, "after") for r in flagged.itertuples()],
        "spread": flagged["run_spread"].map(lambda v: "" if pd.isna(v) else f"{v:.1%}"),
        "commits": [f"{_commit_link(r.before_run, r.before_commit)} → "
                    f"{_commit_link(r.after_run, r.after_commit)}" for r in flagged.itertuples()],
        "GPU": flagged["device"].map(analysis.short_gpu),
    })


def _value(row, side: str) -> str:
    text = fmt_ms(getattr(row, f"{side}_median_ms"), getattr(row, f"{side}_q1_ms"),
                  getattr(row, f"{side}_q3_ms"))
    repeats = getattr(row, f"{side}_repeats")
    if not pd.isna(repeats) and repeats > 1:
        text += (f" · median of {repeats}, {fmt_ms(getattr(row, f'{side}_repeat_min_ms'))}–"
                 f"{fmt_ms(getattr(row, f'{side}_repeat_max_ms'))}")
    return text


def _flagged(page: Page, change_rows: pd.DataFrame, table: pd.DataFrame) -> None:
    flagged = change_rows[change_rows["clear"].eq(True)].copy()
    page.md("## Flagged changes\n")
    if flagged.empty:
        page.md("No change between consecutive runs is beyond the noise.")
        return
    flagged["size"] = (flagged["ratio"] - 1).abs()
    flagged = flagged.sort_values(["size", "case"], ascending=[False, True])
    page.md(f"{plural(len(flagged), 'case')} changed beyond the noise between consecutive runs "
            "on the same GPU, largest change first; *spread* is the case's run-to-run spread "
            "the change exceeds.")
    caption = ("Before: the earlier run; after: the next run on the same GPU that measured "
               "the case.")
    page.table(_flagged_table(flagged.head(OPEN_FLAGGED)),
               _files_behind(table, flagged.head(OPEN_FLAGGED)), caption,
               name="history-flagged", key_columns=3, markdown_columns=("commits",))
    if len(flagged) > OPEN_FLAGGED:
        page.table(_flagged_table(flagged.iloc[OPEN_FLAGGED:]),
                   _files_behind(table, flagged.iloc[OPEN_FLAGGED:]), caption,
                   name="history-flagged-more", key_columns=3, markdown_columns=("commits",),
                   collapsed=f"{plural(len(flagged) - OPEN_FLAGGED, 'more flagged change')}")


def opening_case(points: pd.DataFrame) -> str:
    """The case the drill-down opens on: among tilax's own kernels (`TILAX_IMPLS`), the case
    measured in the most runs (then the larger problem, then by name)."""
    own = points[points["impl"].isin(TILAX_IMPLS)]
    pool = own if not own.empty else points
    counts = pool.groupby("case").agg(runs=("run", "nunique"), size=("tokens", "max"),
                                      n=("n", "max")).fillna(0)
    counts = counts.sort_values(["runs", "size", "n"], ascending=False, kind="stable")
    return str(counts.index[0])


def _drill_down(page: Page, device: str, points: pd.DataFrame, rows: pd.DataFrame) -> None:
    gpu = analysis.short_gpu(device)
    page.md(f"## {gpu}: one case over time\n")
    points = points.sort_values("order")
    points = points.assign(
        run_label=points["date"] + " · " + points["commit"].fillna(points["run"]),
        low=points["repeat_min_ms"], high=points["repeat_max_ms"])
    run_labels = list(dict.fromkeys(points["run_label"]))
    cases = sorted(points["case"].unique())
    first = opening_case(points)
    choose = alt.param(name="shown_case", value=first,
                       bind=alt.binding_select(options=cases, name="case "))
    base = alt.Chart(points).transform_filter(alt.datum.case == choose).encode(
        alt.X("run_label:N", title="run (date · commit)", sort=run_labels,
              axis=alt.Axis(labelAngle=-40, labelLimit=200)))
    y_scale = alt.Scale(zero=False, nice=True)
    timeline = alt.layer(
        base.mark_line(color="#4c78a8").encode(
            alt.Y("median_ms:Q", title="median time (ms)", scale=y_scale)),
        base.mark_rule(strokeWidth=6, color="#9ecae9").encode(
            alt.Y("low:Q", scale=y_scale), alt.Y2("high:Q")),
        base.mark_rule(strokeWidth=2, color="#4c78a8").encode(
            alt.Y("q1_ms:Q", scale=y_scale), alt.Y2("q3_ms:Q")),
        base.mark_point(filled=True, size=60, color="#4c78a8").encode(
            alt.Y("median_ms:Q", scale=y_scale),
            tooltip=charts.tooltip(["case", "run", "commit", "date", "median_ms", "q1_ms",
                                    "q3_ms", "rounds", "repeats", "low", "high",
                                    "source_file"])),
    ).add_params(choose).properties(width=620, height=260)
    page.chart(charts.finish(timeline, f"{gpu}: one case over time"),
               rows[rows["run"].isin(set(points["run"]))],
               f"Choose the case in the list under the chart ({plural(len(cases), 'case')} "
               "measured in two or more runs on this GPU; it opens on the tilax kernel case "
               "measured in the most runs). Point: the run's median (of its repeats); thin "
               "rule: q1–q3; wide light rule: the range of the run's repeats.")
