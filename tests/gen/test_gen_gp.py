"""The Gaussian-process report (suites gp and gp_fit): a synthetic H200 run made from the bench's
own cases (tests/bench/bench_gp.py) is loaded with its GP columns, follows the bench contract,
and the page shows each row's time or status, CG iterations and errors, and the fit."""

import json
import re

import bench_gp
import bench_rows
import pytest
import synthetic_runs
from tilax_report.load import load_results
from tilax_report.pages import gp

FILE_NAME = "h200-20260301-a1b2c3d-gp.json"
GRAD = {"lengthscale": 1.0, "outputscale": -2.0, "noise": 30.0}
DOES_NOT_FIT = "skipped: not attempted, does not fit: a dense Cholesky MLL ..."
KEOPS = "KeOpsFailed: KeOps failed its probe in a fresh subprocess (exit code 1): nvcc missing"


def _row(case, seconds=None, error=None, **measured) -> dict:
    test = "test_gp_fit" if case.suite == "gp_fit" else "test_gp"
    timed = None if seconds is None else [seconds * 0.99, seconds, seconds * 1.01]
    return synthetic_runs.benchmark(case, f"test_bench_gp.py::{test}", timed, error,
                                    compile_s=5.0, **measured)


def document() -> dict:
    tilax = dict(mll=-9000.0, grad=GRAD, cg_iterations=25, relative_residual=0.009)
    rows = [
        _row(bench_gp.GpCase("tilax", 16384), 0.5, **tilax, rel_err_mll=2e-4, rel_err_grad=0.03),
        _row(bench_gp.GpCase("dense", 16384), 0.8, mll=-9001.0, grad=GRAD, rel_err_mll=1e-6,
             rel_err_grad=1e-4),
        _row(bench_gp.GpCase("gpytorch_keops", 16384), error=KEOPS),
        _row(bench_gp.GpCase("tilax", 1048576), 40.0, **dict(tilax, cg_iterations=180)),
        _row(bench_gp.GpCase("tinygp", 1048576), error=DOES_NOT_FIT),
    ]
    fit = bench_gp.FitCase(1048576)
    trajectory = [{"step": 1, "s": 20.0, "mll_per_n": -1.2, "cg_iterations": 9,
                   **bench_gp.GENERATING}]
    fit_row = _row(fit, 600.0)
    fit_row["extra_info"].update(steps=30, fit_s=600.0, converged=True, final=trajectory[-1],
                                 trajectory=trajectory)
    return synthetic_runs.document([*rows, fit_row], commit="a1b2c3d", suites=["gp", "gp_fit"],
                                   budget_s=480.0, started="2026-03-01T10:00:00+00:00")


@pytest.fixture(scope="module")
def with_gp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gp-data")
    (folder / "results").mkdir()
    (folder / "results" / FILE_NAME).write_text(json.dumps(document()))
    return load_results(folder)


def test_synthetic_run_follows_the_bench_contract():
    assert bench_rows.check_document(document()) == []


def test_loader_keeps_the_gp_columns(with_gp):
    rows = with_gp.table[with_gp.table["family"] == "gp"].sort_values("source_row")
    assert list(rows["status"]) == ["measured", "measured", "failed", "measured", "skipped",
                                    "measured"]
    first = rows.iloc[0]
    assert (first["n"], first["dim"], first["kernel"], first["cg_iterations"]) == (
        16384, 8, "rbf", 25)
    assert first["rel_err_mll"] == pytest.approx(2e-4)
    assert first["rel_err_ref"] == "float64 dense Cholesky"
    assert first["evals_per_s"] == pytest.approx(2.0)
    fit = rows.iloc[-1]
    assert (fit["suite"], fit["steps"], bool(fit["converged"])) == ("gp_fit", 30, True)
    assert fit["median_ms"] == pytest.approx(600e3)


def test_page_shows_every_row_and_the_fit(with_gp):
    text = gp.build(with_gp).replace("\xa0", " ")
    assert "NVIDIA H200" in text and "gp-evaluations" in text and "gp-fit" in text
    assert "failed (error)" in text and "skipped" in text and "does not fit" in text
    assert re.search(r"\| tilax \| 1\D048\D576 \| 40000 .* \| 180 \|", text)
    assert f"[{FILE_NAME}](data/{FILE_NAME})" in text
