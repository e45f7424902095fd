"""data/README.md lists every stored file of our own runs with its row counts, and those counts
are the ones the site reads from the file (measured / failed / skipped, as ``load`` counts)."""

import re

import pytest
from tilax_report import load
from tilax_report.formats import pytest_benchmark


def _listed_counts(readme: str, name: str) -> dict | None:
    """``{"rows", "measured", "failed", "skipped"}`` from the file's table row, or None when
    the file has no row."""
    row = re.search(r"^\| `results/" + re.escape(name) + r"` \|(?P<rest>.*)$", readme, re.M)
    if row is None:
        return None
    counts = re.search(r"(?P<rows>\d[\d ]*) rows?, (?P<parts>[^.]*)\.", row["rest"])
    if counts is None:
        raise AssertionError(f"data/README.md: the row of {name} gives no 'N rows, ...' count")
    parts = {kind: re.search(rf"(\d+) {kind}", counts["parts"]) for kind in
             ("measured", "failed", "skipped")}
    return {"rows": int(counts["rows"].replace(" ", "")),
            **{kind: int(m.group(1)) if m else 0 for kind, m in parts.items()}}


def test_every_file_of_our_runs_is_listed_with_its_counts(real_data_dir):
    readme = (real_data_dir / "README.md").read_text(encoding="utf-8")
    files = load.load_results(real_data_dir).files
    ours = files[files["source_format"] == pytest_benchmark.NAME]
    assert len(ours) > 0
    wrong = []
    for file in ours.itertuples():
        listed = _listed_counts(readme, file.source_file)
        stored = {"rows": file.stored_rows, "measured": file.measured_rows,
                  "failed": file.failed_rows, "skipped": file.skipped_rows}
        if listed != stored:
            wrong.append(f"{file.source_file}: README says {listed}, the file holds {stored}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("text, want", [
    ("| `results/a.json` | x | `c` | suite (12 s): 5 rows, 4 measured / 1 failed. More. |",
     {"rows": 5, "measured": 4, "failed": 1, "skipped": 0}),
    ("| `results/a.json` | x | `c` | 1 row, 1 failed. |",
     {"rows": 1, "measured": 0, "failed": 1, "skipped": 0}),
    ("| `results/b.json` | x | `c` | 3 rows, 3 measured. |", None),
])
def test_counts_are_read_from_the_files_row(text, want):
    assert _listed_counts(text, "a.json") == want
