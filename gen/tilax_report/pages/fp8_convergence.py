"""FP8 convergence (suite ``fp8_convergence``): one small MoE language model trained twice with
identical seeds and data, its experts in bfloat16 and with ``MoEConfig(quantize="fp8")``. Per
run, newest first: whether FP8's final loss is within the issue's 1% (relative) of bfloat16's,
both loss curves with their floor, and each row's numbers; failed rows with their error, a
missing row named instead of a ratio."""

from __future__ import annotations

import math

import altair as alt
import pandas as pd

from .. import analysis, charts
from ..load import StoredResults
from ..prepared import prepared
from ..render import Page, fmt_int, fmt_ms, join_names, run_link, short_error
from . import _shared

PATH = "reports/fp8-convergence.md"
TITLE = "FP8 convergence"
SLUG = "fp8-convergence"
SUITE = "fp8_convergence"
#: The issue's target: FP8's final loss within this fraction (relative) of bfloat16's.
TARGET = 0.01
NOTHING_STORED = (
    "No run of the FP8 convergence suite is stored yet "
    "(`nox -s bench -- --bench-suite fp8_convergence`)."
)
#: The two trainings of one setup, in the order the page shows them.
PRECISIONS = ("bf16", "fp8")
FLOOR = "floor (teacher entropy)"
COLOURS = {"bf16": "#4c78a8", "fp8": "#e45756", FLOOR: "#79706e"}
# The columns that say which training a row is, besides its precision: the two rows of one
# setup are compared (the impl may differ: FP8 has its own).
SETUP = ["tokens", "d_model", "d_hidden", "experts", "top_k", "steps"]


def precision(quantize: object) -> str:
    """The row's precision label: its ``quantize`` (``fp8``), or ``bf16`` where none."""
    return quantize if isinstance(quantize, str) and quantize else "bf16"


def relative_difference(fp8_loss: float, bf16_loss: float) -> float:
    """(FP8's final loss - bfloat16's) / bfloat16's: above 0, FP8 ends higher (worse)."""
    return (fp8_loss - bf16_loss) / bf16_loss


def verdict(rows: pd.DataFrame) -> str:
    """One sentence on one setup's rows of one run: both final losses, their relative
    difference and whether it is within `TARGET`; or which row is missing, failed or skipped
    (no ratio then)."""
    by = _by_precision(rows)
    missing = [p for p in PRECISIONS if p not in by]
    if missing:
        held = [p for p in PRECISIONS if p in by]
        return (
            f"No comparison: this run stores no {join_names(missing)} row (only "
            f"{join_names(held)})."
        )
    for name in PRECISIONS:
        row = by[name]
        if row["status"] == "failed":
            return f"No comparison: the {name} row failed ({short_error(row['error'])})."
        if row["status"] != "measured":
            return f"No comparison: the {name} row was not run ({short_error(row['error'])})."
        if pd.isna(row["final_loss"]):
            return f"No comparison: the {name} row stored no final loss."
    bf16, fp8 = by["bf16"]["final_loss"], by["fp8"]["final_loss"]
    steps = (
        f"after {fmt_int(by['bf16']['steps'])} steps"
        if pd.notna(by["bf16"]["steps"])
        else "at the end"
    )
    losses = (
        f"{steps} the final loss is {bf16:.4f} in bfloat16 and {fp8:.4f} with FP8 "
        f"(floor {by['bf16']['final_floor']:.4f})"
    )
    if not (math.isfinite(bf16) and math.isfinite(fp8)):
        return f"**Not within the 1% target**: {losses}, not a finite pair to compare."
    difference = relative_difference(fp8, bf16)
    if abs(difference) <= TARGET:
        head = f"**FP8 is within the {TARGET:.0%} target**"
    elif difference > 0:
        head = f"**FP8 misses the {TARGET:.0%} target**"
    else:
        head = f"**FP8 is outside the {TARGET:.0%} band, lower than bfloat16**"
    return f"{head}: {losses}, {difference:+.2%} relative."


def curves(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows' loss curves as long data (``step``, ``loss``, ``series``): one series per
    precision and the floor (of the first row with a curve: the two trainings see the same
    data); points whose loss is not finite are left out (a diverged training ends its line)."""
    parts, floor = [], None
    for _, row in _ordered(rows).iterrows():
        curve = row["loss_curve"]
        if not isinstance(curve, tuple) or not curve:
            continue
        steps, losses, floors = zip(*curve, strict=True)
        parts.append(
            pd.DataFrame({"step": steps, "loss": losses, "series": precision(row["quantize"])})
        )
        if floor is None:
            floor = pd.DataFrame({"step": steps, "loss": floors, "series": FLOOR})
    if not parts:
        return pd.DataFrame(columns=["step", "loss", "series"])
    data = pd.concat([*parts, floor], ignore_index=True)
    return data[data["loss"].map(math.isfinite)].reset_index(drop=True)


def curve_chart(data: pd.DataFrame, title: str) -> alt.TopLevelMixin:
    """Loss vs step, one solid line per precision and the floor dashed; click a legend entry
    to highlight a line."""
    series = [s for s in [*PRECISIONS, FLOOR] if s in set(data["series"])]
    colour = alt.Color(
        "series:N",
        title=None,
        scale=alt.Scale(domain=series, range=[COLOURS[s] for s in series]),
        legend=alt.Legend(symbolType="stroke", symbolStrokeWidth=2),
    )
    dash = alt.StrokeDash(
        "series:N",
        title=None,
        scale=alt.Scale(domain=series, range=[[6, 4] if s == FLOOR else [1, 0] for s in series]),
    )
    select = alt.selection_point(fields=["series"], bind="legend")
    opacity = alt.condition(select, alt.value(1.0), alt.value(0.15))
    base = alt.Chart().encode(
        x=alt.X("step:Q", title="train step", scale=alt.Scale(zero=False)),
        y=alt.Y("loss:Q", title="loss (nats)", scale=alt.Scale(zero=False, padding=10)),
        color=colour,
        opacity=opacity,
    )
    lines = base.mark_line(strokeWidth=1.8).encode(strokeDash=dash)
    points = (
        base.mark_point(filled=True, size=18)
        .encode(tooltip=charts.tooltip(["series", "step", alt.Tooltip("loss:Q", format=".4f")]))
        .add_params(select)
    )
    chart = alt.layer(lines, points, data=data).properties(width=520, height=260)
    return charts.finish(chart, title)


def build(results: StoredResults) -> str:
    ready = prepared(results)
    table = ready.table
    rows = table[(table["family"] == "moe") & (table["suite"] == SUITE)]
    page = Page(SLUG, TITLE)
    if rows.empty:
        page.md(NOTHING_STORED)
        return page.render()
    page.md(
        "Does training with FP8 experts converge as well as with bfloat16? The "
        "`fp8_convergence` suite trains one small MoE language model twice with identical "
        'seeds and data, its experts in bfloat16 and with `MoEConfig(quantize="fp8")`, on '
        "next-token prediction against a fixed random teacher whose entropy is the floor of "
        f"the loss. The target: FP8's final loss within {TARGET:.0%} (relative) of bfloat16's "
        "([FP8 in the MoE guide](../guides/moe.md#fp8-preview)). The newest run on each GPU "
        "comes first."
    )
    _shared.sections_newest_first(
        page, rows, ready.order, lambda *group: _run_section(page, *group))
    return page.render()


def _ordered(rows: pd.DataFrame) -> pd.DataFrame:
    """bf16 first, then FP8 (then any other precision); measured rows before the others."""
    rank = rows["quantize"].map(lambda q: (PRECISIONS + (precision(q),)).index(precision(q)))
    measured = rows["status"] != "measured"
    return (
        rows.assign(_rank=rank, _measured=measured)
        .sort_values(["_rank", "_measured"], kind="stable")
        .drop(columns=["_rank", "_measured"])
    )


def _by_precision(rows: pd.DataFrame) -> dict[str, pd.Series]:
    """precision -> the setup's row of that precision (a measured one where there is)."""
    by: dict[str, pd.Series] = {}
    for _, row in _ordered(rows).iterrows():
        by.setdefault(precision(row["quantize"]), row)
    return by


def _setup_label(row: pd.Series) -> str:
    return (
        f"E{fmt_int(row['experts'])} top-{fmt_int(row['top_k'])} d{fmt_int(row['d_model'])} "
        f"h{fmt_int(row['d_hidden'])}, {fmt_int(row['tokens'])} tokens a step, "
        f"{fmt_int(row['steps'])} steps"
    )


def _run_section(page: Page, device: str, run: str, rows: pd.DataFrame) -> None:
    page.heading(2, f"{device}, run {run_link(run)}")
    setups = [setup for _, setup in rows.groupby(SETUP, dropna=False, sort=True)]
    for index, setup in enumerate(setups):
        label = _setup_label(setup.iloc[0])
        if len(setups) > 1:
            page.heading(3, label)
        page.md(verdict(setup))
        page.chart(
            curve_chart(curves(setup), f"{device}: training loss, {label}"),
            setup,
            "Mean loss of the steps since the previous point; dashed: the floor, the "
            "teacher's entropy on the same contexts.",
        )
        _table(page, setup, name=f"fp8-convergence-{run}-{index}")


def _table(page: Page, rows: pd.DataFrame, name: str) -> None:
    rows = _ordered(rows)
    by = _by_precision(rows)
    base = by["bf16"]["final_loss"] if "bf16" in by else float("nan")
    per_step = rows["steps_per_call"].fillna(1).astype(float)
    display = pd.DataFrame(
        {
            "precision": rows["quantize"].map(precision),
            "status": [
                r.status if r.status != "failed" else f"failed ({analysis.failure_kind(r.error)})"
                for r in rows.itertuples()
            ],
            "final loss": rows["final_loss"].map(lambda v: "" if pd.isna(v) else f"{v:.4f}"),
            "vs bf16": [
                _versus(q, v, base)
                for q, v in zip(rows["quantize"], rows["final_loss"], strict=True)
            ],
            "floor": rows["final_floor"].map(lambda v: "" if pd.isna(v) else f"{v:.4f}"),
            "steps": rows["steps"].map(fmt_int),
            "tokens a step": rows["tokens"].map(fmt_int),
            "ms a train step (q1–q3)": [
                fmt_ms(m / n, q1 / n, q3 / n)
                for m, q1, q3, n in zip(
                    rows["median_ms"], rows["q1_ms"], rows["q3_ms"], per_step, strict=True
                )
            ],
            "rounds": rows["rounds"].map(fmt_int),
            "impl": rows["impl"],
            "error": rows["error"].map(short_error),
        }
    )
    calls = sorted({fmt_int(n) for n in rows["steps_per_call"].dropna()})
    page.table(
        display.fillna(""),
        rows,
        "Final loss: the mean of the last tenth of the steps; floor: the teacher's entropy on "
        "the same steps; vs bf16: (FP8 − bf16) / bf16 of the final loss. Time: one train "
        "step, the teacher's forward included (the median and quartiles of the timed rounds, "
        f"each a call of {join_names(calls) or 'one'} steps, divided by its steps).",
        name=name,
        key_columns=4,
    )


def _versus(quantize: object, loss: float, base: float) -> str:
    if precision(quantize) == "bf16":
        return "baseline"
    if pd.isna(loss) or pd.isna(base) or not (math.isfinite(loss) and math.isfinite(base)):
        return ""
    return f"{relative_difference(loss, base):+.2%}"
