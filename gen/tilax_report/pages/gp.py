"""Gaussian processes: the log marginal likelihood with its gradient by n (suite ``gp``:
``tilax.gp.mll`` beside GPyTorch with KeOps, tinygp's and tilax's dense Cholesky), and the
whole hyperparameter fit at a million points (suite ``gp_fit``), newest run per GPU first."""

from __future__ import annotations

import pandas as pd

from .. import analysis, charts
from ..load import StoredResults
from ..prepared import prepared
from ..render import Page, fmt_int, fmt_num, ms_cell, run_link, short_error
from . import _shared

PATH = "reports/gp.md"
TITLE = "Gaussian processes"
SLUG = "gp"
NOTHING_STORED = ("No Gaussian-process run is stored yet: the `gp` and `gp_fit` suites "
                  "(`nox -s bench -- --bench-suite gp`, `--bench-suite gp_fit`) write them.")
IMPL_TEXT = {
    "tilax": "`tilax.gp.mll` (matrix-free: preconditioned CG and stochastic Lanczos "
             "quadrature on the Pallas kernel sums)",
    "gpytorch_keops": "GPyTorch's exact GP on its KeOps RBF kernel (the same CG settings)",
    "tinygp": "tinygp's dense Cholesky",
    "dense": "tilax's dense Cholesky reference (`tilax.gp.reference.dense_mll`)",
}


def build(results: StoredResults) -> str:
    ready = prepared(results)
    rows = ready.table[ready.table["family"] == "gp"]
    page = Page(SLUG, TITLE)
    if rows.empty:
        page.md(NOTHING_STORED)
        return page.render()
    page.md(
        "How long one evaluation of a Gaussian process's log marginal likelihood with its "
        "gradient takes as the training set grows to a million points (D = 8, data drawn from "
        "a GP with known hyperparameters), how many CG iterations it needs and how close it is "
        "to the exact value; and how long a whole Adam fit of the hyperparameters takes at a "
        "million points. Implementations: "
        + "; ".join(f"**{impl}**: {text}" for impl, text in IMPL_TEXT.items())
        + ". The newest run on each GPU comes first; earlier runs are folded under *Earlier "
        "runs*. Dense rows beyond the device's memory are skipped, not attempted."
    )
    _shared.sections_newest_first(
        page, rows, ready.order, lambda *group: _run_section(page, *group))
    return page.render()


def _cell(row) -> str:
    if row.status == "measured":
        return ms_cell(row.median_ms, row.q1_ms, row.q3_ms, row.rounds)
    return f"failed ({analysis.failure_kind(row.error)})" if row.status == "failed" else "skipped"


def _run_section(page: Page, device: str, run: str, rows: pd.DataFrame) -> None:
    page.md(f"## {device}: run {run_link(run)}\n")
    evaluations = rows[rows["suite"] == "gp"].sort_values(["n", "impl"])
    fits = rows[rows["suite"] == "gp_fit"]
    if not evaluations.empty:
        _evaluations(page, device, evaluations)
    if not fits.empty:
        _fits(page, fits)


def _evaluations(page: Page, device: str, rows: pd.DataFrame) -> None:
    timed = analysis.timed(rows)
    chart = charts.lines(
        timed, x="n", x_title="training points n", color="impl", color_title="implementation",
        tips=["cg_iterations", "rel_err_mll", "rel_err_grad", "compile_s"],
        title=f"{device}: log marginal likelihood + gradient, median time vs n",
    )
    page.chart(chart, rows)
    display = pd.DataFrame({
        "impl": rows["impl"],
        "n": rows["n"].map(fmt_int),
        "ms per evaluation": [_cell(r) for r in rows.itertuples()],
        "CG iterations": rows["cg_iterations"].map(fmt_int),
        "log p(y | x)": rows["mll"].map(fmt_num),
        "rel. error of the value": rows["rel_err_mll"].map(fmt_num),
        "rel. error of the gradient": rows["rel_err_grad"].map(fmt_num),
        "why not measured": rows["error"].map(short_error),
    })
    page.table(display.fillna(""), rows,
               "One `value_and_grad` of the log marginal likelihood at the generating "
               "hyperparameters; relative errors against the float64 dense Cholesky value "
               "where it fits on the device (the gradient's norm-wise, in log-hyperparameters).",
               name="gp-evaluations")


def _fits(page: Page, rows: pd.DataFrame) -> None:
    display = pd.DataFrame({
        "n": rows["n"].map(fmt_int),
        "steps": rows["steps"].map(fmt_int),
        "fit time (s)": rows["fit_s"].map(fmt_num),
        "reached 10%": rows["converged"].map(
            lambda value: "" if pd.isna(value) else ("yes" if value else "no")),
        "status": rows["status"],
        "note": rows["error"].map(short_error),
    })
    page.table(display.fillna(""), rows,
               "Adam on the log marginal likelihood from the stated start until every "
               "hyperparameter is within 10% of the generating one (the time includes the "
               "first step's compilation).", name="gp-fit")
