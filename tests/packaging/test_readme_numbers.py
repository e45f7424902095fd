"""Every number in the README's headline section comes from a stored result file.

The section is generated (gen/tilax_report/front.py, which also writes the home page's
headline): it must equal a fresh rendering from data/results/, so README and site say the same
(`PYTHONPATH=gen python -m tilax_report.front` refreshes it). Independently of that code, the
MoE table's cells are checked against the stored files here. The table's rows name a setting
(experts, top-k, widths, tokens) and its columns an implementation: each cell must print the
median and quartiles of that stored row, rounded as printed, and each row's cells must come
from one of the files the section links to (ratios are only fair within one file: one
process, one GPU). Numbers in the text around the table must be table values, token counts,
or ratios of two medians of one table row.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
SECTION = "## Headline numbers"
# The RBF part of the section starts here; the MoE checks below read what comes before.
RBF_PART = "**RBF kernel sums"
# The README's first screen: what tilax is, where the site is, the two set-up commands and the
# headline table all start within this many lines.
FIRST_SCREEN_LINES = 40

# What each column header means, as stored in extra_info: (impl, dispatch); dispatch None for
# the peers, which have none. "tilax default": dispatch="sorted" (MoEConfig's default) on the
# backend impl="auto" runs for the row's layer on the file's GPU (tilax.moe.rules:
# "mosaic" where a rule holds, else Triton, stored as "pallas"). "tilax fastest": the fastest
# Pallas impl/dispatch, which the cell names.
PALLAS_IMPLS = ("pallas", "triton", "mosaic")
DEFAULT_COLUMN = "tilax default"
COLUMN_ROWS = {
    "PyTorch compiled": ("torch_grouped_mm_compile", None),
    "tokamax": ("tokamax", None),
    "`lax.ragged_dot`": ("ragged_dot", "sorted"),
}
FASTEST_COLUMN = "tilax fastest"

ROW_LABEL = re.compile(
    r"E(?P<experts>\d+) top-(?P<top_k>\d+), d(?P<d_model>\d+) h(?P<d_hidden>\d+)"
    r"(?:, shared (?P<shared_hidden>\d+))?, (?P<tokens>\d{1,3}(?:,\d{3})*) tokens")
MEASURED_CELL = re.compile(
    r"(?P<median>\d+\.\d+) \((?P<q1>\d+\.\d+)–(?P<q3>\d+\.\d+)\)"
    r"(?: (?P<impl>\w+)/(?P<dispatch>\w+))?")
NOT_RUN_CELL = re.compile(r"not run \(out of memory at (?P<tokens>\d{1,3}(?:,\d{3})*) tokens\)")
# A failed row: the cell's reason and what the stored error must say.
FAILED_CELLS = {"failed (no XLA autotuner config)": "failed to get configs",
                "failed (out of memory)": "out of memory"}
# A number standing alone in the text: not part of a name such as H200, bf16 or 4cab2a4.
NUMBER = re.compile(r"(?<![\w.\-/])(?P<number>\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(?P<times>×)?"
                    r"(?!\w)")


@dataclass(frozen=True)
class StoredFile:
    name: str
    machine: dict
    rows: list[dict]  # the benchmarks: extra_info and stats


@dataclass
class TableRow:
    label: str
    setting: dict[str, int]
    cells: dict[str, str]  # column header -> cell text


def full_section_text() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:] if end < 0 else text[start:end]


def section_text() -> str:
    """The MoE part of the section (heading, text, table, notes)."""
    return full_section_text().partition(RBF_PART)[0]


def unlinked(text: str) -> str:
    """Markdown links replaced by their text."""
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)


def table_lines(section: str) -> list[str]:
    return [line for line in section.splitlines() if line.startswith("|")]


def split_cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def headline_table(section: str) -> tuple[list[str], list[TableRow]]:
    header, rule, *body = table_lines(section)
    headers = split_cells(header)
    rows = []
    for line in body:
        label, *cells = split_cells(line)
        label = unlinked(label)
        match = ROW_LABEL.fullmatch(label)
        assert match, f"README table row {label!r} does not name a setting ({ROW_LABEL.pattern})"
        setting = {key: int((value or "0").replace(",", ""))
                   for key, value in match.groupdict().items()}
        rows.append(TableRow(label, setting, dict(zip(headers[1:], cells, strict=True))))
    return headers, rows


def linked_files(section: str) -> list[StoredFile]:
    files = []
    for link in dict.fromkeys(re.findall(r"\]\((data/results/[^)]+\.json)\)", section)):
        path = REPO / link
        assert path.is_file(), f"README links to {link}, which is not a stored file"
        doc = json.loads(path.read_text(encoding="utf-8"))
        files.append(StoredFile(path.name, doc["machine_info"], doc["benchmarks"]))
    assert files, "the headline section links to no stored result file"
    return files


def matches_setting(extra: dict, setting: dict[str, int]) -> bool:
    return (extra.get("op") == "train_step" and extra.get("dtype") == "bfloat16"
            and extra.get("routing") == "dropless" and not extra.get("skew")
            and all((extra.get(key) or 0) == value for key, value in setting.items()))


def rows_of(file: StoredFile, setting: dict[str, int]) -> list[dict]:
    return [row for row in file.rows if matches_setting(row["extra_info"], setting)]


def file_of(row: TableRow, files: list[StoredFile]) -> StoredFile:
    holding = [f for f in files if rows_of(f, row.setting)]
    assert len(holding) == 1, (f"README row {row.label!r}: the linked files holding its setting "
                               f"are {[f.name for f in holding]}, not exactly one")
    return holding[0]


def measured(row: dict) -> bool:
    return not row["extra_info"].get("error") and bool(row.get("stats"))


def stored_row(file: StoredFile, setting: dict, impl: str, dispatch: str | None) -> dict:
    found = [r for r in rows_of(file, setting)
             if r["extra_info"]["impl"] == impl and r["extra_info"].get("dispatch") == dispatch]
    assert len(found) == 1, f"{file.name}: {len(found)} rows of {impl}/{dispatch} at {setting}"
    return found[0]


def fastest_pallas_row(file: StoredFile, setting: dict) -> dict:
    pallas = [r for r in rows_of(file, setting)
              if r["extra_info"]["impl"] in PALLAS_IMPLS and measured(r)]
    return min(pallas, key=lambda r: r["stats"]["median"])


def auto_rule(gpu: str | None, setting: dict):
    """The package's rule for ``impl="auto"``, ``dispatch="sorted"``, bf16 at ``setting`` on
    ``gpu`` (None where no rule holds: Triton)."""
    from tilax.moe import rules

    return rules.rule_for(gpu, "bfloat16", "sorted", setting["experts"], setting["top_k"])


def default_row(file: StoredFile, setting: dict) -> dict:
    """The stored row of what ``impl="auto"``, ``dispatch="sorted"`` runs for ``setting``:
    the rule's backend, else Triton (stored as "triton", or "pallas" in older files)."""
    rule = auto_rule(file.machine.get("gpu"), setting)
    if rule is not None:
        return stored_row(file, setting, rule.backend, "sorted")
    impls = {r["extra_info"]["impl"] for r in rows_of(file, setting)}
    return stored_row(file, setting, "triton" if "triton" in impls else "pallas", "sorted")


def column_row(header: str, file: StoredFile, row: TableRow, cell: str) -> dict:
    """The stored row a cell shows."""
    if header == FASTEST_COLUMN:
        return fastest_pallas_row(file, row.setting)
    if header == DEFAULT_COLUMN:
        return default_row(file, row.setting)
    for prefix, (impl, dispatch) in COLUMN_ROWS.items():
        if header.startswith(prefix):
            return stored_row(file, row.setting, impl, dispatch)
    raise AssertionError(f"README column {header!r} has no meaning in this test (COLUMN_ROWS)")


def as_printed(seconds: float, printed: str) -> str:
    """``seconds`` in milliseconds, with as many decimals as ``printed`` has."""
    decimals = len(printed.partition(".")[2])
    return f"{seconds * 1e3:.{decimals}f}"


def cell_medians(row: TableRow, file: StoredFile) -> dict[str, float]:
    """The stored median (s) of each measured cell of a table row, by column."""
    return {header: column_row(header, file, row, cell)["stats"]["median"]
            for header, cell in row.cells.items() if MEASURED_CELL.fullmatch(cell)}


def test_first_screen_says_what_where_how_and_the_numbers() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN_LINES]
    screen = "\n".join(lines)
    assert lines[0] == "# tilax" and "tilax is a JAX package of Pallas GPU kernels" in screen
    assert "nox -s docs" in screen and "nox -s tests" in screen
    assert "https://OWNER.github.io/tilax/" in screen and "OWNER is a placeholder" in screen
    assert SECTION in screen and any(line.startswith("| ") for line in lines)


def test_every_cell_is_the_stored_median_and_quartiles() -> None:
    section = section_text()
    headers, rows = headline_table(section)
    files = linked_files(section)
    for row in rows:
        file = file_of(row, files)
        for header, cell in row.cells.items():
            where = f"README {row.label!r} / {header!r} ({file.name})"
            stored = column_row(header, file, row, cell)
            not_run = NOT_RUN_CELL.fullmatch(cell)
            if not_run:
                error = stored["extra_info"].get("error", "")
                assert error.startswith("skipped"), f"{where}: says not run, stored: {error!r}"
                smaller = dict(row.setting, tokens=int(not_run["tokens"].replace(",", "")))
                info = stored["extra_info"]
                failed = stored_row(file, smaller, info["impl"], info.get("dispatch"))
                assert "out of memory" in failed["extra_info"].get("error", "").lower(), (
                    f"{where}: the row at {not_run['tokens']} tokens did not run out of memory")
                continue
            if cell in FAILED_CELLS:
                error = stored["extra_info"].get("error", "")
                assert error and not error.startswith("skipped"), f"{where}: stored {error!r}"
                assert FAILED_CELLS[cell] in error.lower(), f"{where}: stored {error!r}"
                continue
            cell_match = MEASURED_CELL.fullmatch(cell)
            assert cell_match, (f"{where}: {cell!r} is not 'median (q1–q3)', 'not run (...)' "
                                f"or one of {sorted(FAILED_CELLS)}")
            assert measured(stored), f"{where}: the stored row failed: {stored['extra_info']}"
            stats = stored["stats"]
            for key in ("median", "q1", "q3"):
                assert cell_match[key] == as_printed(stats[key], cell_match[key]), (
                    f"{where}: {key} printed {cell_match[key]}, stored {stats[key] * 1e3:.4f} ms")
            if header == FASTEST_COLUMN:
                named = (cell_match["impl"], cell_match["dispatch"])
                info = stored["extra_info"]
                assert named == (info["impl"], info["dispatch"]), (
                    f"{where}: names {named}, the fastest stored is {info['impl']}/"
                    f"{info['dispatch']}")


def test_header_states_the_stored_setting() -> None:
    section = section_text()
    headers, rows = headline_table(section)
    files = linked_files(section)
    first = headers[0]
    assert "train step" in first and "bf16" in first  # the rows matches_setting selects
    rounds = int(re.search(r"(\d+) rounds", first)[1])
    tokamax = re.search(r"tokamax (\S+)", " ".join(headers))[1]
    for row in rows:
        file = file_of(row, files)
        assert file.machine.get("tokamax") == tokamax, f"{file.name}: tokamax version"
        for header, cell in row.cells.items():
            if MEASURED_CELL.fullmatch(cell):
                stored = column_row(header, file, row, cell)
                assert stored["stats"]["rounds"] == rounds, f"{row.label} / {header}: rounds"


def test_text_numbers_are_table_values_token_counts_or_ratios() -> None:
    section = section_text()
    headers, rows = headline_table(section)
    files = linked_files(section)
    table = "\n".join(table_lines(section))
    values = set(re.findall(r"\d+\.\d+", table))
    tokens = set(re.findall(r"(\d{1,3}(?:,\d{3})+) tokens", table))
    medians = [cell_medians(row, file_of(row, files)) for row in rows]
    text = "\n".join(line for line in section.splitlines() if not line.startswith("|"))
    text = re.sub(r"\]\([^)]*\)|<[^>]*>", "]", text)  # link targets are not quoted numbers
    text = ROW_LABEL.sub("", text)  # settings named in words, as the table's rows name them
    numbers = list(NUMBER.finditer(text))
    assert numbers, "the headline text quotes no number: this test would check nothing"
    for found in numbers:
        number = found["number"]
        if found["times"]:
            ratios = {f"{a / b:.{len(number.partition('.')[2])}f}"
                      for row in medians for a in row.values() for b in row.values() if a != b}
            assert number in ratios, f"README: {number}× is no ratio of two medians of one row"
        else:
            assert number in values | tokens, (
                f"README: {number} in the text is neither a table value nor a token count")
    named = set(re.findall(r"commit\s+`(\w+)`", text))
    # a file filed under a full sha (TILAX_BENCH_COMMIT=$(git rev-parse HEAD)) is of its short form
    commits = {re.sub(r"^([0-9a-f]{7})[0-9a-f]{33}$", r"\1", str(f.machine.get("commit")))
               for f in files}
    assert named <= commits, (
        f"the text names commits {named}; the linked files are of {commits}")
    for gpu in re.findall(r"NVIDIA \w+", text):
        assert all(f.machine.get("gpu") == gpu for f in files), f"{gpu}: not every file's GPU"


def test_the_claimed_lead_over_pytorch_is_beyond_the_spread() -> None:
    """The text says tilax's default is faster than PyTorch compiled at the first row's
    setting, and the stored quartiles do not overlap."""
    section = section_text()
    assert re.search(r"\d\.\d+× faster than PyTorch compiled", section)
    headers, rows = headline_table(section)
    row = rows[0]
    assert row.setting["experts"] == 8 and row.setting["tokens"] == 131072
    file = file_of(row, linked_files(section))
    tilax = default_row(file, row.setting)["stats"]
    torch = stored_row(file, row.setting, *COLUMN_ROWS["PyTorch compiled"])["stats"]
    assert tilax["q3"] < torch["q1"]


def test_links_lead_to_stored_files_and_generated_reports() -> None:
    section = section_text()
    _, rows = headline_table(section)
    files = linked_files(section)
    used = {file_of(row, files).name for row in rows}
    assert used == {f.name for f in files}, "every linked file holds a row, and no other"
    pages = {m for path in (REPO / "gen" / "tilax_report" / "pages").glob("*.py")
             for m in re.findall(r'^PATH = "(reports/[\w-]+)\.md"', path.read_text(), re.M)}
    reports = re.findall(r"https://OWNER\.github\.io/tilax/latest/(reports/[\w-]+)\.html",
                         full_section_text())
    assert reports and set(reports) <= pages, f"report links {reports}, generated {pages}"


def test_checks_reject_a_wrong_number(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The checks fail on a README whose median is off by one in the last printed digit."""
    text = README.read_text(encoding="utf-8")
    first_median = MEASURED_CELL.search(table_lines(section_text())[2])["median"]
    decimals = len(first_median.partition(".")[2])
    wrong = f"{float(first_median) + 10**-decimals:.{decimals}f}"
    readme = tmp_path / "README.md"
    readme.write_text(text.replace(f"| {first_median} (", f"| {wrong} (", 1), encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "README", readme)
    with pytest.raises(AssertionError, match="median printed"):
        test_every_cell_is_the_stored_median_and_quartiles()


def test_section_is_the_generated_headline() -> None:
    """The README says what the site's home page says: the section is what
    gen/tilax_report/front.py renders from data/results/ now."""
    sys.path.insert(0, str(REPO / "gen"))
    from tilax_report import front
    from tilax_report.load import load_results

    text = README.read_text(encoding="utf-8")
    start, end = front.section_body(text)
    expected = front.readme_section(load_results(REPO / "data"))
    assert text[start:end].strip("\n") == expected.strip("\n"), (
        "README.md's headline differs from the stored results' rendering: run "
        "`PYTHONPATH=gen python -m tilax_report.front` and commit README.md")


def test_generated_default_column_follows_the_rules() -> None:
    """The headline's "tilax default" column (gen/tilax_report/headlines.default_label, which
    cannot import the package) shows the backend the package's rules table picks."""
    sys.path.insert(0, str(REPO / "gen"))
    from tilax_report import headlines

    for gpu in (*headlines.MOSAIC_DEFAULT_GPUS, "NVIDIA GeForce RTX 3090"):
        for experts, top_k in ((8, 2), (64, 8)):
            rule = auto_rule(gpu, {"experts": experts, "top_k": top_k})
            backend = rule.backend if rule else "triton"
            assert headlines.default_label(gpu) == f"{backend}/sorted", (gpu, experts)


# The RBF table's columns and rows, as stored in extra_info (default precision only).
RBF_COLUMNS = {"tilax (pallas)": "pallas", "chunked XLA": "xla", "dense XLA": "dense",
               "dense PyTorch": "torch_dense", "KeOps": "keops"}
RBF_ROWS = {"forward (`fwd`)": "fwd", "forward + backward (`fwd_bwd`)": "fwd_bwd"}
RBF_CASE = re.compile(r"dim (?P<dim>\d+), out (?P<out>\d+), n = m = (?P<n>\d{1,3}(?:,\d{3})*)")


def test_rbf_cells_are_the_stored_medians() -> None:
    """The RBF part's cells print the stored medians and quartiles of its linked file's rows
    at the case it names, and name failures as stored."""
    part = RBF_PART + full_section_text().partition(RBF_PART)[2]
    files = linked_files(part)
    assert len(files) == 1, [f.name for f in files]
    case = {k: int(v.replace(",", "")) for k, v in RBF_CASE.search(part).groupdict().items()}
    header, _, *body = table_lines(part)
    columns = split_cells(header)[1:]
    assert body, "the RBF part has no table rows"
    for line in body:
        label, *cells = split_cells(line)
        for column, cell in zip(columns, cells, strict=True):
            found = [r for r in files[0].rows
                     if r["extra_info"].get("impl") == RBF_COLUMNS[column]
                     and r["extra_info"].get("op") == RBF_ROWS[label]
                     and not r["extra_info"].get("precision")
                     and all(r["extra_info"].get(k) == v for k, v in case.items())]
            assert len(found) == 1, (column, label, len(found))
            if cell.startswith("failed"):
                assert found[0]["extra_info"].get("error"), (column, label)
                continue
            match = MEASURED_CELL.fullmatch(cell)
            assert match and measured(found[0]), (column, label, cell)
            for key in ("median", "q1", "q3"):
                assert match[key] == as_printed(found[0]["stats"][key], match[key]), (
                    column, label, key)
