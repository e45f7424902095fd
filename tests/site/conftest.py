"""Site builds shared by the site and browser tests: each built once per test session."""

import pytest
from site_build import (
    PYTEST_BENCHMARK_FIXTURE,
    add_ep_run,
    add_skipped_only_run,
    add_slower_newest_run,
    build_site,
    copy_data,
)


def _built(tmp_path_factory, name, data_dir=None):
    site_dir = tmp_path_factory.mktemp(name)
    result = build_site(site_dir, data_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    return site_dir


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """The site built from the stored data/."""
    return _built(tmp_path_factory, "site")


@pytest.fixture(scope="session")
def extra_runs(tmp_path_factory):
    """A temporary copy of data/ plus: the pytest-benchmark fixture (an H200 run), a newer copy
    of the newest stored run with every time 1.3x (a regression), a run on another GPU
    whose RBF rows were all skipped, and a two-GPU expert-parallel run (older than the newest
    stored run). Returns (data dir, copied run, slower run)."""
    data_dir = copy_data(tmp_path_factory.mktemp("data") / "data", PYTEST_BENCHMARK_FIXTURE)
    add_skipped_only_run(data_dir / "results")
    add_ep_run(data_dir / "results")
    before, after = add_slower_newest_run(data_dir / "results")
    return data_dir, before, after


@pytest.fixture(scope="session")
def built_site_with_h200(tmp_path_factory, extra_runs):
    """The site built from the copy of data/ with the extra runs."""
    return _built(tmp_path_factory, "site-h200", extra_runs[0])
