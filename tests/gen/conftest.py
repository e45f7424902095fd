"""Fixtures for the report-generator tests.

Most tests pin numbers of the four seed files, so they read a session copy of ``data/`` that
holds only those files: results added to ``data/results/`` later (append-only, so there will be
more) cannot change what they check. ``real_data_dir`` is the repository's own ``data/``, for
the test that every stored file, whatever was added, is read.
"""

import json
import shutil

import pytest
from report_fixtures import REPO, SEED_FILES


@pytest.fixture(scope="session")
def real_data_dir():
    return REPO / "data"


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, real_data_dir):
    """A read-only-by-convention copy of data/ with the four seed files only."""
    copy = tmp_path_factory.mktemp("seed-data")
    (copy / "results").mkdir()
    for name in SEED_FILES:
        shutil.copy2(real_data_dir / "results" / name, copy / "results" / name)
    return copy


@pytest.fixture(scope="session")
def stored(data_dir):
    from tilax_report.load import load_results

    return load_results(data_dir)


@pytest.fixture(scope="session")
def table(stored):
    return stored.table


@pytest.fixture(scope="session")
def seed_doc(data_dir):
    """A stored seed file parsed with plain json, independently of the loaders."""

    def read(name: str) -> dict:
        return json.loads((data_dir / "results" / name).read_text())

    return read
