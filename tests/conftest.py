"""Settings for the whole test suite: running it over several processes, and fast CPU compiles.

``nox -s tests`` runs pytest-xdist with ``--dist loadgroup``. Tests that share per-process
state are kept on one worker by the folder groups below; every other test goes wherever a
worker is free. (Fixture names here are unique: the test folders share no conftest names.)
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import pytest

TESTS = Path(__file__).resolve().parent
# Folders whose tests run on one worker. tests/site: the session fixtures that build the site
# (one mkdocs build each, ~10 s) serve both the build and the browser tests. tests/bench: its
# conftest keeps the run's budget, ladders and finished rows per process and runs the rows in
# priority order.
FOLDER_GROUPS = {TESTS / "site": "site", TESTS / "bench": "bench"}
XDIST_ENVIRONMENT = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID")

# Every test process gets eight virtual CPU devices before any conftest starts JAX's backend
# (tests/bench's does, to size its runs), so tests/moe's expert-parallel tests run on a mesh in
# this process instead of one child interpreter per check. Single-device code is unaffected: it
# runs on device 0. Only the CPU backend reads this setting.
CPU_DEVICES = 8
try:
    jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
except RuntimeError:  # a backend already started (a plugin imported JAX and used it)
    pass

if "PYTEST_XDIST_WORKER" in os.environ:
    # Workers on a GPU machine share its GPU: none may take most of its memory up front (JAX's
    # default). Set before any test module starts JAX's backend.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@pytest.hookimpl(optionalhook=True)  # plain pytest (a GPU host) may not have xdist
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` that also groups by folder (``FOLDER_GROUPS``).

    Folders, not ``xdist_group`` marks: with pytest 9.2 and xdist 3.8 a mark no longer groups
    anything (pytest-xdist issue 1386), and tests/site is not ours to mark. The scheduler sees
    node ids, so a folder is a node-id prefix relative to the root directory.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    prefixes = {f"{folder.relative_to(config.rootpath).as_posix()}/": group
                for folder, group in FOLDER_GROUPS.items()}

    class FolderGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            for prefix, group in prefixes.items():
                if nodeid.startswith(prefix):
                    return group
            return super()._split_scope(nodeid)

    return FolderGroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)  # before -m deselects them
def pytest_collection_modifyitems(config, items):
    """Stop a nox run that finds a ``codegen`` test outside the folders nox's first run collects
    (``CODEGEN_FOLDERS`` in noxfile.py, passed in TILAX_CODEGEN_FOLDERS): no run would run it."""
    folders = os.environ.get("TILAX_CODEGEN_FOLDERS")
    if not folders:
        return
    roots = [config.rootpath / folder for folder in folders.split(os.pathsep)]
    strays = [item.nodeid for item in items if item.get_closest_marker("codegen")
              and not any(item.path.is_relative_to(root) for root in roots)]
    if strays:
        raise pytest.UsageError(
            f"tests marked codegen outside {folders} (add their folder to CODEGEN_FOLDERS in "
            f"noxfile.py): {strays[:5]}")


@pytest.fixture(autouse=True)
def child_processes_are_not_xdist_workers(monkeypatch):
    """A pytest started by a test (the bench smoke run) is a plain run, not an xdist worker:
    pytest-benchmark reads PYTEST_XDIST_WORKER and would disable itself there too."""
    for name in XDIST_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session", autouse=True)
def cpu_compiles_skip_llvm_optimisation():
    """On a CPU, compile without XLA's LLVM optimisation passes, here and in child processes.

    The CPU tests run tiny shapes (Pallas in interpret mode), so XLA compile time is most of
    their time; these passes make code faster, not different, and skipping them takes a third
    to a half off the MoE, RBF and bench smoke tests. The docs examples run in their own processes
    without this setting, as a reader runs them. GPUs keep their default.
    """
    if jax.default_backend() != "cpu":
        return
    jax.config.update("jax_disable_most_optimizations", True)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
