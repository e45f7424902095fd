"""What code a result row measured, checkable against git: the git tree ids of ``src/`` and
``tests/bench/`` as they are on disk where the bench runs.

A git tree id is a hash of a folder's contents (every file's bytes, names and modes), the same
id ``git rev-parse <commit>:src`` prints. Computed from the files themselves, it needs no git
history on the GPU host (whose copy of the tree has none, or a stale one), and anyone can
check a stored run with ``git rev-parse <commit>:src``. ``tree_matches_declared`` says whether
the measured trees are those of the declared commit (``TILAX_BENCH_COMMIT``): from this
checkout's git when it knows that commit, else from ``TILAX_BENCH_DECLARED_TREES`` (printed by
``python tests/bench/bench_provenance.py <commit>`` where the history is), else unknown.

Command line::

    python tests/bench/bench_provenance.py            # the trees on disk, as JSON
    python tests/bench/bench_provenance.py COMMIT     # the value for TILAX_BENCH_DECLARED_TREES
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_naming import MEASURED_PATHS, REPO_ROOT

# What git ignores in these folders (.gitignore): build and cache leftovers of a run.
IGNORED_DIRS = {"__pycache__", ".pytest_cache", ".hypothesis", ".benchmarks"}
IGNORED_SUFFIXES = (".pyc", ".pyo")


def _object_id(kind: str, payload: bytes) -> bytes:
    return hashlib.sha1(f"{kind} {len(payload)}\0".encode() + payload).digest()


def tree_id(folder: Path) -> str:
    """The git tree id of ``folder`` as it is on disk (ignored leftovers left out); empty
    folders, which git does not store, are left out too."""
    digest = _tree_digest(folder)
    return (digest or _object_id("tree", b"")).hex()


def _tree_digest(folder: Path) -> bytes | None:
    entries = []
    for path in folder.iterdir():
        if path.is_dir():
            if path.name in IGNORED_DIRS:
                continue
            digest, mode = _tree_digest(path), b"40000"
            sort_name = path.name + "/"  # git orders a folder as if its name ended in "/"
        elif path.is_file() and not path.name.endswith(IGNORED_SUFFIXES):
            digest = _object_id("blob", path.read_bytes())
            mode = b"100755" if os.access(path, os.X_OK) else b"100644"
            sort_name = path.name
        else:
            continue
        if digest is not None:
            entries.append((sort_name.encode(), mode, path.name.encode(), digest))
    if not entries:
        return None
    payload = b"".join(mode + b" " + name + b"\0" + digest
                       for _, mode, name, digest in sorted(entries))
    return _object_id("tree", payload)


def measured_trees(root: Path = REPO_ROOT) -> dict[str, str]:
    """``{path: tree id}`` of ``MEASURED_PATHS`` under ``root``."""
    return {path: tree_id(root / path) for path in MEASURED_PATHS}


def declared_trees(commit: str, root: Path = REPO_ROOT) -> dict[str, str] | None:
    """``{path: tree id}`` of ``MEASURED_PATHS`` at ``commit`` by this checkout's git; ``None``
    where git or the commit is not there."""
    trees = {}
    for path in MEASURED_PATHS:
        try:
            trees[path] = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "--verify", "-q", f"{commit}:{path}"],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    return trees


def provenance(declared_commit: str | None, root: Path = REPO_ROOT) -> dict:
    """The ``tilax_provenance`` entry of a result file's machine_info."""
    trees = measured_trees(root)
    code_hash = hashlib.sha256(json.dumps(trees, sort_keys=True).encode()).hexdigest()
    sha = (declared_commit or "").partition("+")[0]
    declared = None
    if os.environ.get("TILAX_BENCH_DECLARED_TREES"):
        declared = json.loads(os.environ["TILAX_BENCH_DECLARED_TREES"])
    elif sha:
        declared = declared_trees(sha, root)
    return {
        "trees": trees,
        "code_hash": code_hash,
        "declared_commit": declared_commit,
        "tree_matches_declared": None if declared is None else declared == trees,
    }


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(declared_trees(sys.argv[1])))
    else:
        print(json.dumps(measured_trees()))
