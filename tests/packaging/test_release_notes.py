"""Release notes come from CHANGELOG.md: ``nox -s release_notes -- vX.Y.Z FILE`` writes the
section of the tag's version, and refuses a tag that is not the package version or a version
without a dated section."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHANGELOG = REPO / "CHANGELOG.md"

CHANGELOG_FIXTURE = """\
# Changelog

Intro text.

## [Unreleased]

### Fixed

- Not released yet.

## [0.2.0] - 2026-12-01

### Added

- Second.

### Fixed

- A fix, with a [link](https://example.org).

## [0.1.0] - 2026-11-01

- First.

[Unreleased]: https://example.org/compare/v0.2.0...HEAD
[0.2.0]: https://example.org/compare/v0.1.0...v0.2.0
[0.1.0]: https://example.org/releases/tag/v0.1.0
"""


def project(target: Path, changelog: str, version: str) -> Path:
    """The files ``nox -s release_notes`` reads: this noxfile and pyproject.toml, a package at
    ``version`` and ``changelog``."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("noxfile.py", "pyproject.toml"):
        shutil.copy(REPO / name, target / name)
    (target / "src" / "tilax").mkdir(parents=True)
    (target / "src" / "tilax" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (target / "CHANGELOG.md").write_text(changelog, encoding="utf-8")
    return target


def release_notes(directory: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nox", "-s", "release_notes", "--", *args],
                          cwd=directory, capture_output=True, text=True, timeout=120)


def notes_of(tmp_path: Path, changelog: str, version: str) -> str:
    proc = release_notes(project(tmp_path, changelog, version), f"v{version}", "notes.md")
    assert proc.returncode == 0, proc.stderr
    return (tmp_path / "notes.md").read_text(encoding="utf-8")


def refusal_of(tmp_path: Path, changelog: str, version: str, tag: str) -> str:
    proc = release_notes(project(tmp_path, changelog, version), tag, "notes.md")
    assert proc.returncode != 0 and not (tmp_path / "notes.md").exists()
    return proc.stderr


def test_a_middle_section_is_its_body(tmp_path: Path) -> None:
    assert notes_of(tmp_path, CHANGELOG_FIXTURE, "0.2.0") == (
        "### Added\n\n- Second.\n\n### Fixed\n\n- A fix, with a [link](https://example.org).\n")


def test_the_last_section_ends_before_the_link_definitions(tmp_path: Path) -> None:
    assert notes_of(tmp_path, CHANGELOG_FIXTURE, "0.1.0") == "- First.\n"


def test_a_tag_that_is_not_the_package_version_is_refused(tmp_path: Path) -> None:
    stderr = refusal_of(tmp_path, CHANGELOG_FIXTURE, "0.2.0", "v0.1.0")
    assert "tag v0.1.0 does not match the package version 0.2.0" in stderr


def test_a_version_without_a_section_is_refused(tmp_path: Path) -> None:
    stderr = refusal_of(tmp_path, CHANGELOG_FIXTURE, "0.3.0", "v0.3.0")
    assert "no section for 0.3.0 (sections: Unreleased, 0.2.0, 0.1.0)" in stderr


def test_an_undated_or_empty_section_is_refused(tmp_path: Path) -> None:
    undated = CHANGELOG_FIXTURE.replace("## [0.2.0] - 2026-12-01", "## [0.2.0]")
    assert "needs its release date" in refusal_of(tmp_path / "a", undated, "0.2.0", "v0.2.0")
    empty = "## [0.2.0] - 2026-12-01\n\n## [0.1.0] - 2026-11-01\n- First.\n"
    assert "0.2.0 is empty" in refusal_of(tmp_path / "b", empty, "0.2.0", "v0.2.0")


def test_changelog_keeps_a_changelog() -> None:
    """CHANGELOG.md: an [Unreleased] section first, then dated releases, newest first."""
    headings = re.findall(r"^## (.*)$", CHANGELOG.read_text(encoding="utf-8"), re.MULTILINE)
    assert headings and headings[0] == "[Unreleased]"
    released = []
    for heading in headings[1:]:
        match = re.fullmatch(r"\[(\d+)\.(\d+)\.(\d+)\] - \d{4}-\d{2}-\d{2}", heading)
        assert match, f"CHANGELOG.md heading {heading!r} is not '[X.Y.Z] - YYYY-MM-DD'"
        released.append(tuple(map(int, match.groups())))
    assert released == sorted(released, reverse=True), "releases must be newest first"


def test_the_real_changelog_gives_the_notes_of_its_next_release(tmp_path: Path) -> None:
    """CHANGELOG.md itself: after the release edit of contributing.md ([Unreleased] becomes
    '## [X.Y.Z] - date'), the notes of vX.Y.Z are the entries that were unreleased; with
    nothing unreleased, the notes of the newest release are its section."""
    text = CHANGELOG.read_text(encoding="utf-8")
    sections = re.findall(r"^## \[([^\]]+)\][^\n]*\n(.*?)(?=^## |\Z)", text,
                          re.MULTILINE | re.DOTALL)
    (_, unreleased), *released = sections
    if unreleased.strip():
        version, expected = "9.9.9", unreleased
        heading = f"## [Unreleased]\n\n## [{version}] - 2026-12-01\n"
        text = text.replace("## [Unreleased]\n", heading, 1)
    else:
        assert released, "CHANGELOG.md has neither unreleased entries nor a release"
        version, expected = released[0]
    expected = re.sub(r"(?:^\[[^\]]+\]:.*\n?)+\Z", "", expected.strip() + "\n", flags=re.M)
    assert notes_of(tmp_path, text, version) == expected.strip() + "\n"
