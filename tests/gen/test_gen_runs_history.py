"""Runs (files of one commit on one GPU are one run), their provenance, row status kept apart,
history across runs with its regressions, empty charts, the page list and the site swap."""

import json
import shutil

import pandas as pd
import pytest
from report_fixtures import PYTEST_BENCHMARK_FIXTURE, REPO
from slower_run import write_slower_copy
from tilax_report import analysis, history, runs, site
from tilax_report.load import load_results
from tilax_report.pages import PAGES, overview, raw_data, rbf
from tilax_report.pages import history as history_page
from tilax_report.pages import runs as runs_page

H200_MOE = "h200-20261130-b95aa18-moe.json"
H200_RBF = "h200-20261130-968b1b8-rbf-tiles_bf16v.json"


def data_copy(tmp_path, seed_dir, *extra):
    """A copy of the seed-only data/ plus ``extra`` stored files of the repository."""
    shutil.copytree(seed_dir / "results", tmp_path / "results")
    for name in extra:
        shutil.copy(REPO / "data" / "results" / name, tmp_path / "results")
    return tmp_path


@pytest.fixture(scope="module")
def with_h200(tmp_path_factory, data_dir):
    return load_results(data_copy(tmp_path_factory.mktemp("h200"), data_dir, H200_MOE,
                                  H200_RBF))


@pytest.fixture(scope="module")
def slower(tmp_path_factory, data_dir):
    """The stored H200 runs plus a newer run (commit 5e7e4a1, a day later) whose every time is
    1.3x: the regression the history page must flag."""
    folder = data_copy(tmp_path_factory.mktemp("slower"), data_dir, H200_MOE, H200_RBF)
    for name in (H200_MOE, H200_RBF):
        write_slower_copy(folder / "results" / name, folder / "results", 1.3, "5e7e4a1")
    return load_results(folder)


def test_files_of_one_commit_on_one_gpu_are_one_run(tmp_path, data_dir):
    doc = json.loads(PYTEST_BENCHMARK_FIXTURE.read_text())
    parts = {"moe": [b for b in doc["benchmarks"] if b["extra_info"]["family"] == "moe"],
             "rbf": [b for b in doc["benchmarks"] if b["extra_info"]["family"] == "rbf"]}
    folder = data_copy(tmp_path, data_dir)
    for index, (tag, benchmarks) in enumerate(parts.items()):
        part = dict(doc, benchmarks=benchmarks,
                    datetime=f"2026-01-{15 + index}T10:00:00+00:00",
                    machine_info=dict(doc["machine_info"], bench_part=f"{index + 1}/2"),
                    commit_info={"id": "unknown"})
        (folder / "results" / f"h200-2026011{5 + index}-0a1b2c3-{tag}.json").write_text(
            json.dumps(part))
    results = load_results(folder)
    table = analysis.with_labels(results.table)
    ours = table[table["source_format"] == "pytest_benchmark"]
    assert set(ours["run"]) == {"h200-20260115-0a1b2c3"}  # the first file's date
    catalogue = runs.catalogue(table).set_index("run")
    assert len(catalogue.loc["h200-20260115-0a1b2c3", "files"]) == 2
    assert catalogue.loc["h200-20260115-0a1b2c3", "bench_parts"] == "1/2, 2/2"
    run_list = overview.build(results)
    assert run_list.count("[`h200-20260115-0a1b2c3`](runs.md#run-h200-20260115-0a1b2c3) |") == 1
    # Ratios stay within a file: every ranked case names one file.
    ranked = analysis.rank_within_run(ours[ours["family"] == "moe"], analysis.MOE_CASE)
    assert ranked["source_file"].str.endswith("-moe.json").all()


def test_a_file_filed_under_the_full_sha_joins_its_run(tmp_path, data_dir):
    # TILAX_BENCH_COMMIT given as `git rev-parse HEAD` (a full sha) on a host without .git
    doc = json.loads(PYTEST_BENCHMARK_FIXTURE.read_text())
    folder = data_copy(tmp_path, data_dir)
    for index, commit in enumerate(("0a1b2c3", "0a1b2c3" + "d4e5f6" * 5 + "a7b")):
        part = dict(doc, datetime=f"2026-01-{15 + index}T10:00:00+00:00",
                    machine_info=dict(doc["machine_info"], commit=commit),
                    commit_info={"id": "unknown"})
        (folder / "results" / f"h200-2026011{5 + index}-{commit}-part{index}.json").write_text(
            json.dumps(part))
    table = analysis.with_labels(load_results(folder).table)
    ours = table[table["source_format"] == "pytest_benchmark"]
    assert set(ours["commit"]) == {"0a1b2c3"}
    assert set(ours["run"]) == {"h200-20260115-0a1b2c3"}
    assert len(runs.catalogue(table).set_index("run").loc["h200-20260115-0a1b2c3", "files"]) == 2


def test_skips_are_not_failures(with_h200):
    files = with_h200.files.set_index("source_file")
    # Stored: 181 of the MoE file's 194 rows without a time and 190 of the RBF file's 192 were
    # never attempted ("skipped: ... budget" and predicted failures).
    assert files.loc[H200_MOE, ["measured_rows", "failed_rows", "skipped_rows"]].tolist() == [
        43, 13, 181]
    assert files.loc[H200_RBF, ["measured_rows", "failed_rows", "skipped_rows"]].tolist() == [
        56, 2, 190]
    text = raw_data.build(with_h200)
    row = next(line for line in text.splitlines() if line.startswith(f"| [{H200_MOE}]"))
    assert "| 43 | 13 | 181 |" in row


def test_skipped_and_failed_are_listed_apart(with_h200):
    text = rbf.build(with_h200)
    failed = text[text.index('id="rbf-failed"'):]
    failed = failed[:failed.index("</div>")]
    assert "skipped: not attempted" not in failed
    skipped = text[text.index('id="rbf-skipped"'):]
    skipped = skipped[:skipped.index("</div>")]
    assert "the run's time budget was spent before this row" in skipped


def test_empty_chart_is_replaced_by_a_sentence(with_h200):
    # The stored H200 RBF run skipped its whole KDE suite (time budget).
    text = rbf.build(with_h200)
    kde = text[text.index("## KDE density"):text.index("## Tile sweep")]
    assert '<p class="tilax-empty"' in kde
    assert ('No chart for "H200, run h200-20261130-968b1b8: rbf_kde_density median time vs n":'
            " none of the 36 cases behind it has a time to draw (36 skipped") in kde


def test_run_panel_shows_the_environment(with_h200):
    text = runs_page.build(with_h200)
    panel = text[text.index('id="run-h200-20261130-b95aa18-environment"'):]
    panel = panel[:panel.index("</div>")].replace("\xa0", " ")
    for label, value in [("driver", "580.159.04"), ("CUDA", "13.0"), ("jax", "0.11.2"),
                         ("jaxlib", "0.11.2"), ("Triton", "3.6.0"), ("torch", "2.11.0"),
                         ("Python", "3.12.3"), ("commit", "b95aa18"), ("GPU", "NVIDIA H200")]:
        assert f"| {label} | {value} |" in panel, label
    assert "2026-11-30" in text[text.index('id="run-h200-20261130-b95aa18"'):]
    # no provenance table in this copy of data/: the label is all there is
    assert "Code: declared commit `b95aa18`, no code hash known for it." in text


def test_runs_are_ordered_newest_first_and_headlines_quote_the_newest(slower):
    table = analysis.with_labels(slower.table)
    catalogue = runs.catalogue(table)
    assert catalogue["run"].iloc[0] == "h200-20261201-5e7e4a1"
    text = overview.build(slower)
    headline = next(line for line in text.splitlines() if line.startswith("- **NVIDIA H200**"))
    assert "run [`h200-20261201-5e7e4a1`]" in headline and "2026-12-01" in headline


def test_a_run_with_every_time_1_3x_is_flagged_slower_by_30_percent(slower):
    table = analysis.with_labels(slower.table)
    changes = history.changes(history.timeline(table, runs.run_order(table)))
    layer = changes[(changes["suite"] == "layer") & changes["ratio"].notna()]
    assert not layer.empty
    assert layer["ratio"].to_numpy() == pytest.approx(1.3)
    assert layer["clear"].eq(True).all()  # 10 rounds each: the rank test is certain
    assert set(layer["before_run"]) == {"h200-20261130-b95aa18"}
    assert set(layer["after_run"]) == {"h200-20261201-5e7e4a1"}
    text = history_page.build(slower)
    top = text[:text.index("## Changes between consecutive runs")]
    assert '!!! danger "Slower run: h200-20261201-5e7e4a1"' in top
    assert "cases clearly slower** (median 1.30×, +30%)" in top
    pairs = text[text.index('id="history-pairs"'):text.index("## Noise between runs")]
    row = next(line for line in pairs.splitlines() if line.startswith("|") and "5e7e4a1" in line)
    assert ("[`b95aa18`](runs.md#run-h200-20261130-b95aa18) → "
            "[`5e7e4a1`](runs.md#run-h200-20261201-5e7e4a1)") in row
    assert "| changed |" in row and "| +30.0% |" in row
    flagged = text[text.index('id="history-flagged"'):].replace("\xa0", " ")
    row = next(line for line in flagged.splitlines()
               if "layer · pallas/sorted · E8 top-2 d512 h1024 · bfloat16 train" in line)
    assert "| slower by 30% |" in row
    assert "[`b95aa18`](runs.md#run-h200-20261130-b95aa18) → [`5e7e4a1`]" in row


def test_no_history_from_undated_or_single_runs(stored):
    table = analysis.with_labels(stored.table)
    assert history.timeline(table, runs.run_order(table)).empty


def test_runs_on_different_gpus_never_share_a_timeline(tmp_path, data_dir):
    folder = data_copy(tmp_path, data_dir, H200_MOE)
    doc = json.loads((folder / "results" / H200_MOE).read_text())
    doc["machine_info"]["gpu"] = "NVIDIA B200"
    (folder / "results" / "b200-20261201-b95aa18-moe.json").write_text(json.dumps(doc))
    table = analysis.with_labels(load_results(folder).table)
    assert history.timeline(table, runs.run_order(table)).empty


def test_nav_follows_the_page_list():
    lines = site.nav_lines()
    titles = [site.page_module(name).TITLE for name in PAGES]
    assert [line.split("](")[0].removeprefix("* [") for line in lines[:len(PAGES)]] == titles
    assert lines[0] == "* [Overview](index.md)" and lines[-1] == "* [Table schema](schema.md)"


def test_failed_docs_build_keeps_the_previous_site(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("noxfile", REPO / "noxfile.py")
    noxfile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(noxfile)
    target = tmp_path / "site"
    target.mkdir()
    (target / "index.html").write_text("previous")

    def broken(folder):
        (folder / "index.html").write_text("half")
        raise RuntimeError("cannot read stored result file")

    with pytest.raises(RuntimeError):
        noxfile.publish_site(broken, target)
    assert (target / "index.html").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]
    noxfile.publish_site(lambda folder: (folder / "index.html").write_text("new"), target)
    assert (target / "index.html").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]


def test_status_counts_have_three_columns():
    frame = pd.DataFrame({"run": ["a", "a", "a"], "status": ["measured", "skipped", "skipped"]})
    counts = analysis.status_counts(frame, ["run"])
    assert counts.to_dict("records") == [{"run": "a", "measured": 1, "failed": 0, "skipped": 2}]
