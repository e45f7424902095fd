"""The "same implementation on different GPUs" section that the MoE layer and RBF pages share."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .. import charts
from ..render import Page, fmt_ms, join_names


def render_across_gpus(page: Page, rows: pd.DataFrame, what: str, devices: list[str]) -> None:
    """One chart and table of the same cases measured on several GPUs, labelled as different
    machines. ``rows`` come from ``analysis.across_devices`` with a ``case`` column added;
    ``what`` names the cases ("MoE layer case") and ``devices`` the GPUs that have any."""
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
    chart = charts.bars(
        rows, category="gpu", category_title=None, color="gpu", color_title="GPU (run)",
        log=True, row=alt.Row("case:N", title=None, header=alt.Header(labelAngle=0,
                                                                      labelAlign="left")),
        column=alt.Column("label:N", title=None), tips=["run", "q1_ms", "q3_ms"], width=160,
        title="Same case, different GPUs (different machines and runs)",
    )
    page.chart(chart, rows, "Each bar is one run on one machine.")
    display = rows[["case", "label", "gpu", "run"]].assign(
        median=[fmt_ms(r.median_ms, r.q1_ms, r.q3_ms) for r in rows.itertuples()])
    page.table(display.rename(columns={"median": "median ms (q1–q3)", "label": "impl",
                                       "gpu": "GPU"}), rows)
