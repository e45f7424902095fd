"""Which code a stored run measured: the code hash of a tree, and the committed table of the
declared commits of the stored files (data/provenance/declared-commits.json).

The *code hash* of a tree is the SHA-256 over every file under ``src/`` and ``tests/bench/``
(``__pycache__`` folders and ``.pyc`` files aside), taken in the order of their paths relative to
the repository root (POSIX, byte order), each file contributing ``path NUL sha256(content) LF``.
Two trees with the same hash hold byte-identical ``src/`` and ``tests/bench/``; the bench
harness records it at bench time (``machine_info.tilax_provenance``), and `code_hash_of_commit`
computes the same value from git for a commit.

Stored files from before the harness recorded it carry only a *declared* commit (the label the
run was filed under). This module, run as a script, adds to the committed table every declared
commit of a stored file that is not in it yet, with that commit's code hash, its ``src`` and
``tests/bench`` git tree ids, its date and the peer fixes (data/provenance/peer-fixes.json) it
contains. The table is append-only: an entry once written is never changed, and ``--check``
(run by tests/gen/test_gen_provenance.py) fails when a declared commit is missing or an entry no
longer matches git. The site reads the table and needs no git::

    PYTHONPATH=gen python -m tilax_report.provenance          # append what is missing
    PYTHONPATH=gen python -m tilax_report.provenance --check  # exit 1 if not up to date
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

CODE_DIRS = ("src", "tests/bench")
DECLARED_COMMITS = Path("provenance") / "declared-commits.json"  # under data/
PEER_FIXES = Path("provenance") / "peer-fixes.json"  # under data/
REPO_ROOT = Path(__file__).resolve().parents[2]


def code_hash(files: Iterable[tuple[str, bytes]]) -> str:
    """The code hash of ``(path relative to the repository root, content)`` pairs (the files
    under `CODE_DIRS`; any order)."""
    digest = hashlib.sha256()
    for path, content in sorted(files, key=lambda item: item[0].encode()):
        digest.update(path.encode() + b"\0" + hashlib.sha256(content).hexdigest().encode()
                      + b"\n")
    return digest.hexdigest()


def _ignored(parts: tuple[str, ...]) -> bool:
    return "__pycache__" in parts or parts[-1].endswith(".pyc")


def code_hash_of_tree(root: Path) -> str:
    """The code hash of a working tree (what the bench harness records)."""
    files = []
    for folder in CODE_DIRS:
        for path in sorted((root / folder).rglob("*")):
            relative = path.relative_to(root)
            if path.is_file() and not _ignored(relative.parts):
                files.append((relative.as_posix(), path.read_bytes()))
    return code_hash(files)


def _git(repo: Path, *args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], input=stdin, capture_output=True,
                          check=True).stdout


def code_hash_of_commit(repo: Path, commit: str) -> str:
    """The code hash of ``commit``'s ``src/`` and ``tests/bench/``, read from git."""
    listing = _git(repo, "ls-tree", "-r", "-z", commit, "--", *CODE_DIRS).split(b"\0")
    entries = []
    for line in filter(None, listing):
        meta, path = line.split(b"\t", 1)
        _mode, kind, blob = meta.split()
        if kind == b"blob" and not _ignored(tuple(path.decode().split("/"))):
            entries.append((path.decode(), blob.decode()))
    batch = _git(repo, "cat-file", "--batch",
                 stdin="".join(f"{blob}\n" for _, blob in entries).encode())
    files, offset = [], 0
    for path, _blob in entries:
        header_end = batch.index(b"\n", offset)
        size = int(batch[offset:header_end].split()[2])
        start = header_end + 1
        files.append((path, batch[start:start + size]))
        offset = start + size + 1
    return code_hash(files)


def describe_commit(repo: Path, commit: str, fixes: list[dict]) -> dict:
    """The table entry of one declared commit."""
    full = _git(repo, "rev-parse", f"{commit}^{{commit}}").decode().strip()
    trees = {folder: _git(repo, "rev-parse", f"{full}:{folder}").decode().strip()
             for folder in CODE_DIRS}
    has_fix = []
    for fix in fixes:
        done = subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor",
                               fix["fixed_in"], full], capture_output=True)
        if done.returncode == 0:
            has_fix.append(fix["fixed_in"])
    return {
        "commit": full,
        "date": _git(repo, "show", "-s", "--format=%cI", full).decode().strip(),
        "src_tree": trees["src"],
        "bench_tree": trees["tests/bench"],
        "code_hash": code_hash_of_commit(repo, full),
        "has_peer_fixes": has_fix,
    }


def read_json(path: Path, empty):
    return json.loads(path.read_text()) if path.exists() else empty


def declared_commits_of_stored_files(data: Path) -> set[str]:
    """The 7-character declared commit of every stored pytest-benchmark file (as the loader
    reads it: ``machine_info.commit``, else ``commit_info.id``), and ``declared_commit`` of
    ``machine_info.tilax_provenance`` where a file records it."""
    commits = set()
    for path in sorted((data / "results").glob("*.json")):
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("machine_info"), dict):
            continue
        machine = doc["machine_info"]
        commit = str(machine.get("commit") or "") or str(
            (doc.get("commit_info") or {}).get("id") or "")
        if commit and commit != "unknown":
            commits.add(commit[:7])
        declared = (machine.get("tilax_provenance") or {}).get("declared_commit")
        if declared:
            commits.add(str(declared)[:7])
    return commits


def update(repo: Path, data: Path, check: bool) -> list[str]:
    """Append the missing declared commits (or, with ``check``, only report them and any entry
    that no longer matches git). Returns the problems found (empty: up to date)."""
    table_path = data / DECLARED_COMMITS
    table = read_json(table_path, {})
    fixes = read_json(data / PEER_FIXES, [])
    problems = []
    for commit in sorted(declared_commits_of_stored_files(data)):
        if commit in table:
            if check and describe_commit(repo, commit, fixes) != table[commit]:
                problems.append(f"{commit}: the stored entry no longer matches git")
            continue
        if check:
            problems.append(f"{commit}: declared by a stored file, missing from {table_path}")
        else:
            table[commit] = describe_commit(repo, commit, fixes)
    if not check:
        table_path.parent.mkdir(parents=True, exist_ok=True)
        table_path.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 when the table is not up to date")
    parser.add_argument("--data", type=Path, default=REPO_ROOT / "data")
    args = parser.parse_args(argv)
    problems = update(REPO_ROOT, args.data, args.check)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
