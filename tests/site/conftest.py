"""Site builds shared by the site and browser tests: each built once per test session."""

import pytest
from site_build import PYTEST_BENCHMARK_FIXTURE, build_site, copy_data


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
def built_site_with_h200(tmp_path_factory):
    """The site built from a temporary copy of data/ plus a pytest-benchmark run (H200)."""
    data_dir = copy_data(tmp_path_factory.mktemp("data") / "data", PYTEST_BENCHMARK_FIXTURE)
    return _built(tmp_path_factory, "site-h200", data_dir)
