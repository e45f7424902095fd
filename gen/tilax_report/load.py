"""Find the stored result files, detect each one's format, and read them into the tidy table.

Format detection is explicit: each loader module has a ``matches(doc)`` test on the document's
top-level shape, and exactly one must match. A file that is not UTF-8 JSON, matches no format or
more than one, or has a row its loader cannot read raises `UnreadableResultFile` naming the file
and the reason; the site build turns that into a failed build.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from . import history, provenance, repeats, schema
from .formats import (
    h100_decoder_seed,
    moe_layer_seed,
    nn_suites_seed,
    pytest_benchmark,
    rbf_seed,
)
from .formats._common import FormatError

DATA_DIR_ENV = "TILAX_DATA_DIR"
REPO_ROOT = Path(__file__).resolve().parents[2]
FORMATS = (moe_layer_seed, nn_suites_seed, h100_decoder_seed, rbf_seed, pytest_benchmark)


class UnreadableResultFile(Exception):
    """A stored result file cannot be read; ``str()`` names the file and the reason."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"cannot read stored result file {path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class StoredResults:
    """Everything the report pages need: the tidy table (one row per case and run), the
    stored rows it was made from (one per file and row) and the list of stored files."""

    data_dir: Path
    table: pd.DataFrame  # schema.COLUMNS, one row per run and case (repeats.collapse)
    files: pd.DataFrame  # one row per file: see `_describe_file`
    listed_runs: dict[str, list[str]]  # file -> runs its config lists (MoE seed only)
    rows: pd.DataFrame  # schema.COLUMNS, every stored row as read (the raw-data page)


def data_dir() -> Path:
    """``$TILAX_DATA_DIR`` when set (tests point it at a temporary copy), else the repo's data/."""
    override = os.environ.get(DATA_DIR_ENV)
    return Path(override).resolve() if override else REPO_ROOT / "data"


def result_files(directory: Path) -> list[Path]:
    """Every stored file in ``directory/results`` (hidden files aside), sorted by name."""
    results = directory / "results"
    if not results.is_dir():
        raise UnreadableResultFile(results, "the results folder does not exist")
    files = sorted(p for p in results.iterdir() if not p.name.startswith("."))
    if not files:
        raise UnreadableResultFile(results, "the results folder holds no stored files")
    for path in files:
        if not path.is_file():
            raise UnreadableResultFile(path, "not a regular file")
    return files


def detect_format(doc: object) -> str:
    """The name of the one format whose ``matches`` accepts ``doc``; FormatError otherwise."""
    if not isinstance(doc, dict):
        raise FormatError(f"unknown format: the top level is a JSON {type(doc).__name__}, "
                          "every known format is a JSON object")
    found = [fmt.NAME for fmt in FORMATS if fmt.matches(doc)]
    if not found:
        keys = ", ".join(sorted(doc)[:12]) or "none"
        known = ", ".join(fmt.NAME for fmt in FORMATS)
        raise FormatError(f"unknown format: top-level keys ({keys}) match none of {known}")
    if len(found) > 1:
        raise FormatError(f"ambiguous format: matches {', '.join(found)}")
    return found[0]


def read_result_file(path: Path) -> tuple[str, dict, pd.DataFrame]:
    """Parse one stored file: its format name, the parsed document and its tidy rows."""
    name, doc, frame = _parse_result_file(path)
    return name, doc, _conformed(path, frame)


def _conformed(path: Path, frame: pd.DataFrame) -> pd.DataFrame:
    try:
        return schema.conform(frame)
    except ValueError as exc:
        raise UnreadableResultFile(path, str(exc)) from None


def _parse_result_file(path: Path) -> tuple[str, dict, pd.DataFrame]:
    """`read_result_file` without the schema's dtypes: the loader's rows as parsed."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableResultFile(
            path, f"not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UnreadableResultFile(
            path, f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    try:
        name = detect_format(doc)
        rows = {fmt.NAME: fmt for fmt in FORMATS}[name].load(doc, path.stem)
        frame = pd.DataFrame.from_records(rows) if rows else pd.DataFrame()
        frame["source_file"] = path.name
        frame["source_format"] = name
        schema.check_columns(frame)
    except (FormatError, ValueError, KeyError, TypeError) as exc:
        raise UnreadableResultFile(path, str(exc)) from None
    return name, doc, frame


def load_results(directory: Path | None = None) -> StoredResults:
    """Read every stored file under ``directory`` (default: `data_dir()`)."""
    directory = (directory or data_dir()).resolve()
    tables = [directory / provenance.DECLARED_COMMITS, directory / provenance.PEER_FIXES]
    key = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size)
                for p in [*result_files(directory), *(t for t in tables if t.exists())])
    cached = _CACHE.get(directory)
    if cached and cached[0] == key:
        return cached[1]
    paths = result_files(directory)
    parsed = [_parse_result_file(path) for path in paths]
    listed = {path.name: moe_layer_seed.listed_runs(doc)
              for path, (name, doc, _) in zip(paths, parsed, strict=True)
              if name == moe_layer_seed.NAME}
    rows = _conform_all(paths, [frame for _, _, frame in parsed])
    by_file = dict(list(rows.groupby("source_file", sort=False)))  # dict() of a groupby fails
    files = [_describe_file(path, name, doc, by_file.get(path.name, rows.iloc[:0]))
             for path, (name, doc, _) in zip(paths, parsed, strict=True)]
    rows = assign_runs(rows)
    rows = with_provenance(rows, provenance.read_json(directory / provenance.DECLARED_COMMITS,
                                                      {}),
                           provenance.read_json(directory / provenance.PEER_FIXES, []))
    rows = repeats.single_rows(rows.assign(spread_stored=spread_stored(rows)))
    table = history.with_run_spread(repeats.collapse(rows), rows)
    results = StoredResults(directory, table, pd.DataFrame(files), listed, rows)
    _CACHE[directory] = (key, results)
    return results


_CACHE: dict[Path, tuple[tuple, StoredResults]] = {}


def _conform_all(paths: list[Path], frames: list[pd.DataFrame]) -> pd.DataFrame:
    """The files' rows as one table of the schema's dtypes. Cast once, not per file (per file
    took 1.7 of the 3.8 s that loading data/ took); a value that does not fit is then looked
    for file by file, so that the error names its file."""
    if not frames:
        return schema.empty_table()
    try:
        return schema.conform(pd.concat(frames, ignore_index=True))
    except ValueError:
        for path, frame in zip(paths, frames, strict=True):
            _conformed(path, frame)
        raise


def assign_runs(table: pd.DataFrame) -> pd.DataFrame:
    """Our own runs: the files of one commit on one GPU are one run (one file per device call),
    named ``<gpu>-<yyyymmdd>-<commit>`` after the GPU, the first file's date and the commit.
    A file without a commit stays a run of its own (its file name). Seed files keep their own
    run ids."""
    ours = ((table["source_format"] == pytest_benchmark.NAME) & table["commit"].notna()
            & table["device"].notna())
    if not ours.any():
        return table
    table = table.copy()
    first_date = table[ours].groupby(["device", "commit"])["date"].transform("min")
    stamp = first_date.fillna("").str.replace("-", "")
    table.loc[ours, "run"] = [
        "-".join(part for part in (gpu_slug(device), day, commit) if part)
        for device, day, commit in zip(table.loc[ours, "device"], stamp,
                                       table.loc[ours, "commit"], strict=True)
    ]
    return table


def with_provenance(table: pd.DataFrame, declared: dict[str, dict],
                    fixes: list[dict]) -> pd.DataFrame:
    """Code hashes of rows whose file stored none, from the committed table of declared
    commits (source ``declared``), and the ``superseded`` label of peer rows measured at a
    declared commit that does not contain the fix of that peer's glue (`provenance`)."""
    entry = table["commit"].map(lambda c: declared.get(c) if isinstance(c, str) else None)
    known = entry.notna() & table["code_hash"].isna()
    table = table.copy()
    table.loc[known, "code_hash"] = entry[known].map(lambda e: e["code_hash"])
    table.loc[known, "code_hash_source"] = "declared"
    superseded = pd.Series(False, index=table.index)
    superseded_by = pd.Series(None, index=table.index, dtype="object")
    for fix in fixes:
        lacks = entry.map(lambda e, f=fix["fixed_in"]: isinstance(e, dict)
                          and f not in e["has_peer_fixes"])
        hit = lacks & (table["impl"] == fix["impl"]) & ~superseded
        superseded |= hit
        superseded_by[hit] = fix["fixed_in"]
    table["superseded"] = superseded.astype("boolean")
    table["superseded_by"] = superseded_by
    return schema.conform(table)


def spread_stored(table: pd.DataFrame) -> pd.Series:
    """Timed rows with something to judge a difference by: the time of at least two rounds,
    or quartiles of at least two rounds (a single sample's quartiles are its one time)."""
    rounds = table["round_ms"].map(lambda r: len(r) if isinstance(r, tuple) else 0)
    quartiles = table["q1_ms"].notna() & table["q3_ms"].notna() & (
        table["rounds"].fillna(2) >= 2)
    timed = (table["status"] == "measured") & table["median_ms"].notna()
    return (timed & ((rounds >= 2) | quartiles)).astype("boolean")


def gpu_slug(device_name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA GeForce RTX 3090' -> 'rtx3090': the GPU part of the
    result file names (tests/bench/bench_naming.py names files the same way)."""
    vendor = {"nvidia", "geforce", "tesla", "amd", "radeon", "instinct"}
    tokens = [t for t in re.split(r"[\s_\-]+", device_name.lower()) if t and t not in vendor]
    if not tokens:
        return "gpu"
    model = tokens[0]
    if model in {"rtx", "gtx", "quadro", "titan"} and len(tokens) > 1:
        model += tokens[1]
    return re.sub(r"[^a-z0-9]", "", model) or "gpu"


def _describe_file(path: Path, fmt: str, doc: dict, frame: pd.DataFrame) -> dict:
    stored_rows = doc.get("benchmarks", doc.get("results", []))
    # Counted per stored row (the H100 file stores two ops in one row).
    per_row = frame.drop_duplicates("source_row")["status"].value_counts()
    return {
        "source_file": path.name,
        "source_format": fmt,
        "bytes": path.stat().st_size,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "stored_rows": len(stored_rows),
        "table_rows": len(frame),
        "measured_rows": int(per_row.get("measured", 0)),
        "failed_rows": int(per_row.get("failed", 0)),
        "skipped_rows": int(per_row.get("skipped", 0)),
        "devices": ", ".join(sorted(frame["device"].dropna().unique())),
    }
