"""Fixtures for the report-generator tests: the stored data, loaded once, read-only."""

import json

import pytest
from report_fixtures import REPO


@pytest.fixture(scope="session")
def data_dir():
    return REPO / "data"


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
