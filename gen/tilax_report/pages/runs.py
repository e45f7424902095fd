"""Runs: one panel per run (every file of one commit on one GPU): its GPU, driver, CUDA, library
versions, the code it measured (declared commit, code hash, whether the tree was checked), what
was run and what was skipped. Newest first: the newest run of each GPU open, older runs folded
under their one-line summary."""

from __future__ import annotations

import html

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
# Characters of a code hash shown (the full hash is in the panel's table).
HASH_CHARS = 12


def build(results: StoredResults) -> str:
    rows = analysis.with_labels(results.rows)
    catalogue = runs.catalogue(rows)
    status = runs.suite_status(rows)
    reasons = runs.skip_reasons(rows)
    page = Page(SLUG, TITLE)
    page.md(
        "Every stored run, newest first. A run is everything measured at one commit on one "
        "GPU, often stored as several files (one per device call); the seed files hold "
        "several undated runs each, listed last. The newest run of each GPU is open below; "
        "older runs are folded under a one-line summary (click to open). Each panel says "
        "on what the run ran, **which code it measured** (the commit it was filed under, "
        "the hash of its `src/` and `tests/bench/`, and whether that was checked at bench "
        "time), what it measured, and what it skipped or failed."
    )
    page.md(PROVENANCE_NOTE)
    page.table(pd.DataFrame({
        "run": [run_link(r) for r in catalogue["run"]],
        "code hash": [_code_cell(r) for r in catalogue.itertuples()],
        "measured": catalogue["measured"], "failed": catalogue["failed"],
        "skipped": catalogue["skipped"],
    }), rows, "Code hash: its first characters, recorded at bench time (stored) or computed "
       "from the declared commit (declared); seed files record no commit.", name="runs-index",
       markdown_columns=("run", "code hash"), key_columns=2,
       collapsed=f"Index of all {plural(len(catalogue), 'run')}, with their code hashes")
    newest = set(catalogue.drop_duplicates("device")["run"])
    page.md("## Newest run of each GPU\n")
    for run in catalogue[catalogue["run"].isin(newest)].itertuples():
        _panel(page, run, rows[rows["run"] == run.run], status[status["run"] == run.run],
               reasons[reasons["run"] == run.run], folded=False)
    older = catalogue[~catalogue["run"].isin(newest)]
    if not older.empty:
        page.md(f"## Earlier runs\n\n{plural(len(older), 'earlier run')}, newest first; "
                "click a run to open its panel.")
    for run in older.itertuples():
        _panel(page, run, rows[rows["run"] == run.run], status[status["run"] == run.run],
               reasons[reasons["run"] == run.run], folded=True)
    return page.render()


PROVENANCE_NOTE = (
    "**Which code a run measured.** A run is filed under a *declared* commit. Files written "
    "since the bench harness records provenance carry the hash of the benched `src/` and "
    "`tests/bench/` and whether that tree was the declared commit's (shown as *stored*, "
    "checked). For older files the hash is computed from git for the declared commit "
    "(shown as *declared*: the label was never checked against the machine's tree, and "
    "pytest-benchmark often found another HEAD there, with uncommitted changes). Runs with "
    "the same hash measured identical code: the [history](history.md) page takes their "
    "differences as the noise between runs. See the "
    "[schema](schema.md#provenance)."
)


def _code_cell(run) -> str:
    if not isinstance(run.commit, str):
        return "seed file"
    if not run.code_hashes:
        return "unknown"
    hashes = ", ".join(f"`{h[:HASH_CHARS]}`" for h in run.code_hashes.split(", "))
    return f"{hashes} {run.code_hash_source}"


def _provenance_sentence(run) -> str:
    if not isinstance(run.commit, str):
        return "Code: no commit recorded (a seed file)."
    if not run.code_hashes:
        text = f"Code: declared commit `{run.commit}`, no code hash known for it."
    elif run.code_hash_source == "stored":
        checked = {True: "the benched tree was the declared commit's",
                   False: "**the benched tree was not the declared commit's**"}.get(
            run.tree_matches_declared, "whether the tree matched was not recorded")
        text = (f"Code: declared commit `{run.commit}`; code hash `{run.code_hashes}` recorded "
                f"at bench time; {checked}.")
    else:
        text = (f"Code: declared commit `{run.commit}` (a label, not checked at bench time); "
                f"code hash `{run.code_hashes}` computed from git for that commit.")
    if run.recorded_heads and run.recorded_heads != run.commit:
        dirty = " with uncommitted changes" if run.recorded_dirty else ""
        text += (f" pytest-benchmark found HEAD `{run.recorded_heads}`{dirty} on the GPU "
                 "host.")
    if run.same_code_runs:
        text += " Identical code to " + ", ".join(run_link(r) for r in run.same_code_runs) + "."
    return text


def _panel(page: Page, run, rows: pd.DataFrame, status: pd.DataFrame,
           reasons: pd.DataFrame, folded: bool) -> None:
    gpu = analysis.short_gpu(run.device)
    anchor = run_anchor(run.run)
    when = run.date if isinstance(run.date, str) else "no date recorded"
    counts = f"{run.measured} rows measured, {run.failed} failed, {run.skipped} skipped"
    if folded:
        commit = f", `{run.commit}`" if isinstance(run.commit, str) else ""
        page.md(f'<details class="tilax-details tilax-run" id="{anchor}" markdown="1">\n'
                f"<summary><code>{html.escape(run.run)}</code> · {html.escape(gpu)}, "
                f"{html.escape(when)}{html.escape(commit)} · {counts}</summary>\n")
    else:
        page.md(f"### `{run.run}` {{#{anchor}}}\n")
    files = ", ".join(f"[{name}]({RAW_DIR}/{name})" for name in run.files)
    page.md(
        f"{gpu}, {when}; {plural(len(run.files), 'stored file')}: {files}. {counts}."
        + (f" *Note stored with the run:* {run.note}" if isinstance(run.note, str) else "")
    )
    page.md(_provenance_sentence(run))
    environment = [(label, getattr(run, column)) for column, label in ENVIRONMENT.items()]
    environment += [("code hash", run.code_hashes), ("code hash from", run.code_hash_source),
                    ("HEAD found on the host", run.recorded_heads),
                    ("started", run.started), ("bench mode", run.bench_modes),
                    ("time budget per call (s)",
                     ", ".join(fmt_num(b) for b in run.bench_budget_s)),
                    ("parts", run.bench_parts), ("code", run.codes)]
    shown = [(label, value) for label, value in environment
             if value is not None and not (isinstance(value, float) and pd.isna(value))
             and value != ""]
    page.table(pd.DataFrame(shown, columns=["", "value"]).map(_text), rows,
               "As the run's files record it (machine_info; the seed files' device block).",
               name=f"{anchor}-environment", key_columns=2)
    counts = status.drop(columns=["run"])
    page.table(counts, rows, "What was run: stored rows per suite and status.",
               name=f"{anchor}-suites", key_columns=5)
    if not reasons.empty:
        gist = reasons.assign(why=reasons["error"].map(skip_gist))
        gist = gist.groupby(["suite", "why"], sort=False)["rows"].sum().reset_index()
        page.table(gist.rename(columns={"rows": "skipped rows"})[["suite", "skipped rows",
                                                                  "why"]],
                   rows[rows["status"] == "skipped"],
                   "What was skipped: never attempted, and why.",
                   name=f"{anchor}-skipped", key_columns=3)
    if folded:
        page.md("</details>")


def _text(value: object) -> str:
    if isinstance(value, float):
        return fmt_num(value)
    return str(value)
