"""The "same implementation on different GPUs" section that the MoE layer and RBF pages share:
one mark per run, on one shared log scale, labelled as different machines."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .. import charts
from ..render import Page, fmt_ms, join_names, rounds_cell

GPU_COLOURS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#b279a2", "#9d755d"]
# The chart's rows (implementation · case) at most: 17 px each keeps it under 1 000 px.
MAX_CHART_ROWS = 50


def render_across_gpus(page: Page, rows: pd.DataFrame, what: str, devices: list[str],
                       order: pd.Series) -> None:
    """One chart and table of the same cases measured on several GPUs, each GPU's newest run
    of each case. ``rows`` come from ``analysis.across_devices``, sorted in the order to
    show, with ``case`` (the case in words) and ``label`` (the implementation); ``what`` names
    the cases ("MoE layer case"), ``devices`` the GPUs that have any and ``order`` the runs'
    places in time."""
    page.md("## Same implementation on different GPUs\n")
    page.md(
        "!!! warning \"Different machines\"\n"
        "    These rows come from different runs on different machines (GPU, driver, software "
        "and load all differ). They show what each GPU measured; they are not a controlled "
        "comparison, and no ratio is computed across them.\n"
    )
    if rows.empty:
        page.md(
            f"No {what} was measured on more than one GPU yet (GPUs with such rows: "
            f"{join_names(devices) or 'none'}). A run on another GPU with the same suite and "
            "configuration will appear here."
        )
        return
    rows = rows.assign(impl_case=rows["label"] + " · " + rows["case"],
                       _when=rows["run"].map(order).fillna(-1))
    newest = rows.groupby(["impl_case", "gpu"])["_when"].transform("max")
    rows = rows[rows["_when"] == newest].drop(columns="_when")
    # still on several GPUs after keeping each GPU's newest run
    rows = rows[rows.groupby("impl_case")["gpu"].transform("nunique") >= 2]
    cases = list(dict.fromkeys(rows["impl_case"]))
    shown = rows[rows["impl_case"].isin(cases[:MAX_CHART_ROWS])]
    order = cases[:MAX_CHART_ROWS]
    gpus = sorted(rows["gpu"].unique())
    select = alt.selection_point(fields=["gpu"], bind="legend")
    chart = alt.Chart(shown).mark_tick(thickness=2, size=13).encode(
        alt.Y("impl_case:N", title=None, sort=order),
        alt.X("median_ms:Q", title="median time (ms, log scale, shared by every row)",
              scale=alt.Scale(type="log", nice=False, padding=10)),
        alt.Color("gpu:N", title="GPU", scale=alt.Scale(domain=gpus,
                                                        range=GPU_COLOURS[:len(gpus)])),
        opacity=alt.condition(select, alt.value(0.9), alt.value(0.1)),
        tooltip=charts.tooltip(["impl_case", "gpu", "run", "median_ms", "q1_ms", "q3_ms",
                                "rounds"]),
    ).add_params(select).properties(width=330, height=alt.Step(17))
    more = (f" The chart shows the first {MAX_CHART_ROWS} of {len(cases)} cases; the table "
            "below lists every one." if len(cases) > MAX_CHART_ROWS else "")
    page.chart(charts.finish(chart, "Same case, different GPUs (different machines and runs)"),
               shown, "One tick per GPU: its newest run of the case (hover for the run, "
                      "quartiles and rounds). Click a GPU in the legend to highlight it."
                      + more)
    display = pd.DataFrame({
        "impl": rows["label"], "case": rows["case"],
        "median ms (q1–q3)": [fmt_ms(r.median_ms, r.q1_ms, r.q3_ms) for r in rows.itertuples()],
        "GPU": rows["gpu"],
        "rounds": rows["rounds"].map(rounds_cell),
        "run": rows["run"],
    })
    page.table(display, rows, name=f"{page.slug}-across-gpus", key_columns=3,
               collapsed=f"All {len(display)} rows" if len(display) > 30 else None)


def sorted_rows(rows: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """``rows`` in numeric order of ``keys`` (n and tokens as numbers, not text)."""
    return rows.sort_values([k for k in keys if k in rows.columns], na_position="first",
                            kind="stable")

