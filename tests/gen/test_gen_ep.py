"""The expert-parallel report (suite ep): the loader keeps the ep fields, the weak-scaling
efficiency and the exchange share are the hand-computed ratios of rows of one file, the page
shows them with every row's status and the stored file they come from, and says in one line
that nothing is stored when no ep run is."""

import json
import re
from collections import Counter

import ep_run
import pandas as pd
import pytest
from tilax_report import analysis, history, scaling
from tilax_report.load import load_results
from tilax_report.pages import moe_ep

E8 = "E8 top-2 d512 h1024"
E64 = "E64 top-8 d512 h128 shared 1024"


@pytest.fixture(scope="module")
def with_ep(tmp_path_factory):
    """A data folder holding the synthetic two-GPU ep run alone (the page reads only ep rows)."""
    copy = tmp_path_factory.mktemp("ep-data")
    (copy / "results").mkdir()
    ep_run.write_ep_run(copy / "results")
    return load_results(copy)


@pytest.fixture(scope="module")
def ep_rows(with_ep):
    return scaling.ep_rows(analysis.with_labels(with_ep.table))


@pytest.fixture(scope="module")
def page(with_ep):
    """The page's Markdown, short table cells' no-break spaces as plain spaces."""
    return moe_ep.build(with_ep).replace("\xa0", " ")


def test_synthetic_run_follows_the_bench_contract():
    assert ep_run.contract_problems() == []


def test_loader_keeps_the_ep_fields(with_ep):
    rows = with_ep.table[with_ep.table["source_file"] == ep_run.FILE_NAME]
    stored = [b["extra_info"] for b in ep_run.document()["benchmarks"]]
    assert len(rows) == len(stored)
    assert set(rows["suite"]) == {"ep"} and set(rows["run"]) == {ep_run.RUN}
    assert rows["extra"].isna().all()  # every extra_info key of the ep rows has a column
    assert Counter(rows["status"]) == {"measured": 12, "failed": 1, "skipped": 2}
    for row, info in zip(rows.sort_values("source_row").itertuples(), stored, strict=True):
        for key in ("part", "devices", "exchange", "tokens", "tokens_per_device", "impl",
                    "dispatch", "experts", "top_k", "shared_hidden", "bytes"):
            value = getattr(row, key)
            assert (None if pd.isna(value) else value) == info.get(key), key
        assert (None if pd.isna(row.mesh) else row.mesh) == info["mesh"]
        if "error" in info:
            assert row.error == info["error"]
            assert pd.isna(row.tokens_per_s)  # no throughput without a time
        else:
            assert row.tokens_per_s == pytest.approx(info["tokens_per_s"])
            assert row.tokens_per_s == pytest.approx(row.tokens / (row.median_ms / 1e3))
    link = rows[rows["part"] == "link"].sort_values("source_row").iloc[0]
    assert link["gbps"] == pytest.approx(ep_run.LINK_GBPS)
    step = rows[(rows["part"] == "step") & (rows["devices"] == 2)
                & (rows["status"] == "measured")].iloc[0]
    assert step["rel_err_out_vs_one_device"] == pytest.approx(0.0041)
    assert step["tflops"] > 0
    one = rows[(rows["part"] == "step") & (rows["devices"] == 1)]
    assert one["exchange"].isna().all()


def test_efficiency_is_the_ratio_within_the_file(ep_rows):
    eff = scaling.efficiency(ep_rows).set_index(["config", "exchange"])
    assert set(eff.index) == {(E8, "ragged"), (E8, "all_to_all"), (E8, "all_gather in 2 chunks"),
                              (E64, "all_to_all")}
    assert eff.loc[(E8, "ragged"), "efficiency"] == pytest.approx(ep_run.EFFICIENCY_RAGGED)
    assert eff.loc[(E8, "all_to_all"), "efficiency"] == pytest.approx(
        ep_run.EFFICIENCY_ALL_TO_ALL)
    assert eff.loc[(E64, "all_to_all"), "efficiency"] == pytest.approx(20.0 / 25.0)
    # the definition: (n-GPU tokens/s) / (n x one-GPU tokens/s), from the stored tokens_per_s
    one = ep_rows[(ep_rows["part"] == "step") & (ep_rows["devices"] == 1)].set_index("config")
    for (config, _), row in eff.iterrows():
        stored = row["tokens_per_s"] / (2 * one.loc[config, "tokens_per_s"])
        assert row["efficiency"] == pytest.approx(stored)
        assert row["efficiency_lo"] < row["efficiency"] < row["efficiency_hi"]
        assert row["clear"] is True and row["method"] == "rank test"


def test_each_mesh_size_is_paired_with_the_same_one_gpu_step(tmp_path):
    """A host of 4 GPUs stores 2- and 4-GPU steps in one file (bench_ep.mesh_sizes): each gets
    its own efficiency against the one one-GPU step, with n in the definition."""
    (tmp_path / "results").mkdir()
    doc = ep_run.document()
    four = ep_run.bench_ep.EpCase(part="step", devices=4, tokens_per_device=ep_run.T,
                                  exchange="ragged", **ep_run.LAYER)
    doc["benchmarks"].append(ep_run.benchmark(four, 12.5, None))
    (tmp_path / "results" / ep_run.FILE_NAME).write_text(json.dumps(doc))
    rows = scaling.ep_rows(analysis.with_labels(load_results(tmp_path).table))
    eff = scaling.efficiency(rows).set_index(["config", "exchange", "devices"])
    assert eff.loc[(E8, "ragged", 2), "efficiency"] == pytest.approx(ep_run.EFFICIENCY_RAGGED)
    assert eff.loc[(E8, "ragged", 4), "efficiency"] == pytest.approx(10.0 / 12.5)


def test_overlap_is_the_step_over_the_larger_of_compute_and_exchange(ep_rows):
    hidden = scaling.overlap(scaling.efficiency(ep_rows), scaling.exchange_share(ep_rows)).merge(
        ep_rows[["source_file", "source_row", "config", "exchange"]]).set_index(
        ["config", "exchange"])
    # only steps with both a timed one-GPU step and a timed exchange row in the file
    assert set(hidden.index) == {(E8, "ragged"), (E64, "all_to_all")}
    assert hidden.loc[(E8, "ragged"), "overlap"] == pytest.approx(11.5 / max(10.0, 3.0))
    assert hidden.loc[(E64, "all_to_all"), "overlap"] == pytest.approx(25.0 / max(20.0, 8.0))
    for row in hidden.itertuples():
        assert row.overlap_lo < row.overlap < row.overlap_hi


def test_efficiency_never_pairs_rows_of_two_files(tmp_path):
    """The one-GPU and the two-GPU steps stored in two files of one run: no efficiency."""
    (tmp_path / "results").mkdir()
    doc = ep_run.document()
    benches = doc["benchmarks"]
    for name, keep in (("a", 1), ("b", 2)):
        part = dict(doc, benchmarks=[b for b in benches
                                     if b["extra_info"]["devices"] == keep])
        (tmp_path / "results" / f"h200-20260201-e9a0b1c-ep-{name}.json").write_text(
            json.dumps(part))
    results = load_results(tmp_path)
    rows = scaling.ep_rows(analysis.with_labels(results.table))
    assert rows["run"].nunique() == 1  # one run, two files
    assert scaling.efficiency(rows).empty
    assert "no timed one-GPU step in this file" in moe_ep.build(results)


def test_exchange_share_is_the_ratio_within_the_file(ep_rows):
    share = scaling.exchange_share(ep_rows).set_index(["config", "exchange"])
    # E8 over all_to_all: its exchange row failed, so no share
    assert set(share.index) == {(E8, "ragged"), (E64, "all_to_all")}
    assert share.loc[(E8, "ragged"), "share"] == pytest.approx(ep_run.SHARE_RAGGED)
    assert share.loc[(E64, "all_to_all"), "share"] == pytest.approx(8.0 / 25.0)
    row = share.loc[(E8, "ragged")]
    assert row["share_lo"] < row["share"] < row["share_hi"]


def test_page_shows_efficiency_share_link_and_source(page):
    assert moe_ep.NOTHING_STORED not in page
    summary = page[page.index("## Weak-scaling efficiency"):page.index("## NVIDIA H200")]
    assert f"{ep_run.EFFICIENCY_RAGGED:.3f}" == "0.870" and "0.870 (" in summary
    assert "0.800 (" in summary and "26.1% (" in summary and "32.0% (" in summary
    assert "| 1.150 (" in summary and "| 1.250 (" in summary  # overlap: 11.5/10, 25/20
    assert f"{ep_run.LINK_GBPS:.1f}" in page  # 335.5 GB/s
    # a chunked exchange is listed as its own transport, without an exchange share
    assert f"all\\_gather in 2 chunks | {ep_run.EFFICIENCY_TWO_CHUNKS:.3f} (" in summary
    # the all-gather link row is labelled as such, with its own bytes
    link_table = page[page.index("### The link: collective bandwidth"):]
    assert f"| all\\_gather | 64.00 | 2 | {ep_run.LINK_GATHER_GBPS:.1f} (" in link_table
    # every chart and table names the stored file and links it
    blocks = re.findall(r'class="tilax-(chart|table)" id="([^"]+)" data-sources="([^"]*)"',
                        page)
    assert {kind for kind, _, _ in blocks} == {"chart", "table"}
    assert {sources for _, _, sources in blocks} == {ep_run.FILE_NAME}
    assert page.count(f"[{ep_run.FILE_NAME}](data/{ep_run.FILE_NAME})") == len(blocks)
    assert "## NVIDIA H200, run `h200-20260201-e9a0b1c`" in page
    assert "### E8 top-2 d512 h1024 · pallas/sorted" in page
    assert "### E64 top-8 d512 h128 shared 1024 · pallas/fused" in page


def test_page_keeps_failed_and_skipped_rows_apart(page):
    assert "exchange row failed (out of memory)" in page
    assert "exchange row skipped" in page
    section = page[page.index("### Not measured in this run"):]
    assert "1 expert-parallel case failed" in section
    assert "2 expert-parallel cases skipped" in section
    assert "RESOURCE\\_EXHAUSTED: Out of memory" in section  # the error, in the failed table
    assert "the run's time budget was spent before this row" in section  # the reason


def test_nothing_stored_is_one_line(stored, real_data_dir):
    text = moe_ep.build(stored)  # the seed files: no ep rows
    assert text.split("\n", 1)[1].strip() == moe_ep.NOTHING_STORED
    assert "tilax-chart" not in text and "tilax-table" not in text
    # today's stored data: the line while no ep run is stored, the sections once one is
    real = load_results(real_data_dir)
    text = moe_ep.build(real)
    has_ep = (real.table["suite"] == "ep").any()
    assert (moe_ep.NOTHING_STORED in text) != has_ep


def test_history_tells_ep_cases_apart():
    assert {"part", "devices", "exchange"} <= set(history.CASE)
