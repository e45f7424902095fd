"""The sdist and the wheel, built as ``nox -s dist`` builds them (``python -m build``: the
sdist, then the wheel from the sdist): twine accepts them, they hold the package and its
license and nothing of the repository's data, site or tests, their version is the package's,
and the wheel, installed into a fresh virtual environment outside the repository, runs the
getting-started page.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

import pytest

import tilax

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "tilax"
GETTING_STARTED = REPO / "docs" / "getting-started.md"
# Files of the sdist besides the package: metadata, what it is, what changed, the license;
# .gitignore is one hatch always adds (the sdist's own build reads it).
SDIST_TOP_LEVEL = {"PKG-INFO", "pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE",
                   ".gitignore"}
BUILD_TIMEOUT_S = 600
# Creating the environment and installing the wheel with JAX: PyPI downloads on a cold cache.
INSTALL_TIMEOUT_S = 900
PAGE_TIMEOUT_S = 300


@dataclass(frozen=True)
class Dists:
    sdist: Path
    wheel: Path


def doc_examples():
    """tests/docs/test_doc_examples.py, loaded by path: its extraction of the runnable blocks
    (``page_script``) and the environment a reader would not have are the ones used here."""
    path = REPO / "tests" / "docs" / "test_doc_examples.py"
    name = "tilax_doc_examples_for_packaging"
    if str(path.parent) not in sys.path:  # it imports doc_blocks beside it
        sys.path.insert(0, str(path.parent))
    if name not in sys.modules:  # its dataclasses look their module up there
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def package_files() -> set[str]:
    """Files of src/tilax, relative to src/ (what the wheel must hold)."""
    return {path.relative_to(PACKAGE.parent).as_posix() for path in PACKAGE.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts}


def run(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed ({proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="session")
def dists(request, tmp_path_factory) -> Dists:
    """One build per test run: the xdist workers share it through a locked folder."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if hasattr(request.config, "workerinput") else base
    folder = shared / "tilax-dist"
    with open(shared / "tilax-dist.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "tilax-dist.built").exists():
            run([sys.executable, "-m", "build", "--outdir", str(folder), str(REPO)],
                BUILD_TIMEOUT_S)
            (shared / "tilax-dist.built").touch()
    sdists, wheels = list(folder.glob("*.tar.gz")), list(folder.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, f"built: {sorted(os.listdir(folder))}"
    return Dists(sdists[0], wheels[0])


def test_twine_check_passes(dists: Dists) -> None:
    run([sys.executable, "-m", "twine", "check", "--strict", str(dists.sdist), str(dists.wheel)],
        120)


def test_version_is_the_package_version(dists: Dists) -> None:
    version = tilax.__version__  # src/tilax/__init__.py: the one place it is written
    assert dists.wheel.name == f"tilax-{version}-py3-none-any.whl"
    assert dists.sdist.name == f"tilax-{version}.tar.gz"
    with zipfile.ZipFile(dists.wheel) as wheel:
        metadata = HeaderParser().parsestr(
            wheel.read(f"tilax-{version}.dist-info/METADATA").decode())
    assert metadata["Name"] == "tilax" and metadata["Version"] == version


def test_wheel_holds_the_package_and_its_license(dists: Dists) -> None:
    version = tilax.__version__
    info = f"tilax-{version}.dist-info"
    with zipfile.ZipFile(dists.wheel) as wheel:
        names = set(wheel.namelist())
        metadata = HeaderParser().parsestr(wheel.read(f"{info}/METADATA").decode())
        license_text = wheel.read(f"{info}/licenses/LICENSE").decode()
    assert {n for n in names if not n.startswith(f"{info}/")} == package_files()
    assert license_text == (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0" in license_text
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert metadata["Description-Content-Type"] == "text/markdown"


def test_sdist_holds_the_sources_and_no_data_site_or_tests(dists: Dists) -> None:
    root = dists.sdist.name.removesuffix(".tar.gz")
    with tarfile.open(dists.sdist) as sdist:
        names = {m.name.removeprefix(f"{root}/") for m in sdist.getmembers() if m.isfile()}
    package = {f"src/{name}" for name in package_files()}
    assert names == SDIST_TOP_LEVEL | package, (
        f"unexpected: {sorted(names - SDIST_TOP_LEVEL - package)}, "
        f"missing: {sorted((SDIST_TOP_LEVEL | package) - names)}")
    for folder in ("data/", "site/", "tests/", "docs/", "gen/", ".github/"):
        assert not any(name.startswith(folder) for name in names), folder


@pytest.mark.release
def test_wheel_runs_the_getting_started_page_in_a_fresh_environment(
        dists: Dists, tmp_path: Path) -> None:
    """A new virtual environment in a temporary folder (no system site-packages), the wheel
    and its dependencies (JAX for the CPU) from the package index, and the page's runnable
    blocks as one script, run from that folder with none of this environment's settings."""
    examples = doc_examples()
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], INSTALL_TIMEOUT_S)
    python = venv / "bin" / "python"
    # pip's cache is left on: CI's nox install has just downloaded the same JAX wheels.
    run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
         str(dists.wheel)], INSTALL_TIMEOUT_S)

    reader = tmp_path / "reader"
    reader.mkdir()
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(examples.NOT_A_READERS_ENVIRONMENT)
           and name not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["JAX_PLATFORMS"] = "cpu"
    where = run([str(python), "-c", "import tilax; print(tilax.__file__, tilax.__version__)"],
                PAGE_TIMEOUT_S, cwd=reader, env=env).stdout.split()
    assert Path(where[0]).is_relative_to(venv), f"tilax imported from {where[0]}, not the venv"
    assert where[1] == tilax.__version__

    script = reader / "getting_started.py"
    script.write_text(examples.page_script(GETTING_STARTED), encoding="utf-8")
    assert examples.runnable_blocks(GETTING_STARTED), "getting-started.md has no runnable block"
    # -I: the script's folder and PYTHON* variables add nothing to sys.path; only the venv.
    run([str(python), "-I", str(script)], PAGE_TIMEOUT_S, cwd=reader, env=env)
