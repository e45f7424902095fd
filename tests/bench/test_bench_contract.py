"""The bench suite's own checks: file naming, the rows side file, and a real smoke run whose
JSON must satisfy the extra_info contract (in GPU runs every row is checked as it finishes by
the ``bench`` fixture instead)."""

import datetime
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from bench_naming import gpu_slug, result_path
from bench_rows import check_document, check_extra_info, merge, read_side_file

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parents[1]


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA GeForce RTX 3090", "rtx3090"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 NVL", "h100"),
    ("Tesla V100-SXM2-16GB", "v100"),
    (None, "cpu"),
])
def test_gpu_slug(name, slug):
    assert gpu_slug(name) == slug


def test_result_path_never_overwrites(tmp_path):
    day = datetime.date(2026, 11, 30)
    first = result_path(tmp_path, "moe", gpu="NVIDIA H200", date=day, commit="abc1234")
    assert first.name == "h200-20261130-abc1234-moe.json"
    first.write_text("{}")
    second = result_path(tmp_path, "moe", gpu="NVIDIA H200", date=day, commit="abc1234")
    assert second.name == "h200-20261130-abc1234-moe-2.json"


def test_contract_flags_missing_keys_and_bad_failure_rows():
    row = {"family": "moe", "suite": "layer", "impl": "pallas", "dtype": "bfloat16",
           "op": "forward", "compile_s": 0.5}
    problems = check_extra_info(row)
    assert any("tokens" in p for p in problems)
    assert any("tflops" in p for p in problems)
    failed = dict(row, error="", routing="dropless", dispatch="sorted", tokens=8, d_model=4,
                  d_hidden=4, experts=2, top_k=1, shared_hidden=0, skew=0.0)
    assert check_extra_info(failed) == ["error must be a non-empty string"]


def test_side_file_survives_a_torn_last_line_and_merges(tmp_path):
    side = tmp_path / "run.rows.jsonl"
    header = {"kind": "header", "machine_info": {"gpu": "X"}, "commit_info": {}}
    rows = [{"kind": "benchmark", "name": f"b{i}", "fullname": f"t::b{i}"} for i in range(2)]
    side.write_text("\n".join(json.dumps(r) for r in [header, *rows]) + '\n{"kind": "bench')
    document = read_side_file(side)
    assert [b["name"] for b in document["benchmarks"]] == ["b0", "b1"]
    merged = merge([document, document])
    assert len(merged["benchmarks"]) == 2
    with pytest.raises(ValueError, match="different devices"):
        merge([document, dict(document, machine_info={"gpu": "Y"})])


# Every bench row of the suite, run once in a plain pytest: pytest-benchmark turns itself off
# in xdist workers (tests/bench/conftest.py deselects the rows there), so this is where
# ``nox -s tests`` runs them.
BENCH_ROW_FILES = ["tests/bench/test_bench_moe.py", "tests/bench/test_bench_rbf.py",
                   "tests/bench/test_bench_ep.py", "tests/bench/test_bench_guides.py",
                   "tests/bench/test_bench_gp.py"]


def child_env() -> dict[str, str]:
    """The environment of a child pytest over tests/bench: not an xdist worker (where the rows
    are deselected), the same tilax as this process."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("PYTEST_XDIST")}
    env["TILAX_BENCH_COMMIT"] = "test"
    import tilax

    src = str(Path(tilax.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    return env


@pytest.mark.parametrize("mode, unit_tests_run", [("--bench-quick", False),
                                                  ("--bench-smoke", True)])
def test_a_timed_run_collects_its_rows_only(mode, unit_tests_run):
    """A quick or full run (a GPU call) times rows and runs no unit test of tests/bench; smoke
    mode (``nox -s tests``) keeps them."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/bench/test_bench_moe.py",
         "tests/bench/test_bench_peer_probes.py", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
         "--collect-only", mode, "--bench-suite", "pieces"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert any("::test_pieces[" in node for node in ids), ids
    assert any("test_bench_peer_probes.py::" in node for node in ids) == unit_tests_run, ids


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """A real bench run of every row in smoke mode, in a subprocess: ``(document, side file,
    pytest's output)``."""
    output = tmp_path_factory.mktemp("smoke") / "run.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *BENCH_ROW_FILES, "-p", "no:cacheprovider",
         "-p", "no:xdist", "-q", "--bench-smoke", f"--benchmark-json={output}"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    side = read_side_file(output.with_suffix("").with_suffix(".rows.jsonl"))
    return json.loads(output.read_text()), side, proc.stdout


def test_smoke_run_writes_contract_rows(smoke_run):
    """Every row of the smoke run satisfies the contract, one row per test that ran, failures
    are rows with an error, the ladder has steps with peak_mb and a summary."""
    document, side, output = smoke_run
    assert check_document(document) == []
    rows = {b["name"]: b["extra_info"] for b in document["benchmarks"]}
    passed = int(re.search(r"(\d+) passed", output).group(1))
    assert len(rows) == len(document["benchmarks"]) == passed
    assert document["machine_info"]["commit"] == "test"
    # the checkout's git history (this repository's) is kept apart from the declared tree
    assert document["commit_info"]["id"] == "test"
    assert document["commit_info"]["source"] == "TILAX_BENCH_COMMIT"
    assert "host_git" in document["commit_info"]

    failures = [info for info in rows.values() if "error" in info]
    assert {info["impl"] for info in failures} >= {"tokamax"}
    layer = rows["test_layer[layer-pallas-sorted-f32-T64-E4k2-d32h64-forward]"]
    assert layer["tflops"] > 0 and layer["rel_err_out"] < 1e-4
    assert 0 < layer["max_expert_frac"] <= 1
    kernel = rows["test_kernel_mv[kernel_mv-xla-n64-d8-o16-fwd_bwd]"]
    assert set(kernel["rel_err"]) == {"dq", "dk", "dv", "dlengthscale"}
    assert max(kernel["rel_err"].values()) < 1e-4
    gp = rows["test_gp[gp-tilax-rbf-n64-d8-mll_grad]"]
    assert gp["cg_iterations"] >= 1 and gp["rel_err_mll"] < 0.1
    assert rows["test_gp[gp-dense-rbf-n64-d8-mll_grad]"]["rel_err_mll"] < 1e-5
    ladder = [b for b in document["benchmarks"] if b["extra_info"]["suite"] == "kernel_mv_max_n"]
    assert [b["extra_info"].get("max_n") for b in ladder] == [None, None, 128]
    for row in ladder:  # the child's timings, as the row's stats
        assert "peak_mb" in row["extra_info"] and row["extra_info"]["pairs_per_s"] > 0
        assert row["stats"]["rounds"] == len(row["extra_info"]["child_times_s"])
        assert row["stats"]["median"] == pytest.approx(
            statistics.median(row["extra_info"]["child_times_s"]))

    assert [b["name"] for b in side["benchmarks"]] == [b["name"] for b in document["benchmarks"]]
    assert side["machine_info"]["platform"] == document["machine_info"]["platform"]
    side_ladder = [b for b in side["benchmarks"] if b["extra_info"]["suite"] == "kernel_mv_max_n"]
    assert [b["stats"]["median"] for b in side_ladder] == [b["stats"]["median"] for b in ladder]


def test_smoke_run_names_the_code_it_measured(smoke_run):
    """The file's provenance: the git tree ids of src/ and tests/bench/ as they were on disk,
    and no claim that they match the declared commit where that cannot be checked."""
    from bench_provenance import measured_trees

    document, _, _ = smoke_run
    provenance = document["machine_info"]["tilax_provenance"]
    assert provenance["trees"] == measured_trees()
    assert len(provenance["code_hash"]) == 64
    assert provenance["declared_commit"] == "test"
    assert provenance["tree_matches_declared"] is None  # "test" is no commit git knows


def test_a_failed_ladder_summary_conforms():
    summary = {"family": "moe", "suite": "maxtok_summary", "impl": "tokamax", "dtype": "bfloat16",
               "op": "train_step", "compile_s": None, "routing": "dropless", "dispatch": None,
               "tokens": 262144, "d_model": 512, "d_hidden": 1024, "experts": 8, "top_k": 2,
               "shared_hidden": 0, "skew": 0.0, "error": "no size ran: unavailable: tokamax"}
    assert check_extra_info(summary) == []


def test_results_are_filed_under_the_commit_of_the_measured_code(tmp_path, monkeypatch):
    """A commit outside src/ and tests/bench/ (docs, stored data) keeps the run's commit; an
    uncommitted change of measured code marks it dirty."""
    from bench_naming import short_commit

    monkeypatch.delenv("TILAX_BENCH_COMMIT", raising=False)

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "bench@example.com")
    git("config", "user.name", "bench")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "kernel.py").write_text("x = 1\n")
    git("add", ".")
    git("commit", "-qm", "kernel")
    measured = git("rev-parse", "--short", "HEAD")
    (tmp_path / "docs.md").write_text("words\n")
    git("add", ".")
    git("commit", "-qm", "docs")
    assert short_commit(tmp_path) == measured
    (tmp_path / "src" / "kernel.py").write_text("x = 2\n")
    assert short_commit(tmp_path) == f"{measured}+dirty"


def test_a_full_sha_override_is_filed_under_its_short_form(tmp_path, monkeypatch):
    from bench_naming import result_path, short_commit

    sha = "81f437f913ad1e46f220186eb2fd4fa4123f8606"
    monkeypatch.setenv("TILAX_BENCH_COMMIT", sha)
    assert short_commit() == "81f437f"
    assert result_path(tmp_path, "decoder", gpu="NVIDIA H200").name.startswith(
        "h200-") and result_path(tmp_path, "decoder", gpu="NVIDIA H200").name.endswith(
        "-81f437f-decoder.json")
    monkeypatch.setenv("TILAX_BENCH_COMMIT", sha + "+dirty")
    assert short_commit() == "81f437f+dirty"
    monkeypatch.setenv("TILAX_BENCH_COMMIT", "test")  # not a sha: as given
    assert short_commit() == "test"


def test_a_declared_commit_replaces_the_checkouts_stale_one():
    from bench_naming import declared_commit_info

    stale = {"id": "5b58517" + "0" * 33, "dirty": True, "branch": "main"}
    declared = declared_commit_info(stale, "6358c5c")
    assert declared == {"id": "6358c5c", "dirty": False, "source": "TILAX_BENCH_COMMIT",
                        "host_git": stale}
    assert declared_commit_info(stale, "6358c5c+dirty")["dirty"] is True
    assert declared_commit_info(stale, None) is stale  # nothing declared: git's own view
    current = {"id": "6358c5c" + "0" * 33, "dirty": False}
    assert declared_commit_info(current, "6358c5c") is current  # the checkout agrees
    assert declared_commit_info(current, "6358c5c+dirty")["host_git"] is current
    assert declared_commit_info({}, "test")["id"] == "test"  # no git at all


def test_tree_ids_are_gits_own(tmp_path):
    """The measured tree ids equal ``git rev-parse HEAD:<path>``, also with an executable, a
    subfolder and the ignored leftovers of a run; a changed byte changes the id, and the
    declared commit is matched or not."""
    from bench_provenance import declared_trees, provenance, tree_id

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "bench@example.com")
    git("config", "user.name", "bench")
    (tmp_path / "src" / "pkg" / "inner").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "src" / "pkg" / "a.pyx").write_text("y = 1\n")  # sorts after "a.py"
    (tmp_path / "src" / "pkg" / "inner" / "b.py").write_bytes(b"\x00\xff")
    (tmp_path / "src" / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "src" / "run.sh").chmod(0o755)
    (tmp_path / "tests" / "bench").mkdir(parents=True)
    (tmp_path / "tests" / "bench" / "bench_x.py").write_text("z = 3\n")
    git("add", ".")
    git("commit", "-qm", "code")
    (tmp_path / "src" / "pkg" / "__pycache__").mkdir()
    (tmp_path / "src" / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"junk")
    assert tree_id(tmp_path / "src") == git("rev-parse", "HEAD:src")
    assert tree_id(tmp_path / "tests" / "bench") == git("rev-parse", "HEAD:tests/bench")
    head = git("rev-parse", "--short", "HEAD")
    assert declared_trees(head, tmp_path) == {"src": git("rev-parse", "HEAD:src"),
                                              "tests/bench": git("rev-parse", "HEAD:tests/bench")}
    assert provenance(head, tmp_path)["tree_matches_declared"] is True
    (tmp_path / "src" / "pkg" / "a.py").write_text("x = 2\n")
    assert tree_id(tmp_path / "src") != git("rev-parse", "HEAD:src")
    assert provenance(head + "+dirty", tmp_path)["tree_matches_declared"] is False
    assert provenance("0000000", tmp_path)["tree_matches_declared"] is None
