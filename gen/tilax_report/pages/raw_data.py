"""Raw data: every stored file, downloadable as it is, with its checksum and row counts."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .. import charts
from ..load import StoredResults
from ..render import RAW_DIR, Page, fmt_int

SLUG = "raw-data"
TITLE = "Raw data"


def build(results: StoredResults) -> str:
    files = results.files
    table = results.table
    page = Page(SLUG, TITLE)
    page.md(
        "Every stored result file, copied byte for byte into the site at build time. Click a "
        "file name to download it as stored (the SHA-256 below is of the stored file; a "
        "downloaded copy has the same). `data/README.md` in the repository says where each "
        "file came from. How the files are read into the report table: "
        "[table schema](schema.md)."
    )
    display = pd.DataFrame({
        "file": [f"[{name}]({RAW_DIR}/{name})" for name in files["source_file"]],
        "format": files["source_format"],
        "size": files["bytes"].map(lambda b: f"{b / 1024:.1f} KiB"),
        "stored rows": files["stored_rows"],
        "table rows": files["table_rows"],
        "failed rows": files["failed_rows"],
        "runs": files["runs"],
        "GPU": files["devices"],
        "SHA-256": files["sha256"].map(lambda h: f"`{h}`"),
    })
    page.table(display, table, "Every file in `data/results/`, linked in the first column.",
               name="raw-files", markdown_columns=("file", "SHA-256"))
    counts = (
        table.assign(outcome=table["status"].where(table["status"] == "ok", table["status"]))
        .groupby(["source_file", "outcome"]).size().rename("rows").reset_index()
    )
    chart = (
        alt.Chart(counts)
        .mark_bar()
        .encode(
            alt.Y("source_file:N", title=None),
            alt.X("rows:Q", title="table rows"),
            alt.Color("outcome:N", title="status",
                      scale=alt.Scale(domain=["ok", "error", "timeout"],
                                      range=["#4c78a8", "#e45756", "#f58518"])),
            tooltip=charts.tooltip(["source_file", "outcome", "rows"]),
        )
        .properties(width=480, height=alt.Step(22))
    )
    page.chart(charts.finish(chart, "Table rows per file by status"), table)
    page.md(f"{fmt_int(len(table))} table rows in all.")
    return page.render()

