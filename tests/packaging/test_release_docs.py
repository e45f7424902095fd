"""Versioned docs: ``nox -s release_docs`` builds versions of the site into a local gh-pages
branch with mike, and ``.ci/publish-docs`` (CI's versioned-docs job) pushes it: on main the
version ``dev``, on a release tag the tag's version with the ``latest`` alias.

Run against throwaway repositories: a committed copy of this checkout's files, pushed to a bare
repository that plays GitHub's part, and each CI run in its own clone of it, so the test sees
the branch exactly as the runs leave it and touches nothing here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tilax

REPO = Path(__file__).resolve().parents[2]
BRANCH = "gh-pages"
# Two site builds, each about 25 s on an idle 2-core machine (102 stored files).
RELEASE_DOCS_TIMEOUT_S = 480
# What makes mkdocs.yml's extra.version.provider "mike" (noxfile.py's release_docs sets it).
VERSION_PROVIDER_VARIABLE = "TILAX_DOCS_VERSION_PROVIDER"
GIT_IDENTITY = {"GIT_AUTHOR_NAME": "tilax tests", "GIT_AUTHOR_EMAIL": "tests@tilax.invalid",
                "GIT_COMMITTER_NAME": "tilax tests", "GIT_COMMITTER_EMAIL": "tests@tilax.invalid"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                          text=True, env=git_environment()).stdout


def git_environment() -> dict[str, str]:
    """This environment without a surrounding repository's git settings, plus an identity."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    # mike and mkdocs come from this interpreter's environment, as in the tests session.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env | GIT_IDENTITY


def throwaway_repository(target: Path) -> Path:
    """This checkout's files (tracked, and new ones not ignored) committed into a new repo."""
    listed = git(REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the work tree is not copied
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    git(target, "init", "-q", "-b", "main")
    git(target, "add", "-A")
    git(target, "commit", "-q", "-m", "snapshot of the checkout")
    return target


def publish_docs(repo: Path, ref: str) -> None:
    """CI's versioned-docs step for ``ref`` in ``repo``: ``.ci/publish-docs``, running
    ``nox -s release_docs`` in this environment (``--no-venv``: the tests session already has
    the docs and release groups)."""
    env = git_environment() | {"GITHUB_REF": ref, "NOX": f"{sys.executable} -m nox --no-venv"}
    proc = subprocess.run(["bash", ".ci/publish-docs"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=RELEASE_DOCS_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f".ci/publish-docs for {ref} failed:\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def redirect_target(html: str) -> str:
    """Where mike's redirect page sends the reader."""
    return re.search(r'Redirecting to <a href="([^"]+)">', html)[1]


def page_config(html: str) -> dict:
    """mkdocs-material's page configuration (the JSON its JavaScript reads)."""
    return json.loads(re.search(r'<script id="__config" type="application/json">(.*?)</script>',
                                html, re.DOTALL)[1])


@pytest.mark.release
def test_versioned_build_makes_two_versions_and_the_latest_alias(tmp_path: Path) -> None:
    origin = tmp_path / "origin.git"
    checkout = throwaway_repository(tmp_path / "checkout")
    git(tmp_path, "clone", "-q", "--bare", str(checkout), str(origin))
    version = tilax.__version__  # the copy's, which is this checkout's

    main_run = tmp_path / "main-run"
    git(tmp_path, "clone", "-q", str(origin), str(main_run))
    publish_docs(main_run, "refs/heads/main")
    # Before any release the root goes to the version just deployed.
    assert redirect_target(git(origin, "show", f"{BRANCH}:index.html")) == "dev/"

    tag_run = tmp_path / "tag-run"  # a later run: a fresh clone, gh-pages only on origin
    git(tmp_path, "clone", "-q", str(origin), str(tag_run))
    publish_docs(tag_run, f"refs/tags/v{version}")
    versions = json.loads(git(origin, "show", f"{BRANCH}:versions.json"))
    assert {v["version"]: v["aliases"] for v in versions} == {version: ["latest"], "dev": []}
    assert redirect_target(git(origin, "show", f"{BRANCH}:index.html")) == "latest/"

    top = set(git(origin, "ls-tree", "--name-only", BRANCH).split())
    assert {version, "dev", "latest", "versions.json", "index.html"} <= top
    # The alias is a copy (a Pages artifact may not hold links): files, not a symlink.
    alias_tree = git(origin, "ls-tree", "-r", BRANCH, "latest").splitlines()
    assert {line.split()[0] for line in alias_tree} == {"100644"}
    for folder in (version, "dev", "latest"):
        for page in ("index.html", "getting-started.html", "reports/moe-layer.html"):
            git(origin, "cat-file", "-e", f"{BRANCH}:{folder}/{page}")
    release_page = git(origin, "show", f"{BRANCH}:{version}/index.html")
    assert release_page == git(origin, "show", f"{BRANCH}:latest/index.html")
    # The version selector is on, reading versions.json one level up.
    assert page_config(release_page)["version"] == {"provider": "mike", "alias": True}

    # Built from a temporary worktree of HEAD: no site/ in the run's clone, no worktree left
    # behind, and the checked-out branch untouched.
    assert not (tag_run / "site").exists()
    assert len(git(tag_run, "worktree", "list").splitlines()) == 1
    assert git(tag_run, "status", "--porcelain") == ""
    assert git(tag_run, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"


def test_plain_build_has_no_version_selector(monkeypatch: pytest.MonkeyPatch) -> None:
    """``nox -s docs`` builds one unversioned site with no versions.json beside it: the
    selector, which would request it, is on only in the versioned build."""
    from mkdocs.config import load_config

    monkeypatch.delenv(VERSION_PROVIDER_VARIABLE, raising=False)
    assert load_config(str(REPO / "mkdocs.yml"))["extra"]["version"]["provider"] is None
    monkeypatch.setenv(VERSION_PROVIDER_VARIABLE, "mike")
    assert load_config(str(REPO / "mkdocs.yml"))["extra"]["version"]["provider"] == "mike"
