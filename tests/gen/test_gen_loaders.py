"""Each stored format's loader: row counts per file and suite, key fields, failure rows kept."""

import json
import math
from collections import Counter

import pytest
from report_fixtures import PYTEST_BENCHMARK_FIXTURE, SEED_FILES
from tilax_report import schema
from tilax_report.load import read_result_file


def rows_of(table, name):
    return table[table["source_file"] == name]


def test_every_seed_file_is_read_with_its_format(stored):
    files = stored.files.set_index("source_file")
    assert dict(files["source_format"]) == SEED_FILES


@pytest.mark.parametrize("name", [n for n in SEED_FILES if n != "h100-moe-decoder.json"])
def test_one_table_row_per_stored_row(table, seed_doc, name):
    stored_rows = seed_doc(name)["results"]
    rows = rows_of(table, name)
    assert len(rows) == len(stored_rows)
    assert sorted(rows["source_row"]) == list(range(len(stored_rows)))


def test_table_has_the_schema_columns_and_dtypes(table):
    assert list(table.columns) == schema.COLUMN_NAMES
    for name, (dtype, _) in schema.COLUMNS.items():
        assert str(table[name].dtype) == dtype, name


def test_moe_layer_rows_per_suite_and_run(table, seed_doc):
    doc = seed_doc("rtx3090-moe-layer.json")
    rows = rows_of(table, "rtx3090-moe-layer.json")
    assert Counter(rows["suite"]) == Counter(r["suite"] for r in doc["results"])
    assert Counter(rows["suite"]) == {
        "layer": 502, "pieces": 32, "maxtok": 28, "blockm": 24, "maxtok_summary": 8,
    }
    # The file holds 19 runs, and config.sources lists the same 19 (not 20).
    assert rows["run"].nunique() == 19
    assert len(doc["config"]["sources"]) == 19
    assert Counter(rows["code"]) == {"before": 398, "final": 156, "sweep": 32,
                                     "intermediate": 8}


def test_moe_layer_values_and_source_notes(table):
    rows = rows_of(table, "rtx3090-moe-layer.json")
    row = rows[(rows["run"] == "f_gpu_a") & (rows["impl"] == "pallas")
               & (rows["dispatch"] == "sorted") & (rows["dtype"] == "bfloat16")
               & (rows["tokens"] == 32768) & (rows["op"] == "train_step")]
    assert len(row) == 1
    row = row.iloc[0]
    assert row["median_ms"] == pytest.approx(16.011087, rel=1e-6)
    assert row["q1_ms"] < row["median_ms"] < row["q3_ms"]
    assert row["device"] == "NVIDIA GeForce RTX 3090"
    assert row["jax"] == "0.11.2"
    assert row["rel_err_ref"] == "float32 dense"
    assert row["run_note"].startswith("all impls/dispatches 4k/32k")
    slabs = rows[rows["run"].str.startswith("gpu_slab_")]
    assert sorted(slabs["slab_elems"].unique()) == [0, 2**24, 2**25, 2**26]


def test_moe_maxtok_summary_rows_carry_max_tokens(table):
    summary = table[table["suite"] == "maxtok_summary"]
    summary = summary[summary["source_file"] == "rtx3090-moe-layer.json"]
    assert len(summary) == 8
    assert summary["max_tokens"].notna().all()
    sorted_final = summary[(summary["run"] == "f_gpu_maxtok") & (summary["dispatch"] == "sorted")]
    assert sorted_final["max_tokens"].item() == 1048576


def test_moe_failure_rows_are_kept_with_their_error(table, seed_doc):
    doc = seed_doc("rtx3090-moe-layer.json")
    errors = [i for i, r in enumerate(doc["results"]) if r.get("error")]
    rows = rows_of(table, "rtx3090-moe-layer.json")
    failed = rows[rows["status"] == "failed"]
    assert sorted(failed["source_row"]) == errors
    assert len(errors) == 16
    assert failed["error"].notna().all()
    assert failed["median_ms"].isna().all()
    oom = failed[(failed["run"] == "f_gpu_b") & (failed["op"] == "forward")
                 & (failed["dtype"] == "float32")]
    assert "Out of memory" in oom["error"].item()


def test_nn_suites_counts_variants_and_errors(table):
    rows = rows_of(table, "rtx3090-nn-suites.json")
    assert Counter(rows["suite"]) == {"transformer": 42, "diffusion": 42, "moe": 24,
                                      "ssm": 20, "unet": 8}
    assert set(rows.loc[rows["suite"] == "ssm", "impl"]) == {"mamba", "ssd", "mamba2",
                                                             "gdn", "lru"}
    assert set(rows.loc[rows["suite"] == "transformer", "impl"]) == {
        "probjax_default", "probjax_flex", "jax_xla", "jax_cudnn"}
    assert rows.loc[rows["suite"] == "unet", "impl"].isna().all()
    failed = rows[rows["status"] == "failed"]
    assert len(failed) == 2
    assert set(failed["suite"]) == {"transformer", "diffusion"}
    assert failed["error"].str.contains("Out of memory").all()
    assert rows.loc[rows["suite"] == "ssm", "run_note"].str.contains("re-run").all()


def test_h100_rows_are_split_into_one_row_per_op(table, seed_doc):
    doc = seed_doc("h100-moe-decoder.json")
    rows = rows_of(table, "h100-moe-decoder.json")
    assert len(doc["results"]) == 21
    assert len(rows) == 42
    assert Counter(rows["op"]) == {"forward": 21, "train_step": 21}
    assert set(rows["suite"]) == {"decoder"}
    for index, stored in enumerate(doc["results"]):
        pair = rows[rows["source_row"] == index].set_index("op")
        if stored["status"] == "ok":
            assert pair.loc["forward", "median_ms"] == stored["fwd_ms"]
            assert pair.loc["train_step", "median_ms"] == stored["train_ms"]
        else:
            assert (pair["status"] == "failed").all()
            assert (pair["error"] == stored["error"]).all()
            assert pair["median_ms"].isna().all()
    assert rows["q1_ms"].isna().all()  # the file stored no quartiles
    assert (rows["d_hidden"] == 128).all() and (rows["shared_hidden"] == 1024).all()


def test_rbf_counts_runs_and_rel_err_split(table, seed_doc):
    doc = seed_doc("rtx3090-rbf-kernels.json")
    rows = rows_of(table, "rtx3090-rbf-kernels.json")
    assert Counter(rows["suite"]) == Counter(r["family"] for r in doc["results"])
    assert Counter(rows["suite"]) == {
        "kernel_mv": 224, "kernel_mv_crossover": 216, "kde_density": 64,
        "kernel_mv_tiles": 48, "kernel_mv_peak": 18, "kernel_mv_max_n": 18,
    }
    # Every row is assigned to one run of config.runs.
    assert set(rows["run"]) == {"gpu_a", "gpu_b", "gpu_kde", "gpu_peak", "gpu_maxn", "tiles1",
                                "gpu_cross", "before_gpu"}
    for index, stored in enumerate(doc["results"]):
        row = rows[rows["source_row"] == index].iloc[0]
        err = stored.get("rel_err")
        if isinstance(err, dict):
            for key, value in err.items():
                assert row[f"rel_err_{key}"] == value
            assert math.isnan(row["rel_err"])
        elif err is not None:
            assert row["rel_err"] == err
    before = rows[rows["impl"] == "default@gpu-benchmarks"]
    assert len(before) == 48 and (before["code"] == "before").all()
    assert (before["run"] == "before_gpu").all()


def test_rbf_failures_and_timeouts_are_kept(table):
    rows = rows_of(table, "rtx3090-rbf-kernels.json")
    assert Counter(rows["status"]) == {"measured": 556, "failed": 32}
    timeout = rows[rows["error"].str.contains("timeout", na=False)].iloc[0]
    assert timeout["suite"] == "kernel_mv_max_n"
    assert timeout["impl"] == "xla" and timeout["n"] == 1048576
    assert timeout["error"] == "timeout>90s"


def test_rbf_pairs_per_second(table):
    rows = rows_of(table, "rtx3090-rbf-kernels.json")
    row = rows[rows["source_row"] == 0].iloc[0]
    assert row["pairs_per_s"] == pytest.approx(1024 * 1024 / (row["median_ms"] / 1e3))


@pytest.fixture(scope="module")
def loaded():
    """The pytest-benchmark fixture file: its parsed document and its table rows."""
    name, doc, frame = read_result_file(PYTEST_BENCHMARK_FIXTURE)
    assert name == "pytest_benchmark"
    return doc, frame


class TestPytestBenchmarkLoader:
    def test_one_row_per_benchmark(self, loaded):
        doc, frame = loaded
        assert len(frame) == len(doc["benchmarks"]) == 26
        assert Counter(frame["family"]) == {"moe": 16, "rbf": 10}
        assert Counter(frame["suite"])["layer"] == 8

    def test_run_and_machine(self, loaded):
        _, frame = loaded
        assert set(frame["device"]) == {"NVIDIA H200"}
        assert set(frame["jax"]) == {"0.11.2"}
        assert set(frame["gpu_driver"]) == {"570.86.15"}
        assert set(frame["cuda"]) == {"12.8"} and set(frame["triton"]) == {"3.6.0"}
        assert set(frame["date"]) == {"2026-01-15"}
        assert set(frame["commit"]) == {"0a1b2c3"}

    def test_per_round_times_are_kept(self, loaded):
        doc, frame = loaded
        for index, bench in enumerate(doc["benchmarks"]):
            if "data" in bench.get("stats", {}) and frame.iloc[index]["status"] == "measured":
                assert frame.iloc[index]["round_ms"] == pytest.approx(
                    [v * 1e3 for v in bench["stats"]["data"]])

    def test_stats_are_converted_to_milliseconds(self, loaded):
        doc, frame = loaded
        for index, bench in enumerate(doc["benchmarks"]):
            row = frame.iloc[index]
            if row["status"] != "measured" or row["summary"]:
                continue
            assert row["median_ms"] == pytest.approx(bench["stats"]["median"] * 1e3)
            assert row["q1_ms"] == pytest.approx(bench["stats"]["q1"] * 1e3)
            assert row["q3_ms"] == pytest.approx(bench["stats"]["q3"] * 1e3)
            assert row["rounds"] == bench["stats"]["rounds"]

    def test_failure_rows_keep_the_error_and_drop_the_noop_stats(self, loaded):
        _, frame = loaded
        failed = frame[frame["status"] != "measured"]
        assert Counter(failed["status"]) == {"failed": 3}
        assert failed["median_ms"].isna().all()
        assert failed["tflops"].isna().all() and failed["pairs_per_s"].isna().all()
        oom = failed[failed["error"].str.startswith("RESOURCE")].iloc[0]
        assert oom["impl"] == "ragged_dot" and oom["tokens"] == 131072
        assert oom["error"].startswith("RESOURCE_EXHAUSTED")

    def test_summary_rows_time_nothing(self, loaded):
        _, frame = loaded
        summary = frame[frame["summary"]]
        assert len(summary) == 2
        assert summary["median_ms"].isna().all()
        assert set(summary["max_tokens"].dropna()) == {131072}
        assert set(summary["max_n"].dropna()) == {524288}

    def test_rel_err_float_and_dict(self, loaded):
        _, frame = loaded
        rbf = frame[(frame["suite"] == "kernel_mv") & (frame["impl"] == "pallas")]
        fwd = rbf[rbf["op"] == "fwd"].iloc[0]
        grad = rbf[rbf["op"] == "fwd_bwd"].iloc[0]
        assert fwd["rel_err"] == 0.00021 and math.isnan(fwd["rel_err_dq"])
        assert grad["rel_err_dq"] == 0.00041 and grad["rel_err_dlengthscale"] == 0.00017
        assert grad["rel_err_ref"] == "float64 reference"
        moe = frame[(frame["suite"] == "layer") & (frame["impl"] == "pallas")
                    & (frame["op"] == "train_step")].iloc[0]
        assert moe["rel_err_out"] == 0.0312 and moe["rel_err_ref"] == "float32 dense"

    def test_unknown_extra_info_keys_are_kept_as_json(self, tmp_path):
        import json

        doc = json.loads(PYTEST_BENCHMARK_FIXTURE.read_text())
        doc["benchmarks"][0]["extra_info"]["new_knob"] = 7
        path = tmp_path / "run.json"
        path.write_text(json.dumps(doc))
        _, _, frame = read_result_file(path)
        assert json.loads(frame.iloc[0]["extra"]) == {"new_knob": 7}
        assert frame["extra"].iloc[1:].isna().all()

    def test_the_router_is_its_own_column(self, tmp_path):
        import json

        doc = json.loads(PYTEST_BENCHMARK_FIXTURE.read_text())
        doc["benchmarks"][0]["extra_info"]["router"] = "sigmoid bias groups 8/4 scale 2.5"
        path = tmp_path / "run.json"
        path.write_text(json.dumps(doc))
        _, _, frame = read_result_file(path)
        assert frame.iloc[0]["router"] == "sigmoid bias groups 8/4 scale 2.5"
        assert frame["extra"].isna().all() and frame["router"].iloc[1:].isna().all()


def test_every_file_in_the_real_data_dir_is_read(real_data_dir):
    """Whatever has been added to data/results/, every file loads and keeps all its rows."""
    from tilax_report.load import load_results

    stored = load_results(real_data_dir)
    names = {
        p.name for p in (real_data_dir / "results").iterdir()
        if p.is_file() and not p.name.startswith(".")
    }
    assert set(stored.files["source_file"]) == names
    for name in names:
        doc = json.loads((real_data_dir / "results" / name).read_text())
        rows = stored.rows[stored.rows["source_file"] == name]
        if "benchmarks" in doc:
            assert len(rows) == len(doc["benchmarks"])
        elif name != "h100-moe-decoder.json":  # one stored row holds both ops there
            assert len(rows) == len(doc["results"])
