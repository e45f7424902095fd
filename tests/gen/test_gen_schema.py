"""The table schema: the site page documents every column, and the table enforces it."""

import re
from pathlib import Path

import pandas as pd
import pytest
from tilax_report import schema

SCHEMA_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reports" / "schema.md"


def documented_columns() -> dict[str, str]:
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| (\w+) \|", SCHEMA_PAGE.read_text(), re.M)
    return dict(rows)


def test_schema_page_lists_every_column_with_its_dtype():
    assert documented_columns() == {name: dtype for name, (dtype, _) in
                                    schema.COLUMNS.items()}


def test_conform_adds_missing_columns_and_orders_them():
    frame = schema.conform(pd.DataFrame({"tokens": [4096.0], "run": ["r"]}))
    assert list(frame.columns) == schema.COLUMN_NAMES
    assert frame["tokens"].dtype == "Int64" and frame["tokens"].item() == 4096


def test_conform_rejects_unknown_columns_and_bad_values():
    with pytest.raises(ValueError, match="not in the schema"):
        schema.conform(pd.DataFrame({"bogus": [1]}))
    with pytest.raises(ValueError, match="'tokens'"):
        schema.conform(pd.DataFrame({"tokens": [4096.5]}))


def test_empty_table_has_the_schema():
    empty = schema.empty_table()
    assert list(empty.columns) == schema.COLUMN_NAMES and empty.empty
