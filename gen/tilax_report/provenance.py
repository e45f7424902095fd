"""Which code a stored run measured: the code hash of a tree, and the committed table of the
declared commits of the stored files (data/provenance/declared-commits.json).

The *code hash* of a tree is the SHA-256 of the JSON of the git tree ids of its ``src/`` and
``tests/bench/`` (``{"src": id, "tests/bench": id}``, sorted keys). A git tree id hashes every
file's bytes, name and mode, so two trees with the same hash hold byte-identical code, and anyone
can check it with ``git rev-parse <commit>:src``. The bench harness computes the tree ids from
the files on disk (tests/bench/bench_provenance.py, ``machine_info.tilax_provenance``), and
`code_hash_of_commit` computes the same value from git for a commit.

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
from pathlib import Path

CODE_DIRS = ("src", "tests/bench")
DECLARED_COMMITS = Path("provenance") / "declared-commits.json"  # under data/
PEER_FIXES = Path("provenance") / "peer-fixes.json"  # under data/
REPO_ROOT = Path(__file__).resolve().parents[2]


def code_hash(trees: dict[str, str]) -> str:
    """The code hash of ``{folder: git tree id}`` for the folders of `CODE_DIRS`: SHA-256 of
    their JSON (sorted keys), exactly what the bench harness records from the files on disk
    (tests/bench/bench_provenance.py)."""
    if sorted(trees) != sorted(CODE_DIRS):
        raise ValueError(f"code_hash needs the trees of {CODE_DIRS}, got {sorted(trees)}")
    return hashlib.sha256(json.dumps(trees, sort_keys=True).encode()).hexdigest()


def _git(repo: Path, *args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], input=stdin, capture_output=True,
                          check=True).stdout


def trees_of_commit(repo: Path, commit: str) -> dict[str, str]:
    """``{folder: git tree id}`` of `CODE_DIRS` at ``commit``."""
    return {folder: _git(repo, "rev-parse", f"{commit}:{folder}").decode().strip()
            for folder in CODE_DIRS}


def code_hash_of_commit(repo: Path, commit: str) -> str:
    """The code hash of ``commit``'s ``src/`` and ``tests/bench/``, read from git."""
    return code_hash(trees_of_commit(repo, commit))


def describe_commit(repo: Path, commit: str, fixes: list[dict]) -> dict:
    """The table entry of one declared commit."""
    full = _git(repo, "rev-parse", f"{commit}^{{commit}}").decode().strip()
    trees = trees_of_commit(repo, full)
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
        "code_hash": code_hash(trees),
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
