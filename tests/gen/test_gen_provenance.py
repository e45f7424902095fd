"""Provenance: the code hash of src/ and tests/bench/, the committed table of declared commits
(up to date, append-only, read without git), and bench-time provenance in new files."""

import json
import shutil
import subprocess
import tarfile

import pytest
from report_fixtures import PYTEST_BENCHMARK_FIXTURE, REPO
from tilax_report import provenance
from tilax_report.load import UnreadableResultFile, load_results

TABLE = REPO / "data" / provenance.DECLARED_COMMITS


def test_the_declared_commits_table_is_up_to_date_with_the_stored_files_and_git():
    problems = provenance.update(REPO, REPO / "data", check=True)
    assert problems == [], "run: PYTHONPATH=gen python -m tilax_report.provenance"
    table = json.loads(TABLE.read_text())
    assert set(table) == provenance.declared_commits_of_stored_files(REPO / "data")


def test_code_hash_of_a_tree_on_disk_equals_the_hash_git_gives_for_its_commit(tmp_path):
    """What the bench harness records from the files (tests/bench/bench_provenance.py) is the
    code hash the site computes from git for the commit; a changed file changes it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_provenance", REPO / "tests" / "bench" / "bench_provenance.py",
        submodule_search_locations=[])
    archive = tmp_path / "head.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), "HEAD", "src",
                    "tests/bench"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "tree", filter="data")
    (tmp_path / "tree" / "src" / "__pycache__").mkdir()
    (tmp_path / "tree" / "src" / "__pycache__" / "x.cpython-312.pyc").write_bytes(b"\0")
    import sys

    sys.path.insert(0, str(REPO / "tests" / "bench"))
    try:
        bench_provenance = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench_provenance)
    finally:
        sys.path.remove(str(REPO / "tests" / "bench"))

    def on_disk():
        return bench_provenance.provenance(None, tmp_path / "tree")["code_hash"]

    assert on_disk() == provenance.code_hash_of_commit(REPO, "HEAD")
    (tmp_path / "tree" / "tests" / "bench" / "conftest.py").write_text("# changed\n")
    assert on_disk() != provenance.code_hash_of_commit(REPO, "HEAD")


def test_identical_code_under_two_commits_has_one_hash_and_the_peer_fix_is_recorded():
    table = json.loads(TABLE.read_text())
    assert table["bca31f0"]["code_hash"] == table["6358c5c"]["code_hash"]
    assert table["bca31f0"]["src_tree"] == table["6358c5c"]["src_tree"]
    assert table["eae54e0"]["code_hash"] != table["6358c5c"]["code_hash"]
    assert table["9cd4196"]["has_peer_fixes"] == ["9cd4196"]
    assert table["a84ba7d"]["has_peer_fixes"] == []


def test_the_table_is_append_only(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(REPO / "data" / "provenance", data / "provenance")
    (data / "results").mkdir()
    for name in ("h200-20261204-bca31f0-decoder-peers-131k.json",
                 "h200-20261205-eae54e0-decoder-peers-131k.json"):
        shutil.copy(REPO / "data" / "results" / name, data / "results" / name)
    table_path = data / provenance.DECLARED_COMMITS
    table = json.loads(table_path.read_text())
    kept = table.pop("eae54e0")
    table["bca31f0"]["code_hash"] = "0" * 64
    table_path.write_text(json.dumps(table))
    problems = provenance.update(REPO, data, check=True)
    assert any(p.startswith("eae54e0: declared by a stored file, missing") for p in problems)
    assert any(p.startswith("bca31f0: the stored entry no longer matches git")
               for p in problems)
    assert provenance.update(REPO, data, check=False) == []  # appends, rewrites nothing
    table = json.loads(table_path.read_text())
    assert table["eae54e0"] == kept and table["bca31f0"]["code_hash"] == "0" * 64


def test_the_site_reads_provenance_without_git(tmp_path, monkeypatch):
    data = tmp_path / "data"
    shutil.copytree(REPO / "data" / "provenance", data / "provenance")
    (data / "results").mkdir()
    name = "h200-20261204-6358c5c-decoder-peers-16k-131k.json"
    shutil.copy(REPO / "data" / "results" / name, data / "results" / name)

    def no_git(*args, **kwargs):
        raise AssertionError(f"the site ran a process: {args}")

    monkeypatch.setattr(subprocess, "run", no_git)
    monkeypatch.setattr(subprocess, "Popen", no_git)
    rows = load_results(data).rows
    table = json.loads((data / provenance.DECLARED_COMMITS).read_text())
    assert set(rows["code_hash"]) == {table["6358c5c"]["code_hash"]}
    assert set(rows["code_hash_source"]) == {"declared"}
    assert rows["tree_matches_declared"].isna().all()
    # what pytest-benchmark found on the GPU host: another commit, with uncommitted changes
    assert set(rows["recorded_head"]) == {"5b58517"} and rows["recorded_dirty"].all()


def stored_provenance_file(folder, provenance_info):
    doc = json.loads(PYTEST_BENCHMARK_FIXTURE.read_text())
    doc["machine_info"]["tilax_provenance"] = provenance_info
    (folder / "results").mkdir(exist_ok=True)
    (folder / "results" / PYTEST_BENCHMARK_FIXTURE.name).write_text(json.dumps(doc))
    return folder


def test_bench_time_provenance_is_read_as_stored(tmp_path):
    info = {"code_hash": "ab" * 32, "declared_commit": "0a1b2c3d" + "0" * 32,
            "tree_matches_declared": False}
    rows = load_results(stored_provenance_file(tmp_path, info)).rows
    assert set(rows["code_hash"]) == {"ab" * 32}
    assert set(rows["code_hash_source"]) == {"stored"}
    assert set(rows["commit"]) == {"0a1b2c3"}
    assert not rows["tree_matches_declared"].any()


def test_incomplete_bench_time_provenance_fails_the_file(tmp_path):
    stored_provenance_file(tmp_path, {"code_hash": "ab" * 32})
    with pytest.raises(UnreadableResultFile, match="tilax_provenance: missing field"):
        load_results(tmp_path)
