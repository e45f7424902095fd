"""The FP8 convergence report (suite ``fp8_convergence``): synthetic H200 runs made from the
bench's own cases (tests/bench/bench_fp8_convergence.py, smoke sizes: 40 steps, a point every
10) follow the bench contract; the loader keeps the loss curves; the page states each run's
final losses and their relative difference against the 1% target, draws both curves and the
floor, names a missing row instead of a ratio and shows a failed row's error.

Four runs on one GPU, one a day: ``within`` (FP8 0.5% above bfloat16), ``misses`` (1.5%
above), ``missing`` (no FP8 row) and ``failed`` (the FP8 row failed), the newest last. Each
curve's last point is its final loss (the mean of the last tenth of 4 points is the last).
"""

import json
import re

import bench_fp8_convergence
import bench_rows
import pytest
import report_fixtures
import synthetic_runs
from tilax_report.load import UnreadableResultFile, load_results
from tilax_report.pages import fp8_convergence

BF16_CASE, FP8_CASE = bench_fp8_convergence.suite_cases("fp8_convergence", "smoke")
FLOOR = 1.8
BF16_CURVE = [[10, 3.9, 1.82], [20, 3.2, 1.81], [30, 2.9, 1.79], [40, 2.8, FLOOR]]
SECONDS = 0.05  # a timed call of log_every (10) steps: 5 ms a step
FAILED = "XlaRuntimeError: INTERNAL: the FP8 matmul is not supported here"
# run name -> (commit, day, FP8's final loss over bfloat16's or None (no FP8 row), FP8 failed)
RUNS = {
    "within": ("a000001", 1, 1.005, False),
    "misses": ("a000002", 2, 1.015, False),
    "missing": ("a000003", 3, None, False),
    "failed": ("a000004", 4, None, True),
}


def file_name(run: str) -> str:
    commit, day = RUNS[run][:2]
    return f"h200-2026030{day}-{commit}-fp8_convergence.json"


def run_id(run: str) -> str:
    commit, day = RUNS[run][:2]
    return f"h200-2026030{day}-{commit}"


def _row(case, curve=None, error=None) -> dict:
    measured = {} if curve is None else dict(loss_curve=curve, final_loss=curve[-1][1],
                                             final_floor=curve[-1][2])
    timed = None if error else [SECONDS * 0.99, SECONDS, SECONDS * 1.01]
    return synthetic_runs.benchmark(case, "test_bench_fp8_convergence.py::test_fp8_convergence",
                                    timed, error, compile_s=3.0, **measured)


def fp8_curve(ratio: float) -> list[list[float]]:
    """The bfloat16 curve with every loss times ``ratio`` (the same floor)."""
    return [[step, loss * ratio, floor] for step, loss, floor in BF16_CURVE]


def document(run: str) -> dict:
    commit, day, ratio, failed = RUNS[run]
    rows = [_row(BF16_CASE, BF16_CURVE)]
    if failed:
        rows.append(_row(FP8_CASE, error=FAILED))
    elif ratio is not None:
        rows.append(_row(FP8_CASE, fp8_curve(ratio)))
    return synthetic_runs.document(rows, commit=commit, suites=["fp8_convergence"],
                                   budget_s=240.0, started=f"2026-03-0{day}T10:00:00+00:00",
                                   mode="smoke")


@pytest.fixture(scope="module")
def with_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8-data")
    (folder / "results").mkdir()
    for run in RUNS:
        (folder / "results" / file_name(run)).write_text(json.dumps(document(run)))
    return load_results(folder)


@pytest.fixture(scope="module")
def page_text(with_runs):
    return fp8_convergence.build(with_runs).replace("\xa0", " ")


def run_rows(results, run: str):
    table = results.table
    return table[(table["suite"] == "fp8_convergence") & (table["run"] == run_id(run))]


def expected_sentence_numbers(ratio: float) -> tuple[str, str, str]:
    bf16, fp8 = BF16_CURVE[-1][1], BF16_CURVE[-1][1] * ratio
    return f"{bf16:.4f}", f"{fp8:.4f}", f"{(fp8 - bf16) / bf16 * 100:+.2f}%"


def test_synthetic_runs_follow_the_bench_contract():
    for run in RUNS:
        assert bench_rows.check_document(document(run)) == [], run


def test_loader_keeps_the_curve_and_the_final_loss(with_runs):
    rows = run_rows(with_runs, "within").sort_values("source_row")
    bf16, fp8 = rows.iloc[0], rows.iloc[1]
    assert not isinstance(bf16["quantize"], str) and fp8["quantize"] == "fp8"
    assert bf16["loss_curve"] == tuple(tuple(point) for point in BF16_CURVE)
    assert fp8["loss_curve"] == tuple(tuple(point) for point in fp8_curve(1.005))
    assert fp8["final_loss"] == pytest.approx(2.8 * 1.005) and fp8["final_floor"] == FLOOR
    assert (fp8["steps"], fp8["steps_per_call"], fp8["tokens"]) == (40, 10, 256)
    assert "loss_curve" not in json.loads(fp8["extra"]) and "vocab" in json.loads(fp8["extra"])


def test_a_malformed_curve_fails_the_build_naming_the_field(tmp_path):
    doc = document("within")
    doc["benchmarks"][1]["extra_info"]["loss_curve"] = [[10, 3.9]]
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / file_name("within")).write_text(json.dumps(doc))
    with pytest.raises(UnreadableResultFile, match=r"extra_info\.loss_curve\[0\]"):
        load_results(tmp_path)


@pytest.mark.parametrize("run", ["within", "misses"])
def test_verdict_states_both_losses_and_their_difference(with_runs, page_text, run):
    ratio = RUNS[run][2]
    bf16, fp8, difference = expected_sentence_numbers(ratio)
    sentence = fp8_convergence.verdict(run_rows(with_runs, run))
    assert f"final loss is {bf16} in bfloat16 and {fp8} with FP8 (floor {FLOOR:.4f})" in sentence
    assert f"{difference} relative" in sentence and "after 40 steps" in sentence
    target = "is within the 1% target" if run == "within" else "misses the 1% target"
    assert target in sentence
    assert sentence in page_text


def test_a_run_without_its_fp8_row_says_which_is_missing(with_runs, page_text):
    sentence = fp8_convergence.verdict(run_rows(with_runs, "missing"))
    assert sentence == "No comparison: this run stores no fp8 row (only bf16)."
    assert sentence in page_text


def test_a_failed_row_shows_its_error(with_runs, page_text):
    sentence = fp8_convergence.verdict(run_rows(with_runs, "failed"))
    assert sentence.startswith("No comparison: the fp8 row failed (")
    assert "the FP8 matmul is not supported here" in sentence
    assert re.search(
        r"\| fp8 \| failed \(error\) \|.*\| XlaRuntimeError: INTERNAL: the FP8 "
        r"matmul is not supported here \|",
        page_text,
    )


def test_chart_draws_both_curves_and_the_floor_with_the_stored_points(page_text):
    # the newest run (failed) comes first; the chart of "within" is the page's last run
    specs = [
        json.loads(s)
        for s in re.findall(
            r'<script type="application/json" data-chart-for="[^"]+">(.*?)</script>', page_text
        )
    ]
    assert len(specs) == len(RUNS)
    points = {
        (p["series"], p["step"], p["loss"])
        for values in specs[-1]["datasets"].values()
        for p in values
    }
    expected = {("bf16", s, loss) for s, loss, _ in BF16_CURVE}
    expected |= {("fp8", s, loss) for s, loss, _ in fp8_curve(1.005)}
    expected |= {(fp8_convergence.FLOOR, s, floor) for s, _, floor in BF16_CURVE}
    assert points == expected


def test_page_newest_run_first_older_folded_with_times_and_sources(page_text):
    newest = page_text.index(run_id("failed"))
    folded = page_text.index("Earlier runs (3)")
    assert newest < folded < page_text.index(run_id("within"))
    # 5 ms a step: a call of 10 steps at 0.05 s (q1–q3 0.995 and 1.005 of it)
    assert re.search(
        r"\| bf16 \| measured \| 2\.8000 \| baseline \| 1\.8000 \| 40 \| 256 \| "
        r"5\.000 \(4\.975–5\.025\) \| 3 \|",
        page_text,
    )
    assert "| fp8 | measured | 2.8140 | +0.50% |" in page_text
    for run in RUNS:
        assert f"[{file_name(run)}](data/{file_name(run)})" in page_text


def test_a_data_folder_without_the_suite_says_so_in_one_line(tmp_path):
    (tmp_path / "results").mkdir()
    fixture = report_fixtures.PYTEST_BENCHMARK_FIXTURE
    (tmp_path / "results" / fixture.name).write_bytes(fixture.read_bytes())
    text = fp8_convergence.build(load_results(tmp_path))
    assert text == f"# {fp8_convergence.TITLE}\n\n{fp8_convergence.NOTHING_STORED}\n"
