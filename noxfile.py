"""Sessions: tests, tests_kernels, tests_release, tests_jax011, docs, serve, lint, bench,
wheelhouse, dist, release_docs, release_notes (``nox -l`` lists them)."""

import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import nox

# uv creates and fills an environment in seconds (the tests session on a clean clone: 6 s
# against 38 s with venv and pip, pip's cache warm); plain venv where uv is not installed.
nox.options.default_venv_backend = "uv|venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

PYPROJECT = nox.project.load_toml("pyproject.toml")
# mkdocs-material prints a banner about MkDocs 2 on every build; the site pins mkdocs 1.x.
QUIET_MKDOCS = {"NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
# mkdocs.yml's extra.version.provider: "mike" (the version selector) only where this is set,
# i.e. in the versioned build; a plain build has no versions.json for the selector to read.
VERSION_PROVIDER_VARIABLE = "TILAX_DOCS_VERSION_PROVIDER"
# The single source of the version (hatch reads it too: [tool.hatch.version] in pyproject.toml).
VERSION_FILE = Path("src/tilax/__init__.py")
DOCS_BRANCH = "gh-pages"
LATEST_ALIAS = "latest"


def install_groups(session: nox.Session, *groups: str) -> None:
    """Install the package (editable) plus the named dependency groups of pyproject.toml."""
    requirements = []
    for group in groups:
        requirements += nox.project.dependency_groups(PYPROJECT, group)
    session.install("-e", ".", *requirements)


@nox.session
def tests(session: nox.Session) -> None:
    """Unit tests (CPU, Pallas interpret mode), site build and browser tests.

    Spread over the cores by pytest-xdist; tests/conftest.py keeps tests that share state on
    one worker. Two pytest runs (``run_by_codegen``): the tests marked ``codegen``, then the
    rest with faster-compiling CPU code generation. ``nox -s tests -- -n 0`` runs each in one
    process.
    """
    install_groups(session, "tests", "docs")
    # One worker per core, at most 4: beyond that the site and bench groups, each pinned to one
    # worker, set the wall time. (A third worker on 2 cores: 665 and 700 s against 705, no clear
    # difference.)
    run_by_codegen(session, "not kernels and not release", "--dist", "loadgroup")


@nox.session
def tests_release(session: nox.Session) -> None:
    """The release checks (marked ``release``): the wheel run in a fresh environment and the
    versioned docs build. Kept out of ``nox -s tests`` for its minutes; ``.ci/run`` runs it
    after the tests."""
    install_groups(session, "tests", "docs")
    session.run("pytest", "tests/packaging", "-m", "release", "--durations", "5",
                *session.posargs)


@nox.session
def tests_kernels(session: nox.Session) -> None:
    """The heavy Pallas-interpreter cases (marked ``kernels``) of tests/moe and tests/rbf.

    Kept out of ``nox -s tests`` so that the everyday run stays within minutes; run it on every
    change of ``src/`` (CI does: see docs/contributing.md).
    """
    install_groups(session, "tests")
    run_by_codegen(session, "kernels", folders=("tests/moe", "tests/rbf"))


# XLA's CPU fusion emitters, the default of jax 0.10, take about twice as long as the older
# emitters to compile the tests' many small programs (tests/moe and tests/gp on 2 cores: 120 ->
# 69 s; tests/rbf 58 -> 40 s). What they compute agrees within the tests' tolerances, but not to
# the bit: a tests/rbf check of subnormal weights under jit fails on the broken code only with
# the default emitters, so the checks of extreme scales (marked ``codegen``) keep them. jax 0.11
# has only the fusion emitters, and XLA aborts on a flag it does not know, hence the probe.
OLDER_CPU_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
PROBE_XLA_FLAGS = (  # prints whether XLA starts with the XLA_FLAGS given as its argument
    "import os, subprocess, sys\n"
    "env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=sys.argv[1])\n"
    "child = [sys.executable, '-c', 'import jax; jax.devices()']\n"
    "print(subprocess.run(child, env=env, capture_output=True).returncode == 0)"
)


def older_cpu_emitters(session: nox.Session) -> dict[str, str]:
    """``XLA_FLAGS`` that select XLA's older CPU emitters where the session's jaxlib has them,
    otherwise none."""
    flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), OLDER_CPU_EMITTERS]))
    known = session.run("python", "-c", PROBE_XLA_FLAGS, flags, silent=True)
    return {"XLA_FLAGS": flags} if known and known.strip() == "True" else {}


# One BLAS thread per process: the workers already fill the cores, and OpenBLAS's extra threads
# (jaxlib's LAPACK calls and NumPy use it) spin while they wait, taking CPU from the other
# worker: tests/gp alone needed 36 s of CPU with two threads, 27 s with one, in less time.
ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1"}


# Where the tests marked ``codegen`` live. The first run collects only these folders (collecting
# the whole suite costs each worker 5 s, a tenth of that run); tests/conftest.py stops a run
# that finds a ``codegen`` test elsewhere, which the first run would never collect.
CODEGEN_FOLDERS = ("tests/rbf",)
CODEGEN_FOLDERS_VARIABLE = "TILAX_CODEGEN_FOLDERS"


def run_by_codegen(session: nox.Session, marks: str, *options: str,
                   folders: tuple[str, ...] = ()) -> None:
    """pytest over the cores on the tests ``marks`` selects in ``folders`` (default: all), in
    two runs: those also marked ``codegen`` (from ``CODEGEN_FOLDERS`` unless the session's
    arguments name files or folders) with XLA's default CPU emitters, then the others with the
    older ones, each run printing its 15 slowest tests. A run that selects nothing passes. A
    ``-m`` of the session's arguments replaces the selection: one run, with the default
    emitters."""
    if "-m" in session.posargs:
        runs = [(marks, {}, folders)]  # the arguments' -m, the last one given, wins
    else:
        runs = []
        if any(Path(arg.split("::")[0]).exists() for arg in session.posargs):
            runs.append((f"({marks}) and codegen", {}, folders))  # the arguments' paths
        elif codegen := [f for f in CODEGEN_FOLDERS
                         if not folders or any(f.startswith(g) for g in folders)]:
            runs.append((f"({marks}) and codegen", {}, tuple(codegen)))
        runs.append((f"({marks}) and not codegen", older_cpu_emitters(session), folders))
    with shared_compilation_cache() as env:
        env |= ONE_BLAS_THREAD | {CODEGEN_FOLDERS_VARIABLE: os.pathsep.join(CODEGEN_FOLDERS)}
        for selection, codegen, where in runs:
            session.run(
                "pytest", "-n", "logical", "--maxprocesses", "4", "-m", selection,
                "--durations", "15", *options, *where, *session.posargs, env=env | codegen,
                success_codes=[0, 5],  # 5: nothing selected (e.g. -k naming one folder)
            )


@contextlib.contextmanager
def shared_compilation_cache() -> Iterator[dict[str, str]]:
    """JAX settings that make the test processes share compiled programs through a temporary
    folder, removed afterwards.

    Many tests compile the same program (the same layer, kernel or reference at the same small
    shapes, from a new closure); JAX's persistent cache serves the repeats from disk, in every
    worker and child process of the run. On a 2-core machine a whole run took 705 s against
    747 and 750 s without it (tests/moe 9% less). The folder lives for one session: a run never
    reads another run's programs. The docs examples drop every ``JAX_`` setting, so their
    CPU-time limit still measures a fresh reader.
    """
    with tempfile.TemporaryDirectory(prefix="tilax-tests-jax-cache-") as folder:
        yield {
            "JAX_COMPILATION_CACHE_DIR": folder,
            # Cache every program: the tests' compiles are many and short (the default keeps
            # only those over a second).
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        }


@nox.session(python="3.12")
def tests_jax011(session: nox.Session) -> None:
    """The library's CPU tests (tests/moe, tests/rbf) on jax 0.11.2, the GPU host's JAX.

    PyPI has jax 0.11 for Python 3.12 and newer only, hence a second interpreter. Not part of
    ``nox -s tests`` (CI's Python is 3.11); run it before a GPU call: jax 0.11 changed what
    lowers (a whole-array scatter under ``shard_map`` crashed its partitioner, and Mosaic GPU
    kernels lower only through ``plgpu.kernel``), and here that costs no device time.
    """
    session.install("-e", ".", "jax==0.11.2", "jaxlib==0.11.2", "pytest>=8", "pytest-xdist>=3.5",
                    "hypothesis>=6.100", "scipy>=1.11")
    with shared_compilation_cache() as env:
        session.run("pytest", "tests/moe", "tests/rbf", "-n", "2", *session.posargs, env=env)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the site from the stored results into site/ (open site/index.html).

    The build goes to a temporary folder that replaces site/ only when it succeeds: a failed
    build (e.g. a corrupt stored file, named in the error) keeps the previous site.
    """
    install_groups(session, "docs")
    publish_site(lambda folder: session.run(
        "mkdocs", "build", "--strict", "--site-dir", str(folder), *session.posargs,
        env=QUIET_MKDOCS,
    ), Path("site"))


def publish_site(build: Callable[[Path], object], target: Path) -> None:
    """Run ``build(folder)`` into a fresh folder beside ``target``, then swap it in; if the
    build raises, ``target`` is left as it was and the partial build is removed."""
    target = target.resolve()
    folder = Path(tempfile.mkdtemp(prefix=f".{target.name}-build-", dir=target.parent))
    folder.chmod(0o755)  # mkdtemp makes it private; the site is meant to be read
    try:
        build(folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    old = target.with_name(f".{target.name}-old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    folder.rename(target)
    shutil.rmtree(old, ignore_errors=True)


@nox.session
def serve(session: nox.Session) -> None:
    """Build the site and serve it at http://127.0.0.1:8000, rebuilding on changes."""
    install_groups(session, "docs")
    session.run(
        "mkdocs", "serve", "--dev-addr", "127.0.0.1:8000", *session.posargs, env=QUIET_MKDOCS
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the package, generators, tests and this file."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", "src", "gen", "tests", "noxfile.py", *session.posargs)


def _bench_naming():
    """tests/bench/bench_naming.py, loaded by path: the pytest route uses the same file."""
    path = Path(__file__).parent / "tests" / "bench" / "bench_naming.py"
    spec = importlib.util.spec_from_file_location("bench_naming", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_tag(posargs: list[str]) -> str | None:
    """File-name suffix saying what ran, e.g. "quick" or "moe"; None for a full run of all."""
    suites, mode = [], os.environ.get("TILAX_BENCH_MODE")
    for i, arg in enumerate(posargs):
        if arg == "--bench-quick":
            mode = "quick"
        elif arg == "--bench-smoke":
            mode = "smoke"
        elif arg.startswith("--bench-mode"):
            mode = arg.split("=", 1)[1] if "=" in arg else posargs[i + 1]
        elif arg.startswith("--bench-suite"):
            suites.append(arg.split("=", 1)[1] if "=" in arg else posargs[i + 1])
    if not suites and os.environ.get("TILAX_BENCH_SUITES"):
        suites.append(os.environ["TILAX_BENCH_SUITES"])
    parts = [mode] if mode in ("quick", "smoke") else []
    parts += [s.replace(",", "+") for s in suites if s != "all"]
    return "-".join(parts) or None


@nox.session
def bench(session: nox.Session) -> None:
    """GPU benchmarks into data/results/<gpu>-<yyyymmdd>-<shortcommit>[-<tag>].json.

    Options go to pytest after ``--``: ``--bench-suite moe|rbf|layer|...`` (repeatable),
    ``--bench-quick``, ``--bench-budget SECONDS``; or the environment: TILAX_BENCH_SUITES,
    TILAX_BENCH_MODE, TILAX_BENCH_BUDGET, TILAX_BENCH_OUT (output folder). On an offline GPU
    host with JAX installed: ``nox --no-venv -s bench -- ...`` (no installs), or the plain
    pytest command in tests/bench/conftest.py's docstring, which names files the same way.
    """
    if session.venv_backend != "none":
        session.install("-e", ".[cuda]", *nox.project.dependency_groups(PYPROJECT, "bench"))
    out_dir = Path(os.environ.get("TILAX_BENCH_OUT", "data/results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    output = _bench_naming().result_path(out_dir, _bench_tag(session.posargs))
    # The side file of finished rows stays out of data/: the site reads every file there.
    rows = Path(".benchmarks") / f"{output.stem}.rows.jsonl"
    rows.parent.mkdir(exist_ok=True)
    session.log(f"results: {output} (rows as they finish: {rows})")
    pythonpath = os.pathsep.join(p for p in ("src", os.environ.get("PYTHONPATH")) if p)
    session.run(
        "python", "-m", "pytest", "tests/bench", "-p", "no:cacheprovider", "-q",
        f"--benchmark-json={output}", f"--bench-rows={rows}", *session.posargs,
        env={"PYTHONPATH": pythonpath},
    )


# Wheels the offline GPU host lacks (it has jax 0.11.2, jaxlib, numpy, absl-py, chex, einops,
# jaxtyping, flax, tqdm, protobuf, packaging, torch, triton, pytest, pytest-benchmark, pandas).
# tokamax's Requires-Dist minus those (its xprof is not needed by tokamax.ragged_dot: the bench
# stands in for it); typing-extensions rides along because pydantic needs a newer one than the
# host may have. tokamax 0.0.17 is the first that runs on the host's jax 0.11.2 (0.0.12 fails
# there). pykeops/keopscore are source releases built into wheels. The GP peers
# (tests/bench/bench_gp.py): GPyTorch and linear_operator (their scipy and mpmath are on the
# host, beside jax and torch; scikit-learn is imported only by kernels the bench does not use),
# tinygp and its equinox, whose jaxtyping needs wadler-lindig (jaxtyping pinned with it: the
# host's may be older than equinox's).
WHEELHOUSE_DOWNLOADS = [
    "tokamax==0.0.17", "einshape==1.0", "qwix==0.1.8", "immutabledict==4.3.1",
    "tensorboardx==2.6.5", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "annotated-types==0.8.0", "typing-inspection==0.4.5", "typing-extensions==4.16.0",
    "gpytorch==1.15.2", "linear-operator==0.6.1", "tinygp==0.3.1", "equinox==0.13.8",
    "jaxtyping==0.3.11", "wadler-lindig==0.1.8",
]
WHEELHOUSE_BUILDS = ["pykeops==2.3", "keopscore==2.3"]


@nox.session(venv_backend="none")
def wheelhouse(session: nox.Session) -> None:
    """Download the extra benchmark wheels for an offline GPU host into .wheelhouse/.

    Target: CPython 3.12, manylinux x86_64. Extra names after ``--`` are added (e.g. ``flax``
    if the host's is older than qwix needs). On the host::

        pip install --no-index --no-deps --target /tmp/site .wheelhouse/*.whl
        export PYTHONPATH=src:/tmp/site
    """
    target = Path(".wheelhouse")
    target.mkdir(exist_ok=True)
    session.run(
        "python", "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
        # pip does not widen --platform: name every manylinux tag a wheel may carry
        "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
        "--platform", "manylinux_2_28_x86_64", "--dest", str(target),
        *WHEELHOUSE_DOWNLOADS, *session.posargs,
    )
    session.run("python", "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(target),
                *WHEELHOUSE_BUILDS)


def package_version(version_file: Path = VERSION_FILE) -> str:
    """``__version__`` of the package, read from its source as hatch reads it."""
    match = re.search(r"""^__version__ *= *(['"])v?(?P<version>.+?)\1""",
                      version_file.read_text(encoding="utf-8"), re.MULTILINE)
    if match is None:
        raise ValueError(f"{version_file} has no __version__ = \"...\" line")
    return match["version"]


@nox.session
def dist(session: nox.Session) -> None:
    """Build the sdist and the wheel into dist/ (the wheel from the sdist) and check them
    with ``twine check --strict``."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "release"))
    shutil.rmtree("dist", ignore_errors=True)  # twine checks exactly this build
    session.run("python", "-m", "build", "--outdir", "dist")
    session.run("twine", "check", "--strict", *sorted(str(p) for p in Path("dist").iterdir()))


@nox.session
def release_docs(session: nox.Session) -> None:
    """Build the versioned site of the current commit into the local gh-pages branch (mike).

    ``nox -s release_docs`` deploys the package version (src/tilax/__init__.py) and moves the
    ``latest`` alias to it; ``nox -s release_docs -- VERSION [ALIAS ...]`` deploys any other
    version (CI deploys main as ``dev``). Aliases are copies of their version's folder (a
    GitHub Pages artifact may hold no links). The site's root redirects to ``latest`` once a
    release has it, else to the version just deployed. One commit on gh-pages per call, nothing
    pushed; ``mike serve`` shows the branch at http://localhost:8000.

    The site is built from the commit (HEAD), checked out into a temporary worktree: what is
    not committed is not in it, and site/ (``nox -s docs``) is left alone. If the remote
    branch origin/gh-pages is ahead, mike starts from it.
    """
    if session.venv_backend != "none":
        install_groups(session, "docs", "release")
    version, *aliases = session.posargs or [package_version(), LATEST_ALIAS]
    env = {**QUIET_MKDOCS, VERSION_PROVIDER_VARIABLE: "mike"}
    if session.run("git", "status", "--porcelain", "--untracked-files=no", silent=True,
                   external=True).strip():
        session.warn("uncommitted changes are not in the versioned site: it is built from HEAD")
    worktree = Path(tempfile.mkdtemp(prefix="tilax-release-docs-"))
    session.run("git", "worktree", "add", "--detach", str(worktree), "HEAD", external=True)
    try:
        with session.chdir(worktree):
            session.run("mike", "deploy", "--update-aliases", "--alias-type", "copy",
                        version, *aliases, env=env)
            versions = json.loads(git_show(f"{DOCS_BRANCH}:versions.json"))
            default = (LATEST_ALIAS if any(LATEST_ALIAS in v["aliases"] for v in versions)
                       else version)
            session.run("mike", "set-default", default, env=env)
    finally:
        session.run("git", "worktree", "remove", "--force", str(worktree), external=True)
        shutil.rmtree(worktree, ignore_errors=True)


def git_show(revision_path: str) -> str:
    """``git show REV:PATH``: a file as it is in a commit or branch."""
    return subprocess.run(["git", "show", revision_path], check=True, capture_output=True,
                          text=True).stdout


# Keep a Changelog headings: "## [Unreleased]", "## [0.2.0] - 2026-12-01".
CHANGELOG_HEADING = re.compile(
    r"^## \[(?P<version>[^\]]+)\](?:\s+-\s+(?P<date>\S+))?[ \t]*$", re.MULTILINE)
# Link definitions at the end of the file ("[0.2.0]: https://...") belong to no section.
LINK_DEFINITIONS = re.compile(r"(?:^\[[^\]]+\]:[^\n]*\n?)+\Z", re.MULTILINE)


def changelog_section(changelog: str, version: str) -> str:
    """The body of the CHANGELOG.md section of release ``version``: the release's notes.

    Raises ValueError, naming the version, when the section is missing, has no date
    (``## [0.2.0] - YYYY-MM-DD``: a released version is dated) or is empty.
    """
    headings = list(CHANGELOG_HEADING.finditer(changelog))
    for index, heading in enumerate(headings):
        if heading["version"] != version:
            continue
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", heading["date"] or ""):
            raise ValueError(f"CHANGELOG.md: the heading of {version} needs its release date, "
                             f"'## [{version}] - YYYY-MM-DD', not {heading[0]!r}")
        end = headings[index + 1].start() if index + 1 < len(headings) else len(changelog)
        body = LINK_DEFINITIONS.sub("", changelog[heading.end():end].strip() + "\n").strip()
        if not body:
            raise ValueError(f"CHANGELOG.md: the section of {version} is empty")
        return body + "\n"
    listed = ", ".join(h["version"] for h in headings) or "none"
    raise ValueError(f"CHANGELOG.md has no section for {version} (sections: {listed}); "
                     f"rename [Unreleased] to '## [{version}] - YYYY-MM-DD' when releasing")


@nox.session(venv_backend="none")
def release_notes(session: nox.Session) -> None:
    """The release notes of a tag: its version's section of CHANGELOG.md.

    ``nox -s release_notes -- v0.2.0 [FILE]`` writes them to FILE (default: print them). The
    tag must be ``v`` plus the package version, so a tag cannot publish another version's
    wheel or notes.
    """
    if not session.posargs or len(session.posargs) > 2:
        session.error("usage: nox -s release_notes -- vX.Y.Z [FILE]")
    tag, *output = session.posargs
    version = package_version()
    if tag != f"v{version}":
        session.error(f"tag {tag} does not match the package version {version} "
                      f"({VERSION_FILE}): tag v{version}, or change __version__ first")
    try:
        notes = changelog_section(Path("CHANGELOG.md").read_text(encoding="utf-8"), version)
    except ValueError as error:
        session.error(str(error))
    if output:
        Path(output[0]).write_text(notes, encoding="utf-8")
        session.log(f"release notes of {tag}: {output[0]}")
    else:
        print(notes, end="")
