"""Building the site for the tests: `mkdocs build --strict` in a subprocess, data folder chosen
through TILAX_DATA_DIR (imported by name: keep it unique)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"
PYTEST_BENCHMARK_FIXTURE = REPO / "tests" / "gen" / "fixtures" / "h200-20260115-0a1b2c3.json"
REPORT_PAGES = ["index", "moe-layer", "moe-internals", "moe-decoder", "rbf", "nn-suites",
                "raw-data"]


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
