"""Runs: one panel per run (every file of one commit on one GPU): its GPU, driver, CUDA, library
versions, commit and date, what was run and what was skipped; newest first."""

from __future__ import annotations

import pandas as pd

from .. import analysis, runs
from ..load import StoredResults
from ..render import RAW_DIR, Page, fmt_num, plural, run_anchor, run_link, skip_gist

PATH = "reports/runs.md"
TITLE = "Runs"
SLUG = "runs"
# Environment rows of a panel: tidy column -> label.
ENVIRONMENT = {
    "device": "GPU", "gpu_memory_gb": "GPU memory (GB)", "gpu_driver": "driver",
    "compute_capability": "compute capability", "cuda": "CUDA", "jax": "jax",
    "jaxlib": "jaxlib", "jax_cuda_plugin": "jax CUDA plugin", "triton": "Triton",
    "torch": "torch", "tokamax": "tokamax", "pykeops": "pykeops", "numpy": "numpy",
    "python": "Python", "commit": "commit",
}


def build(results: StoredResults) -> str:
    table = analysis.with_labels(results.table)
    catalogue = runs.catalogue(table)
    status = runs.suite_status(table)
    reasons = runs.skip_reasons(table)
    page = Page(SLUG, TITLE)
    page.md(
        "Every stored run, newest first (runs whose files record no date last). A run is "
        "everything measured at one commit on one GPU; our own runs are often stored as "
        "several files, one per device call, and the seed files hold several runs each. Each "
        "panel says on what it ran, what it measured, and what it skipped (never attempted) "
        "or failed."
    )
    page.table(pd.DataFrame({
        "run": [run_link(r) for r in catalogue["run"]],
        "GPU": catalogue["device"].map(analysis.short_gpu),
        "date": catalogue["date"].fillna("—"),
        "measured": catalogue["measured"], "failed": catalogue["failed"],
        "skipped": catalogue["skipped"], "commit": catalogue["commit"].fillna(""),
    }), table, name="runs-index", markdown_columns=("run",), key_columns=6)
    for run in catalogue.itertuples():
        _panel(page, run, table[table["run"] == run.run], status[status["run"] == run.run],
               reasons[reasons["run"] == run.run])
    return page.render()


def _panel(page: Page, run, rows: pd.DataFrame, status: pd.DataFrame,
           reasons: pd.DataFrame) -> None:
    gpu = analysis.short_gpu(run.device)
    page.md(f"## `{run.run}` {{#{run_anchor(run.run)}}}\n")
    when = run.date if isinstance(run.date, str) else "no date recorded"
    files = ", ".join(f"[{name}]({RAW_DIR}/{name})" for name in run.files)
    page.md(
        f"{gpu}, {when}; {plural(len(run.files), 'stored file')}: {files}. "
        f"{run.measured} rows measured, {run.failed} failed, {run.skipped} skipped."
        + (f" *Note stored with the run:* {run.note}" if isinstance(run.note, str) else "")
    )
    environment = [(label, getattr(run, column)) for column, label in ENVIRONMENT.items()]
    environment += [("started", run.started), ("bench mode", run.bench_modes),
                    ("time budget per call (s)",
                     ", ".join(fmt_num(b) for b in run.bench_budget_s)),
                    ("parts", run.bench_parts), ("code", run.codes)]
    shown = [(label, value) for label, value in environment
             if value is not None and not (isinstance(value, float) and pd.isna(value))
             and value != ""]
    page.table(pd.DataFrame(shown, columns=["", "value"]).map(_text), rows,
               "As the run's files record it (machine_info; the seed files' device block).",
               name=f"{run_anchor(run.run)}-environment", key_columns=2)
    counts = status.drop(columns=["run"])
    page.table(counts.rename(columns={"family": "family", "suite": "suite"}), rows,
               "What was run: stored rows per suite and status.",
               name=f"{run_anchor(run.run)}-suites", key_columns=5)
    if not reasons.empty:
        gist = reasons.assign(why=reasons["error"].map(skip_gist))
        gist = gist.groupby(["suite", "why"], sort=False)["rows"].sum().reset_index()
        page.table(gist.rename(columns={"rows": "skipped rows"})[["suite", "skipped rows",
                                                                  "why"]],
                   rows[rows["status"] == "skipped"],
                   "What was skipped: never attempted, and why.",
                   name=f"{run_anchor(run.run)}-skipped", key_columns=3)


def _text(value: object) -> str:
    if isinstance(value, float):
        return fmt_num(value)
    return str(value)
