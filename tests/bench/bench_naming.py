"""Names of benchmark result files: ``<gpu>-<yyyymmdd>-<shortcommit>[-<tag>].json``.

Shared by ``nox -s bench`` and the plain ``python -m pytest`` route so both name files the same
way. Imports no JAX: the GPU name comes from ``nvidia-smi`` (or ``TILAX_BENCH_GPU``), so naming
a file does not initialise a GPU.

Command line (prints the path, or with ``--commit`` the commit a run is filed under, for
``TILAX_BENCH_COMMIT`` on a host whose copy of the tree has no git history)::

    python tests/bench/bench_naming.py --dir "$OUT" [--tag moe]
    python tests/bench/bench_naming.py --commit
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "amd", "radeon", "instinct"}
_SERIES_WORDS = {"rtx", "gtx", "quadro", "titan"}


def gpu_slug(device_name: str | None) -> str:
    """Short lowercase name of a device: "NVIDIA H200" -> "h200", "NVIDIA GeForce RTX 3090"
    -> "rtx3090", "NVIDIA H100 80GB HBM3" -> "h100"; ``None`` or empty -> "cpu"."""
    if not device_name:
        return "cpu"
    tokens = [t for t in re.split(r"[\s_\-]+", device_name.lower()) if t]
    tokens = [t for t in tokens if t not in _VENDOR_WORDS]
    if not tokens:
        return "gpu"
    model = tokens[0]
    if model in _SERIES_WORDS and len(tokens) > 1:
        model += tokens[1]
    return re.sub(r"[^a-z0-9]", "", model) or "gpu"


def nvidia_smi_gpu_name() -> str | None:
    """Name of GPU 0 from ``nvidia-smi``, or ``None`` where there is none."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in out.splitlines() if line.strip()]
    return names[0] if names else None


# What a benchmark measures: the package and the bench code. A commit that changes neither
# (docs, site, stored data) measures the same thing, so results keep the commit of these paths
# and the files of one code state, made in several sessions, form one run.
MEASURED_PATHS = ("src", "tests/bench")


FULL_SHA = re.compile(r"[0-9a-f]{40}")


def short_form(commit: str) -> str:
    """A full sha (``git rev-parse HEAD``, "+dirty" allowed) as git's 7-character short sha,
    so that files named from it join the run of files named from ``--commit``; anything else
    as given."""
    sha, plus, rest = commit.partition("+")
    return sha[:7] + plus + rest if FULL_SHA.fullmatch(sha) else commit


def declared_commit_info(commit_info: dict, declared: str | None) -> dict:
    """pytest-benchmark's ``commit_info`` for a run whose tree's commit ``TILAX_BENCH_COMMIT``
    declares: that commit as ``id`` (with ``dirty`` from a "+dirty" suffix and ``source``
    naming the variable), the checkout's own view kept as ``host_git``. pytest-benchmark asks
    the git history of the folder it runs in, which on a host that is handed a copy of the
    tree is absent or stale (the GPU host's named an earlier session's commit, "dirty").
    Unchanged without a declaration, or where the checkout agrees with it."""
    if not declared:
        return commit_info
    sha, _, suffix = declared.partition("+")
    host_id = str(commit_info.get("id") or "")
    if sha and host_id.startswith(sha) and bool(commit_info.get("dirty")) == (suffix == "dirty"):
        return commit_info
    return {"id": declared, "dirty": suffix == "dirty", "source": "TILAX_BENCH_COMMIT",
            "host_git": commit_info}


def short_commit(repo: Path = REPO_ROOT) -> str:
    """``TILAX_BENCH_COMMIT`` if set (for copies of the tree without .git; a full sha is
    shortened), else the short sha of the last commit that changed ``MEASURED_PATHS``, with
    "+dirty" when tracked files there have uncommitted changes, else "nogit"."""
    override = os.environ.get("TILAX_BENCH_COMMIT")
    if override:
        return short_form(override)
    try:
        sha = subprocess.run(
            ["git", "-C", str(repo), "log", "-1", "--format=%h", "--", *MEASURED_PATHS],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no", "--",
             *MEASURED_PATHS],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "nogit"
    return f"{sha}+dirty" if dirty else (sha or "nogit")


def result_path(directory: str | Path, tag: str | None = None, gpu: str | None = None,
                date: datetime.date | None = None, commit: str | None = None) -> Path:
    """A free path ``<dir>/<gpu>-<yyyymmdd>-<commit>[-<tag>].json``; "-2", "-3", ... are
    appended rather than overwrite a stored file."""
    gpu = gpu or os.environ.get("TILAX_BENCH_GPU") or nvidia_smi_gpu_name()
    date = date or datetime.date.today()
    commit = (commit or short_commit()).replace("+", "-")
    stem = f"{gpu_slug(gpu)}-{date:%Y%m%d}-{commit}"
    if tag:
        stem += "-" + re.sub(r"[^A-Za-z0-9_.]+", "-", tag).strip("-")
    directory = Path(directory)
    path = directory / f"{stem}.json"
    n = 2
    while path.exists():
        path = directory / f"{stem}-{n}.json"
        n += 1
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=str(REPO_ROOT / "data" / "results"))
    parser.add_argument("--tag", default=None, help="suffix, e.g. the suites run")
    parser.add_argument("--commit", action="store_true",
                        help="print the commit results are filed under and exit")
    args = parser.parse_args()
    print(short_commit() if args.commit else result_path(args.dir, args.tag))


if __name__ == "__main__":
    main()
