"""The report pages as Markdown (no mkdocs): every page has charts and tables with sources,
and pages pick up a new pytest-benchmark run added to the data folder."""

import json
import re
import shutil

import pytest
from report_fixtures import PYTEST_BENCHMARK_FIXTURE
from tilax_report import site
from tilax_report.load import load_results
from tilax_report.pages import moe_decoder, moe_layer, overview, rbf

PAGES = list(site.PAGES)
BLOCK = re.compile(r'<div class="tilax-(chart|table)" id="([^"]+)" data-sources="([^"]*)"')


def build(module_name, results):
    module = __import__(f"tilax_report.pages.{module_name}", fromlist=["build"])
    return module.build(results)


@pytest.fixture(scope="module")
def with_h200(tmp_path_factory, data_dir):
    """A temporary copy of data/ plus the pytest-benchmark fixture (an H200 run)."""
    copy = tmp_path_factory.mktemp("data")
    shutil.copytree(data_dir / "results", copy / "results")
    shutil.copy(PYTEST_BENCHMARK_FIXTURE, copy / "results")
    return load_results(copy)


@pytest.mark.parametrize("module_name", PAGES)
def test_every_chart_and_table_names_its_sources(stored, module_name):
    text = build(module_name, stored)
    blocks = BLOCK.findall(text)
    if module_name == "history":  # the seed files record no dates: no history to show
        assert not blocks and "there is no history to show" in text
        return
    if module_name == "moe_ep":  # no seed file has expert-parallel rows (test_gen_ep has some)
        assert not blocks and "No expert-parallel run is stored yet" in text
        return
    if module_name == "moe_decode":  # no seed file has decode rows (test_gen_decode has some)
        assert not blocks and "No run of the decode suite is stored yet" in text
        return
    if module_name == "gp":  # no seed file has Gaussian-process rows (test_gen_gp has some)
        assert not blocks and "No Gaussian-process run is stored yet" in text
        return
    if module_name == "fp8_convergence":  # no seed file has the suite (test_gen_fp8_convergence)
        assert not blocks and "No run of the FP8 convergence suite is stored yet" in text
        return
    kinds = {kind for kind, _, _ in blocks}
    assert "table" in kinds and (kinds == {"chart", "table"} or module_name == "runs"), \
        f"{module_name} needs charts and tables"
    ids = [block_id for _, block_id, _ in blocks]
    assert len(ids) == len(set(ids))
    for _kind, block_id, sources in blocks:
        assert sources, block_id
        after = text[text.index(f'id="{block_id}"'):]
        source_line = re.search(r"^Source: .*$", after, re.M).group(0)
        for name in sources.split():
            assert f"[{name}](data/{name})" in source_line, (block_id, source_line)


def test_new_run_appears_in_the_overview(with_h200):
    text = overview.build(with_h200)
    assert "h200-20260115-0a1b2c3" in text
    assert ("**NVIDIA H200** (run [`h200-20260115-0a1b2c3`](runs.md#run-h200-20260115-0a1b2c3)"
            ", 2026-01-15") in text


def test_new_run_is_ranked_within_itself(with_h200):
    text = moe_layer.build(with_h200)
    # Fixture: mosaic/sorted 3.98 ms (q1–q3 ±1%), pallas/sorted 4.12 ms, dense 10.5 ms; no
    # per-round data, so the verdicts come from the quartiles (apart, and 3.5% > 2%).
    assert "**mosaic/sorted** took 3.980 ms (q1–q3 3.940–4.020, 20 rounds)" in text
    assert f"{4.12 / 3.98:.2f}× faster than pallas/sorted" in text
    assert f"{10.5 / 3.98:.2f}× faster than dense routing" in text


def test_gpu_vs_gpu_sections_compare_the_same_case(stored, with_h200):
    assert "No MoE layer case was measured on more than one GPU yet" in moe_layer.build(stored)
    text = moe_layer.build(with_h200)
    assert "No MoE layer case was measured on more than one GPU yet" not in text
    section = text[text.index("## Same implementation on different GPUs"):]
    assert "Different machines" in section
    assert "H200" in section and "RTX 3090" in section and "H100" in section
    rbf_text = rbf.build(with_h200)
    section = rbf_text[rbf_text.index("## Same implementation on different GPUs"):]
    assert "No RBF case was measured" not in section and "H200" in section


def test_decoder_page_has_a_section_per_run(with_h200):
    text = moe_decoder.build(with_h200)
    assert "## NVIDIA H100 (NVL, 94 GB), run `v10_decoder`" in text
    assert "## NVIDIA H200, run `h200-20260115-0a1b2c3`" in text


def test_a_run_without_a_gpu_name_still_shows(tmp_path, data_dir):
    import json

    shutil.copytree(data_dir / "results", tmp_path / "results")
    doc = json.loads(PYTEST_BENCHMARK_FIXTURE.read_text())
    del doc["machine_info"]["gpu"]
    (tmp_path / "results" / "nogpu.json").write_text(json.dumps(doc))
    text = moe_layer.build(load_results(tmp_path))
    assert "**unknown GPU** (run [`nogpu`](runs.md#run-nogpu)" in text


def test_a_run_on_the_cpu_backend_is_named_cpu(tmp_path, data_dir):
    import json

    shutil.copytree(data_dir / "results", tmp_path / "results")
    doc = json.loads(PYTEST_BENCHMARK_FIXTURE.read_text())
    del doc["machine_info"]["gpu"]
    doc["machine_info"]["platform"] = "cpu"
    (tmp_path / "results" / "oncpu.json").write_text(json.dumps(doc))
    text = moe_layer.build(load_results(tmp_path)).replace("\xa0", " ")
    assert "**CPU** (run [`cpu-20260115-0a1b2c3`]" in text and "unknown GPU" not in text


def test_rbf_page_says_why_each_peer_did_not_run(tmp_path, real_data_dir):
    # A copy of the first H200 RBF file whose KeOps rows failed their probe (as a crash of
    # KeOps' code generation would) instead of being skipped by the time budget.
    name = "h200-20261130-968b1b8-rbf-tiles_bf16v.json"
    doc = json.loads((real_data_dir / "results" / name).read_text())
    crash = ("KeOpsFailed: KeOps failed its probe in a fresh subprocess (exit code -11): "
             "Segmentation fault")
    for row in doc["benchmarks"]:
        if row["extra_info"].get("impl") == "keops":
            row["extra_info"]["error"] = crash
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / name).write_text(json.dumps(doc))
    text = rbf.build(load_results(tmp_path))
    section = text[text.index("## Peers"):text.index("## KDE")]
    assert ("KeOps (`keops`, LazyTensor reduction) on H200 (run h200-20261130-968b1b8): "
            "0 cases measured; 40 failed (") in section
    assert "Segmentation fault" in section
    torch_line = ("PyTorch (`torch_dense`, the dense kernel matrix) on H200 (run "
                  "h200-20261130-968b1b8): 10 cases measured; 30 skipped (the run's time budget")
    assert torch_line in section
    keops_line = next(line for line in section.splitlines() if line.startswith("- KeOps"))
    assert "Segmentation fault" in keops_line and "skipped" not in keops_line


def test_power_and_clocks_of_the_rows_that_stored_them(tmp_path, data_dir):
    # The fixture's decoder rows with the fields bench_power stores: pallas at its power limit
    # and a lower clock, triton below it; the ragged_dot row stored none.
    shutil.copytree(data_dir / "results", tmp_path / "results")
    doc = json.loads(PYTEST_BENCHMARK_FIXTURE.read_text())
    power = {"pallas": (695.0, 1500.0), "triton": (520.0, 1980.0)}
    for row in doc["benchmarks"]:
        extra = row["extra_info"]
        if extra["suite"] == "decoder" and extra["impl"] in power:
            watts, clock = power[extra["impl"]]
            extra.update(power_w=watts, sm_clock_mhz=clock, power_limit_w=700.0,
                         power_samples=9, power_field="power.draw.instant")
    (tmp_path / "results" / "h200-20260115-0a1b2c3.json").write_text(json.dumps(doc))
    results = load_results(tmp_path)
    text = moe_decoder.build(results)
    section = text[text.index("## NVIDIA H200, run `h200-20260115-0a1b2c3`"):]
    assert "Power and clocks (2 timed rows)" in section
    table = section[section.index('id="decoder-h200-20260115-0a1b2c3-power"'):]
    # 695 W x 0.61 ms = 0.424 J; 520 W x 0.79 ms = 0.411 J
    assert "| 695 | 99% | 1500 | 9 | 0.424 |" in table
    assert "| 520 | 74% | 1980 | 9 | 0.411 |" in table
    assert "ragged_dot" not in table.split("</div>")[0]
    assert "Power and clocks" not in moe_decoder.build(load_results(data_dir))
    assert results.table["power_field"].dropna().unique().tolist() == ["power.draw.instant"]
