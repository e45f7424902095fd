"""The one site build that every site and browser test reads: built once per test run, also
when pytest-xdist spreads the tests over several workers (the first worker builds, under a
file lock, and the others read what it wrote).

It is built from a temporary copy of data/ plus: the pytest-benchmark fixture (an H200 run), a
newer copy of the newest stored run with every time 1.3x (a regression), a run on another GPU
whose RBF rows were all skipped, and a two-GPU expert-parallel run (older than the newest
stored run). Every stored file is in it, so what the tests check of the stored results holds
for the site `nox -s docs` builds too.
"""

import fcntl
import json
import shutil

import pytest
from site_build import (
    PYTEST_BENCHMARK_FIXTURE,
    add_ep_run,
    add_skipped_only_run,
    add_slower_newest_run,
    build_site,
    copy_data,
)


def _shared_folder(tmp_path_factory, config):
    """A folder that every worker of this test run sees (the run's own under xdist, whose
    workers carry ``workerinput``)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if hasattr(config, "workerinput") else base


@pytest.fixture(scope="session")
def shared_build(tmp_path_factory, pytestconfig):
    """(site dir, data dir, copied run, slower run), built once per test run."""
    root = _shared_folder(tmp_path_factory, pytestconfig) / "tilax-site-build"
    root.mkdir(exist_ok=True)
    done = root / "build.json"
    with open(root / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            # what another worker's failed attempt left
            shutil.rmtree(root / "data", ignore_errors=True)
            shutil.rmtree(root / "site", ignore_errors=True)
            data_dir = copy_data(root / "data", PYTEST_BENCHMARK_FIXTURE)
            add_skipped_only_run(data_dir / "results")
            add_ep_run(data_dir / "results")
            before, after = add_slower_newest_run(data_dir / "results")
            result = build_site(root / "site", data_dir)
            assert result.returncode == 0, result.stdout + result.stderr
            done.write_text(json.dumps({"before": before, "after": after}))
    runs = json.loads(done.read_text())
    return root / "site", root / "data", runs["before"], runs["after"]


@pytest.fixture(scope="session")
def built_site(shared_build):
    """The built site (stored data plus the extra runs)."""
    return shared_build[0]


@pytest.fixture(scope="session")
def extra_runs(shared_build):
    """(data dir, copied run, slower run) of the build."""
    return shared_build[1:]
