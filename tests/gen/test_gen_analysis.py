"""Comparisons stay within a run; headline findings and formats come out of the stored data."""

import json
import math
import re

import pandas as pd
import pytest
from tilax_report import analysis, headlines, schema
from tilax_report.render import Page, fmt_ms, fmt_ratio, fmt_size, short_error, slim_datasets


def tiny_table(rows: list[dict]) -> pd.DataFrame:
    base = {"source_file": "f.json", "family": "moe", "suite": "layer", "routing": "dropless",
            "dispatch": "sorted", "dtype": "bfloat16", "op": "train_step", "tokens": 4096,
            "experts": 8, "top_k": 2, "d_model": 512, "d_hidden": 1024, "skew": 0.0,
            "status": "ok"}
    return analysis.with_labels(schema.conform(pd.DataFrame([base | r for r in rows])))


TWO_RUNS = [
    {"run": "a", "device": "GPU A", "impl": "pallas", "median_ms": 1.0},
    {"run": "a", "device": "GPU A", "impl": "ragged_dot", "median_ms": 3.0},
    {"run": "b", "device": "GPU B", "impl": "pallas", "median_ms": 10.0},
    {"run": "b", "device": "GPU B", "impl": "blocked", "median_ms": 5.0},
]


def test_ranking_is_within_each_run():
    ranked = analysis.rank_within_run(tiny_table(TWO_RUNS), analysis.MOE_CASE)
    by_run = ranked.set_index("run")
    assert by_run.loc["a", "fastest"] == "pallas/sorted"
    assert by_run.loc["a", "ratio"] == 3.0
    assert by_run.loc["b", "fastest"] == "blocked/sorted"
    assert by_run.loc["b", "ratio"] == 2.0


def test_speedup_baseline_comes_from_the_same_run():
    speed = analysis.speedups(tiny_table(TWO_RUNS), analysis.MOE_CASE, "ragged_dot/sorted")
    # Run b has no ragged_dot: its rows get no speedup rather than run a's baseline.
    assert set(speed["run"]) == {"a"}
    assert speed.set_index("label").loc["pallas/sorted", "speedup"] == 3.0


def test_failed_rows_are_not_ranked_but_counted():
    rows = TWO_RUNS[:2] + [{"run": "a", "device": "GPU A", "impl": "blocked", "status": "error",
                            "error": "RESOURCE_EXHAUSTED: Out of memory"}]
    ranked = analysis.rank_within_run(tiny_table(rows), analysis.MOE_CASE)
    assert ranked["failed"].item() == 1 and ranked["labels"].item() == 2


def test_across_devices_needs_two_gpus():
    table = tiny_table(TWO_RUNS)
    assert set(analysis.across_devices(table, analysis.MOE_CASE)["label"]) == {"pallas/sorted"}


def test_headline_32k_bf16_train_step_on_the_rtx3090(table, seed_doc):
    rows = [r for r in seed_doc("rtx3090-moe-layer.json")["results"]
            if r["run"] == "f_gpu_a" and r["tokens"] == 32768 and r["dtype"] == "bfloat16"
            and r["op"] == "train_step"]
    exact = sorted((r for r in rows if r["routing"] != "capacity"), key=lambda r: r["median_ms"])
    finding = headlines.moe_train_32k(analysis.with_labels(table))
    sentence = finding.sentences[0]
    assert "RTX 3090" in sentence and "`f_gpu_a`" in sentence
    assert f"**{exact[0]['impl']}/{exact[0]['dispatch']}** was fastest" in sentence
    assert f"{exact[0]['median_ms']:.2f} ms" in sentence
    assert f"**{exact[1]['median_ms'] / exact[0]['median_ms']:.2f}×**" in sentence
    dense = next(r for r in rows if r["routing"] == "dense")
    assert f"{dense['median_ms'] / exact[0]['median_ms']:.2f}× faster than dense routing" \
        in sentence


def test_rbf_memory_growth(table):
    finding = headlines.rbf_memory(analysis.with_labels(table))
    growth = analysis.memory_growth(analysis.with_labels(finding.rows))
    peak = growth[growth["suite"] == "kernel_mv_peak"].set_index(["op", "label"])
    assert peak.loc[("fwd", "pallas"), "exponent"] == pytest.approx(1.0, abs=0.05)
    assert peak.loc[("fwd", "xla"), "exponent"] == pytest.approx(0.0, abs=0.05)
    assert peak.loc[("fwd", "dense"), "failed_at"] == 65536
    assert any("dense" in s and "out of memory" in s for s in finding.sentences)


def test_growth_exponent_of_a_power_law():
    n = pd.Series([1024, 2048, 4096, 8192])
    assert analysis.growth_exponent(n, 3.0 * n**2) == pytest.approx(2.0)
    assert math.isnan(analysis.growth_exponent(n[:1], n[:1]))


@pytest.mark.parametrize("message,expected", [
    ("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
     "32.00GiB with allocator GPU_0_bfc on device 0. [tf-allocator-allocation-error='']",
     "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 32.00GiB"),
    ("For simplicity, JAX has removed its internal frames from the traceback of the following "
     "exception. Set JAX_TRACEBACK_FILTERING=off to include these.",
     "(no message stored: only JAX's traceback-filtering notice)"),
    ("JaxRuntimeError: NOT_FOUND: Failed to get configs for: 3 out of 16 instructions. See "
     "logs for all failures. Example failure: \nEXECUTION FAILED: RESOURCE_EXHAUSTED: Out of "
     "memory while trying to allocate 256.00GiB with allocator GPU_0_",
     "NOT_FOUND: autotuning failed for 3 of 16 instructions (out of memory allocating "
     "256.00GiB)"),
    ("timeout>90s", "timeout>90s"),
])
def test_short_error(message, expected):
    assert short_error(message) == expected


def test_number_formats():
    assert fmt_ms(16.011087, 15.950608, 16.096474) == "16.01 (15.95–16.10)"
    assert fmt_ms(0.049693, unit="ms") == "0.04969 ms"
    assert fmt_ratio(9.4081) == "9.41×" and fmt_ratio(15.24) == "15.2×"
    assert [fmt_size(v) for v in (4096, 131072, 1048576, 1000)] == ["4k", "128k", "1M", "1000"]


def test_chart_blocks_carry_their_spec_and_source(table):
    import altair as alt

    rows = table[table["source_file"] == "h100-moe-decoder.json"]
    page = Page("t", "T")
    page.chart(alt.Chart(rows).mark_point().encode(x="tokens:Q", y="median_ms:Q"), rows)
    text = page.render()
    spec = json.loads(re.search(r'data-chart-for="t-chart-1">(.*?)</script>', text).group(1))
    records = next(iter(spec["datasets"].values()))
    assert set().union(*records) <= {"tokens", "median_ms"}  # unused columns dropped
    assert "Source: [h100-moe-decoder.json](data/h100-moe-decoder.json)" in text
    assert "{: .tilax-source }" in text


def test_slim_datasets_keeps_fields_used_in_filters():
    spec = {"transform": [{"filter": "datum.status == 'ok'"}],
            "datasets": {"d": [{"status": "ok", "unused": 1, "gone": None}]}}
    assert slim_datasets(spec)["datasets"]["d"] == [{"status": "ok"}]
