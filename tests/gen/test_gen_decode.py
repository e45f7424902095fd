"""The decode report (suite ``decode``): a synthetic H200 run made from the bench's own cases
(tests/bench/bench_moe.py: ``DecodeCase``, ``CopyBandwidthCase``, their ``extra_info()`` and
``rates()``) follows the bench contract; the loader derives the touched-weight bytes per second;
the page shows each row's share of the copy bandwidth of its own file and ``auto`` against the
fastest peer, with the hand-computed numbers below; and says in one line that nothing is stored
when no decode run is.

Times (one file, Qwen3-like layer E128 top-8 d2048 h768 at 16 tokens): copy rows of 1 GiB at
0.60 and 0.64 ms (2 GiB read and written: 3579 and 3355 GB/s, median 3467); ``auto`` 350 µs,
``tokamax`` 700 µs, ``torch_grouped_mm_compile`` 500 µs, ``ragged_dot`` failed (out of
memory).
With 100 touched experts the touched bytes are 100 * 3 * 2048 * 768 * 2 + 2048 * 128 * 4.
"""

import json
import statistics

import bench_moe
import bench_rows
import pandas as pd
import pytest
import synthetic_runs
from tilax_report.load import load_results
from tilax_report.pages import moe_decode
from tilax_report.render import fmt_int

FILE_NAME = "h200-20260301-d3c0d3e-decode.json"
SHAPE = bench_moe.DECODE_SHAPES["qwen3"]
TOUCHED = 100
TOUCHED_BYTES = TOUCHED * 3 * 2048 * 768 * 2 + 2048 * 128 * 4
COPY_GBPS = statistics.median([2 * 2**30 / 0.60e-3 / 1e9, 2 * 2**30 / 0.64e-3 / 1e9])
OOM = "XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes."


def _layer(impl, dispatch=None):
    return bench_moe.DecodeCase(
        suite="decode",
        impl=impl,
        dispatch=dispatch,
        routing="dropless",
        dtype="bfloat16",
        op="forward",
        tokens=16,
        **SHAPE,
    )


ROWS = [
    (bench_moe.CopyBandwidthCase("decode", 2**30, "first", 4), 0.60, None),
    (_layer("auto"), 0.350, None),
    (_layer("ragged_dot", "sorted"), None, OOM),
    (_layer("tokamax"), 0.700, None),
    (_layer("torch_grouped_mm_compile"), 0.500, None),
    (bench_moe.CopyBandwidthCase("decode", 2**30, "last", 6), 0.64, None),
]


def _benchmark(case, median_ms, error) -> dict:
    measured = {}
    if case.impl != "copy_bandwidth":
        measured = dict(max_expert_frac=0.02, empty_experts=128 - TOUCHED,
                        touched_experts=TOUCHED, touched_weight_bytes=TOUCHED_BYTES,
                        rel_err_out=0.004)
    timed = None if error else [median_ms * 1e-3 * (1 + s) for s in (-0.01, -0.005, 0, 0.005, 0.01)]
    return synthetic_runs.benchmark(case, "test_bench_moe.py::test_decode", timed, error,
                                    group="decode", **measured)


def document() -> dict:
    return synthetic_runs.document([_benchmark(*row) for row in ROWS], commit="d3c0d3e",
                                   suites=["decode"], budget_s=200.0,
                                   started="2026-03-01T10:00:00+00:00")


@pytest.fixture(scope="module")
def with_decode(tmp_path_factory):
    copy = tmp_path_factory.mktemp("decode-data")
    (copy / "results").mkdir()
    (copy / "results" / FILE_NAME).write_text(json.dumps(document(), indent=1))
    return load_results(copy)


@pytest.fixture(scope="module")
def page(with_decode):
    return moe_decode.build(with_decode).replace("\xa0", " ")


def test_synthetic_run_follows_the_bench_contract():
    assert bench_rows.check_document(document()) == []


def test_loader_derives_the_touched_weight_bandwidth(with_decode):
    rows = with_decode.rows
    auto = rows[rows["impl"] == "auto"].iloc[0]
    assert auto["touched_weight_bytes"] == TOUCHED_BYTES and auto["touched_experts"] == TOUCHED
    assert auto["touched_weight_gbps"] == pytest.approx(TOUCHED_BYTES / 350e-6 / 1e9)
    failed = rows[rows["impl"] == "ragged_dot"].iloc[0]
    assert failed["status"] == "failed" and pd.isna(failed["touched_weight_gbps"])
    copies = rows[rows["impl"] == "copy_bandwidth"]
    assert len(copies) == 2 and set(copies["op"]) == {"copy"}
    assert moe_decode.copy_bandwidth(rows)[FILE_NAME] == pytest.approx(COPY_GBPS)


def test_page_shows_shares_of_the_same_files_copy_bandwidth(page):
    gbps = TOUCHED_BYTES / 350e-6 / 1e9
    share = gbps / COPY_GBPS
    assert round(share * 100) == 78
    assert f"{fmt_int(round(COPY_GBPS))} GB/s (`{FILE_NAME}`)" in page
    assert f"| auto | 350 µs · {fmt_int(round(gbps))} GB/s (78%) |" in page
    # auto against the fastest peer: torch compiled at 500 µs, 1.43x auto's 350 µs
    assert "| 16 | 350 µs | torch\\_grouped\\_mm\\_compile 500 µs | 1.43× | 78% |" in page
    assert "failed (out of memory)" in page and "### Not measured in this run" in page
    assert "touched-weight bandwidth" in page  # the chart's title


def test_page_without_a_decode_run_says_so(stored):
    assert moe_decode.NOTHING_STORED in moe_decode.build(stored)
