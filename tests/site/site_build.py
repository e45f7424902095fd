"""Building the site for the tests: `mkdocs build --strict` in a subprocess, data folder chosen
through TILAX_DATA_DIR (imported by name: keep it unique)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"
PYTEST_BENCHMARK_FIXTURE = REPO / "tests" / "gen" / "fixtures" / "h200-20260115-0a1b2c3.json"
for _path in (REPO / "gen", REPO / "tests" / "gen", REPO / "tests" / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import ep_run  # noqa: E402
from slower_run import write_slower_copy  # noqa: E402
from tilax_report import site  # noqa: E402
from tilax_report.load import load_results  # noqa: E402

# The generated report pages, as the built site names them (from the page list).
REPORT_PAGES = [Path(site.page_module(name).PATH).stem for name in site.PAGES]
EP_PAGE = Path(site.page_module("moe_ep").PATH).stem
# Pages of suites that no stored run may hold yet (two GPUs; new suites), with what they say then.
AWAITING_RUN = {
    EP_PAGE: "No expert-parallel run is stored yet",
    Path(site.page_module("moe_decode").PATH).stem: "No run of the decode suite is stored yet",
    Path(site.page_module("gp").PATH).stem: "No Gaussian-process run is stored yet",
    Path(site.page_module("fp8_convergence").PATH).stem: (
        "No run of the FP8 convergence suite is stored yet"),
}
SLOWER_COMMIT = "5e7e4a1"


def build_site(site_dir: Path, data_dir: Path | None = None) -> subprocess.CompletedProcess:
    """Run `mkdocs build --strict` into ``site_dir``, reading ``data_dir`` (default: data/)."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", DISABLE_MKDOCS_2_WARNING="true")
    env.pop("TILAX_DATA_DIR", None)
    if data_dir is not None:
        env["TILAX_DATA_DIR"] = str(data_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"),
                                                      env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(REPO / "mkdocs.yml"), "--site-dir", str(site_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )


def copy_data(target: Path, *extra: Path) -> Path:
    """A temporary copy of data/ with ``extra`` files added to its results/."""
    shutil.copytree(DATA, target)
    for path in extra:
        shutil.copy(path, target / "results" / path.name)
    return target


def add_slower_newest_run(results_dir: Path, factor: float = 1.3) -> tuple[str, str]:
    """Copy every file of the newest stored pytest-benchmark run in ``results_dir`` as a run
    a day newer than any stored file, at commit SLOWER_COMMIT, with every time times
    ``factor``. Returns (the copied run's id, the new run's id)."""
    table = load_results(results_dir.parent).table
    ours = table[table["source_format"] == "pytest_benchmark"]
    newest = ours.sort_values(["started", "run"]).iloc[-1]
    files = sorted(ours.loc[ours["run"] == newest["run"], "source_file"].unique())
    last = pd.to_datetime(ours["started"], utc=True, format="ISO8601").max()
    made = []
    for name in files:
        first = pd.to_datetime(ours.loc[ours["source_file"] == name, "started"].iloc[0],
                               utc=True)
        days = (last - first).days + 1
        made.append(write_slower_copy(results_dir / name, results_dir, factor, SLOWER_COMMIT,
                                      days_later=days))
    table = load_results(results_dir.parent).table
    return newest["run"], table.loc[table["source_file"] == made[0].name, "run"].iloc[0]


def add_skipped_only_run(results_dir: Path) -> Path:
    """A run on another GPU whose RBF rows were all skipped (never attempted): its RBF charts
    have nothing to draw."""
    doc = json.loads(PYTEST_BENCHMARK_FIXTURE.read_text())
    doc["machine_info"] = dict(doc["machine_info"], gpu="NVIDIA L4", commit="0dd5eed")
    doc["benchmarks"] = [b for b in doc["benchmarks"] if b["extra_info"]["family"] == "rbf"]
    for bench in doc["benchmarks"]:
        bench["extra_info"]["error"] = ("skipped: not attempted, the run's time budget of 10 s "
                                        "was spent before this row")
    path = results_dir / "l4-20260115-0dd5eed-rbf.json"
    path.write_text(json.dumps(doc))
    return path


def add_ep_run(results_dir: Path) -> Path:
    """A two-GPU expert-parallel run (tests/gen/ep_run.py) of an earlier commit: the expert
    parallel page has charts and tables to show."""
    return ep_run.write_ep_run(results_dir)
