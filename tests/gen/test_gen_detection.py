"""Format detection and unreadable files: each fails with a message naming the file and why."""

import json

import pytest
from report_fixtures import PYTEST_BENCHMARK_FIXTURE, SEED_FILES
from tilax_report.formats._common import FormatError
from tilax_report.load import (
    UnreadableResultFile,
    detect_format,
    load_results,
    read_result_file,
    result_files,
)


@pytest.mark.parametrize("name,fmt", sorted(SEED_FILES.items()))
def test_seed_formats_are_detected(data_dir, name, fmt):
    assert detect_format(json.loads((data_dir / "results" / name).read_text())) == fmt


def test_pytest_benchmark_format_is_detected():
    assert detect_format(json.loads(PYTEST_BENCHMARK_FIXTURE.read_text())) == "pytest_benchmark"


def write(tmp_path, name, content):
    (tmp_path / "results").mkdir(exist_ok=True)
    path = tmp_path / "results" / name
    path.write_text(content) if isinstance(content, str) else path.write_bytes(content)
    return path


def failure(path) -> str:
    with pytest.raises(UnreadableResultFile) as info:
        read_result_file(path)
    message = str(info.value)
    assert path.name in message
    return message


def test_malformed_json_names_file_line_and_column(tmp_path):
    path = write(tmp_path, "broken.json", '{"benchmarks": [1, 2,,]}')
    message = failure(path)
    assert "malformed JSON at line 1 column" in message


def test_unknown_format_names_the_keys_it_saw(tmp_path):
    path = write(tmp_path, "other.json", json.dumps({"rows": [], "meta": {}}))
    message = failure(path)
    assert "unknown format" in message and "meta, rows" in message


def test_top_level_list_is_unknown(tmp_path):
    assert "JSON list" in failure(write(tmp_path, "list.json", "[1, 2]"))


def test_non_utf8_file(tmp_path):
    assert "not UTF-8" in failure(write(tmp_path, "latin1.json", b'{"a": "\xe9"}'))


def test_ambiguous_format():
    # Both the MoE seed shape (config.sources) and the RBF seed shape (config.runs, runner).
    doc = {"device": {}, "config": {"sources": [], "runs": {}, "runner": "x"}, "results": []}
    with pytest.raises(FormatError, match="ambiguous format: matches moe_layer_seed, rbf_seed"):
        detect_format(doc)


def test_seed_row_missing_a_required_field(tmp_path, data_dir):
    doc = json.loads((data_dir / "results" / "rtx3090-moe-layer.json").read_text())
    del doc["results"][5]["suite"]
    message = failure(write(tmp_path, "moe.json", json.dumps(doc)))
    assert "results[5]" in message and "suite" in message


def test_seed_row_with_an_unknown_field(tmp_path, data_dir):
    doc = json.loads((data_dir / "results" / "h100-moe-decoder.json").read_text())
    doc["results"][3]["new_metric"] = 1.0
    message = failure(write(tmp_path, "h100.json", json.dumps(doc)))
    assert "results[3]" in message and "new_metric" in message


def test_pytest_benchmark_row_without_the_contract_fields(tmp_path):
    doc = json.loads(PYTEST_BENCHMARK_FIXTURE.read_text())
    del doc["benchmarks"][2]["extra_info"]["family"]
    message = failure(write(tmp_path, "run.json", json.dumps(doc)))
    assert "benchmarks[2]" in message and "family" in message


def test_load_results_fails_on_the_one_bad_file_among_good_ones(tmp_path, data_dir):
    for path in result_files(data_dir):
        write(tmp_path, path.name, path.read_bytes())
    write(tmp_path, "zz-unknown.json", json.dumps({"hello": "world"}))
    with pytest.raises(UnreadableResultFile, match="zz-unknown.json"):
        load_results(tmp_path)


def test_a_value_that_does_not_fit_its_column_names_its_file(tmp_path, data_dir):
    # load_results casts the files' rows together: the error must still name the one file.
    for path in result_files(data_dir):
        write(tmp_path, path.name, path.read_bytes())
    doc = json.loads(PYTEST_BENCHMARK_FIXTURE.read_text())
    doc["benchmarks"][1]["extra_info"]["tokens"] = 4096.5
    write(tmp_path, "mid-run.json", json.dumps(doc))
    with pytest.raises(UnreadableResultFile,
                       match=r"mid-run\.json.*'tokens' does not fit dtype Int64"):
        load_results(tmp_path)


def test_empty_or_missing_results_folder(tmp_path):
    with pytest.raises(UnreadableResultFile, match="does not exist"):
        load_results(tmp_path)
    (tmp_path / "results").mkdir()
    with pytest.raises(UnreadableResultFile, match="no stored files"):
        load_results(tmp_path)
