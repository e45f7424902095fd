"""The labelled table and the run catalogue that every generated page starts from, computed
once per loaded results: each took about a second, and every page needs both."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from . import analysis, runs
from .load import StoredResults


@dataclass(frozen=True)
class Prepared:
    table: pd.DataFrame  # analysis.with_labels(results.table), superseded rows' labels marked
    catalogue: pd.DataFrame  # runs.catalogue(table), newest first
    order: pd.Series  # run -> position in time (0 = oldest; missing when undated)
    dates: pd.Series  # run -> date (text), missing when undated


# The one results object prepared last (held, so that its id is not reused) and its tables.
_last: list[tuple[StoredResults, Prepared]] = []


def prepared(results: StoredResults) -> Prepared:
    """`Prepared` for ``results``; the same object for the same results."""
    if _last and _last[0][0] is results:
        return _last[0][1]
    table = analysis.with_labels(results.table)
    # A superseded peer row is shown, labelled, everywhere (the data layer keeps it out of
    # every ranking, baseline and verdict).
    superseded = table["superseded"].fillna(False).astype(bool)
    table.loc[superseded, "label"] = table.loc[superseded, "label"] + " (superseded)"
    catalogue = runs.catalogue(table)
    made = Prepared(
        table=table, catalogue=catalogue,
        order=pd.Series(catalogue["order"].to_numpy(), index=catalogue["run"]),
        dates=pd.Series(catalogue["date"].to_numpy(), index=catalogue["run"]),
    )
    _last[:] = [(results, made)]
    return made
