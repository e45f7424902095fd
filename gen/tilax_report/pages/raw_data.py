"""Raw data: every stored file, downloadable as it is, with its checksum, its run and its rows
per status (measured, failed, skipped)."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .. import charts
from ..analysis import short_gpu
from ..load import StoredResults
from ..render import RAW_DIR, Page, fmt_int, run_link
from .overview import STATUS_COLOURS

PATH = "reports/raw-data.md"
TITLE = "Raw data"
SLUG = "raw-data"


def build(results: StoredResults) -> str:
    files = results.files
    table = results.rows  # every stored row as read, one per file and row
    page = Page(SLUG, TITLE)
    page.md(
        "Every stored result file, copied byte for byte into the site at build time. Click a "
        "file name to download it as stored (the SHA-256 below is of the stored file; a "
        "downloaded copy has the same). `data/README.md` in the repository says where each "
        "file came from. How the files are read into the report table: "
        "[table schema](schema.md). Stored rows are counted as **measured**, **failed** "
        "(attempted, with the error) and **skipped** (never attempted, with why)."
    )
    file_runs = table.groupby("source_file")["run"].agg(lambda s: sorted(s.unique()))
    display = pd.DataFrame({
        "file": [f"[{name}]({RAW_DIR}/{name})" for name in files["source_file"]],
        "measured": files["measured_rows"],
        "failed": files["failed_rows"],
        "skipped": files["skipped_rows"],
        "stored rows": files["stored_rows"],
        "run": [", ".join(run_link(r) for r in runs) if len(runs) <= 3
                else f"{len(runs)} runs" for runs in files["source_file"].map(file_runs)],
        "GPU": files["devices"],
        "format": files["source_format"],
        "size": files["bytes"].map(lambda b: f"{b / 1024:.1f} KiB"),
        "SHA-256": files["sha256"].map(lambda h: f"`{h}`"),
    })
    page.table(display, table, "Every file in `data/results/`, linked in the first column.",
               name="raw-files", markdown_columns=("file", "run", "SHA-256"), key_columns=4)
    # Per GPU and suite rather than per file: one bar per file made a chart 2,600 px tall.
    per_row = table.drop_duplicates(["source_file", "source_row"])
    per_row = per_row.assign(gpu=per_row["device"].map(short_gpu).fillna("unknown GPU"))
    counts = (per_row.groupby(["gpu", "suite", "status"]).size().rename("rows").reset_index())
    counts["GPU · suite"] = counts["gpu"] + " · " + counts["suite"]
    files_per = per_row.groupby(["gpu", "suite"])["source_file"].nunique().rename("files")
    counts = counts.merge(files_per.reset_index(), on=["gpu", "suite"])
    chart = (
        alt.Chart(counts)
        .mark_bar()
        .encode(
            alt.Y("GPU · suite:N", title=None),
            alt.X("rows:Q", title="stored rows", stack="zero"),
            alt.Color("status:N", title="status",
                      scale=alt.Scale(domain=list(STATUS_COLOURS),
                                      range=list(STATUS_COLOURS.values()))),
            alt.Order("status_order:Q"),
            tooltip=charts.tooltip(["gpu", "suite", "status", "rows", "files"]),
        )
        .transform_calculate(status_order="indexof(['measured','failed','skipped'], "
                                          "datum.status)")
        .properties(width=360, height=alt.Step(16))
    )
    page.chart(charts.finish(chart, "Stored rows per GPU and suite, by status"), table,
               "The table above has the same counts per file.")
    split = files[files["table_rows"] != files["stored_rows"]]["source_file"]
    page.md(f"{fmt_int(len(table))} stored rows as read ({fmt_int(len(results.table))} once "
            "each case of a run is one row)."
            + (f" {', '.join(f'`{f}`' for f in split)} store several ops of a case in one row, "
               "which the table splits into one row per op." if not split.empty else ""))
    return page.render()
