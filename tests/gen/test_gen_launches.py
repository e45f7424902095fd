"""The launch sweep (suite ``kernel_mv_launches``) on the RBF page, from a synthetic stored run
(``launch_run.py``, rows made by the bench's own cases): the loader's columns, one table per
kernel family sorted by time with the default marked and failed and skipped launches last, the
chart, and launch rows kept out of the page's other sections."""

import json
import re
import shutil

import pytest
from launch_run import NAME, OUTCOMES, RUN, write_launch_run
from tilax_report import analysis, history, runs
from tilax_report.load import load_results
from tilax_report.pages import rbf
from tilax_report.render import Page

FAMILIES = ["fast path, forward kernel", "fast path, backward kernels",
            "exact path, forward kernel", "exact path, backward kernels"]


def results_with(tmp_path_factory, data_dir, *runs):
    """The seed data plus synthetic launch runs (kwargs of ``write_launch_run`` each)."""
    copy = tmp_path_factory.mktemp("launch-data")
    shutil.copytree(data_dir / "results", copy / "results")
    for run in runs:
        write_launch_run(copy / "results", **run)
    return load_results(copy)


@pytest.fixture(scope="module")
def launches(tmp_path_factory, data_dir):
    return results_with(tmp_path_factory, data_dir, {})


@pytest.fixture(scope="module")
def page(launches):
    return rbf.build(launches)


def launch_section(text: str) -> str:
    return text[text.index("## Launch sweep"):text.index("## Crossover repeats")]


def family_tables(section: str) -> dict[str, tuple[str, list[dict]]]:
    """heading -> (the sentence under it, the table's rows as dicts of cell text)."""
    out = {}
    section = section.replace("\u00a0", " ")  # short cells keep their spaces unbreakable
    for part in section.split("\n### ")[1:]:
        heading, _, body = part.partition("\n")
        lines = [line for line in body.splitlines() if line.startswith("| ")]
        header = [cell.strip() for cell in lines[0].strip("|").split(" | ")]
        rows = [dict(zip(header, [c.strip() for c in line.strip("|").split(" | ")],
                         strict=True)) for line in lines[2:]]
        sentence = next(line for line in body.splitlines() if line.strip())
        out[heading.split(": ", 1)[1]] = (sentence, rows)
    return out


def test_loader_reads_the_launch_columns(launches):
    rows = launches.table[launches.table["suite"] == "kernel_mv_launches"]
    assert len(rows) == len(OUTCOMES) and set(rows["source_file"]) == {NAME}
    assert str(rows["block_p"].dtype) == "Int64" and str(rows["num_stages"].dtype) == "Int64"
    assert str(rows["default_launch"].dtype) == "boolean"
    assert rows["status"].value_counts().to_dict() == {"measured": 11, "failed": 2, "skipped": 1}
    mosaic = rows["bwd_backend"].eq("mosaic").fillna(False).astype(bool)
    assert mosaic.sum() == 1  # the others: the path's backend (fwd_bwd rows) or none (fwd)
    assert rows.loc[rows["op"] == "fwd", "bwd_backend"].isna().all()
    defaults = rows[rows["default_launch"].fillna(False).astype(bool)]
    assert sorted(zip(defaults["path"], defaults["kernel"], strict=True)) == [
        ("exact", "bwd"), ("exact", "fwd"), ("fast", "bwd"), ("fast", "fwd")]
    # the model's estimate is kept as stored; nothing else the bench writes is left unread
    assert {tuple(json.loads(extra)) for extra in rows.loc[~mosaic, "extra"]} == {
        ("shared_memory_model_bytes",)}
    assert rows.loc[mosaic, "extra"].isna().all()  # its own kernel: no Triton model


def test_one_table_per_family_sorted_with_the_default_marked(page):
    tables = family_tables(launch_section(page))
    assert list(tables) == FAMILIES
    sentence, rows = tables[FAMILIES[0]]
    assert [row["rank"] for row in rows] == ["1", "2", "3", "4", "—", "—"]
    assert [row["launch"] for row in rows] == [
        "128 × 64 · w4 · s3", "**128 × 128 · w4 · s3 (default)**", "64 × 128 · w4 · s3",
        "64 × 64 · w8 · s2", "256 × 128 · w8 · s3", "64 × 32 · w8 · s2"]
    medians = [float(row["median ms (q1–q3)"].split()[0]) for row in rows[:4]]
    assert medians == sorted(medians) == [2.0, 3.0, 3.03, 4.5]
    assert rows[1]["median ms (q1–q3)"] == "3.000 (2.989–3.011)"
    # faster and slower clearly, the default itself, and a launch within the noise (~)
    assert [row["× default"] for row in rows] == ["0.67×", "1.00×", "~1.01×", "1.50×", "", ""]
    assert rows[0]["rel. error"] == "2.0e-03" and rows[0]["status"] == "measured"
    assert rows[4]["status"].startswith("failed: INTERNAL: out of resource: shared memory")
    assert rows[5]["status"].startswith("skipped: the run's time budget was spent")
    assert rows[4]["median ms (q1–q3)"] == rows[5]["median ms (q1–q3)"] == ""
    assert rows[4]["rounds"] == rows[5]["rounds"] == "—"
    assert ("6 launches: 4 measured, 1 failed, 1 skipped. Fastest: 128 × 64 · w4 · s3, 2.000 "
            "(1.993–2.007) ms. The default, 128 × 128 · w4 · s3, ranks 2 of 4 (1.50× the "
            "fastest's time).") in sentence


def test_a_default_without_a_time_and_a_capped_row(page):
    sentence, rows = family_tables(launch_section(page))[FAMILIES[3]]
    assert "The default launch has no time (see its row)." in sentence
    assert rows[-1]["status"] == "failed: INTERNAL: a made-up launch failure"
    assert rows[-1]["launch"].endswith("(default)**")
    assert [row["× default"] for row in rows] == ["", "", ""]  # nothing to compare with
    assert rows[1]["rounds"] == "1 · few rounds" and rows[1]["rel. error"] == "3.0e-07"
    sentence, rows = family_tables(launch_section(page))[FAMILIES[1]]
    # the Mosaic GPU sweeps, a candidate beside the Triton launches, ranked with them
    assert ("Fastest: 128 × 64 · Mosaic GPU, 6.000 (5.978–6.022) ms. The default, 128 × 64 · "
            "w4 · s3, ranks 2 of 3 (1.67× the fastest's time).") in sentence
    assert [row["launch"] for row in rows] == [
        "128 × 64 · Mosaic GPU", "**128 × 64 · w4 · s3 (default)**", "64 × 64 · w4 · s3"]
    assert [row["× default"] for row in rows] == ["0.60×", "1.00×", "1.50×"]


def test_the_chart_draws_the_launches_against_their_default(page):
    section = launch_section(page)
    charts = re.findall(r'<div class="tilax-chart" id="([^"]+)" data-sources="([^"]*)"',
                        section)
    assert len(charts) == 1 and charts[0][1] == NAME
    spec = json.loads(re.search(r'data-chart-for="[^"]+">(.*?)</script>', section,
                                re.S).group(1).replace("<\\/", "</"))
    points = next(iter(spec["datasets"].values()))
    # 4 fast forward + 3 fast backward + 2 exact forward; the exact backward has no default
    assert len(points) == 9
    assert {p["family"] for p in points} == {
        "fast fwd · dim 8, out 16 · n 64k", "fast bwd (fwd_bwd) · dim 8, out 16 · n 64k",
        "exact fwd · dim 8, out 16 · n 64k"}
    assert sorted(p["vs_default"] for p in points if p["marked"] == "default") == [1.0] * 3
    assert ("Not drawn (5 launches): 2 failed, 1 skipped and 2 measured in a family whose "
            "default has no time") in section


def test_launch_rows_stay_out_of_the_other_sections(page):
    rest = page.replace(launch_section(page), "")
    assert "made-up launch failure" not in rest and "out of resource" not in rest
    assert RUN not in rest  # not in numerics, not measured, nor the GPU-vs-GPU section


def section_alone(rows) -> str:
    """The launch section of the RBF page for ``rows`` alone (cheaper than the whole page)."""
    page = Page(rbf.SLUG, rbf.TITLE)
    rbf._launches(page, analysis.with_labels(rows))
    return page.render() + "\n## Crossover repeats"


def test_no_launch_rows_says_so(table):
    rows = table[table["suite"] == "kernel_mv_launches"]
    assert rows.empty
    assert "No stored run has the `kernel_mv_launches` suite." in section_alone(rows)


def test_a_file_without_the_default_launch(tmp_path):
    outcomes = {key: value for key, value in OUTCOMES.items()
                if key[0] == "exact_fwd" and key[1] != (64, 32, 4, 2)}
    (tmp_path / "results").mkdir()
    write_launch_run(tmp_path / "results", outcomes)
    text = launch_section(section_alone(load_results(tmp_path).table))
    sentence, rows = family_tables(text)[FAMILIES[2]]
    assert "This file has no row of the default launch." in sentence and len(rows) == 1
    assert "has a measured default launch to compare with" in text  # the chart's sentence


def test_history_keeps_launches_apart(tmp_path_factory, data_dir):
    later = {"name": "h200-20260118-2c3d4e5-launches.json", "commit": "2c3d4e5",
             "started": "2026-01-18T10:00:00+00:00"}
    table = analysis.with_labels(results_with(tmp_path_factory, data_dir, {}, later).table)
    points = history.timeline(table, runs.run_order(table))
    ours = points[points["suite"] == "kernel_mv_launches"]
    assert ours["case_id"].nunique() == 11  # one case per measured launch, not per family
    assert set(ours["run"]) == {RUN, "h200-20260118-2c3d4e5"}


def test_each_runs_chart_follows_its_own_tables(tmp_path_factory, data_dir):
    later = {"name": "h200-20260118-2c3d4e5-launches.json", "commit": "2c3d4e5",
             "started": "2026-01-18T10:00:00+00:00"}
    results = results_with(tmp_path_factory, data_dir, {}, later)
    section = launch_section(rbf.build(results))
    blocks = section.split("\n### ")[1:]
    charted = [re.findall(r'<div class="tilax-chart" id="[^"]+" data-sources="([^"]*)"', block)
               for block in blocks]
    runs_of = [block.partition(":")[0] for block in blocks]
    # every chart lies in the last family section of the run whose file it draws
    for index, sources in enumerate(charted):
        if sources:
            assert index + 1 == len(blocks) or runs_of[index + 1] != runs_of[index]
            assert runs_of[index].endswith(sources[0].removesuffix("-launches.json"))
    assert sum(len(sources) for sources in charted) == 2
