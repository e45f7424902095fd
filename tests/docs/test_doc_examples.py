"""Run every runnable code block of the hand-written docs pages.

A block is runnable when the line right before its opening fence is the HTML comment
``<!-- runnable -->`` and the fence is a ```` ```python ```` fence (see docs/contributing.md).
The runnable blocks of one page run in page order in one namespace, like a notebook; each page
gets a fresh namespace. Pages read the environment variable ``TILAX_DOCS_SMALL`` to pick sizes
that run in seconds on a CPU; this test sets it to 1 unless it is already set, so
``TILAX_DOCS_SMALL=0 pytest tests/docs`` runs the pages at their full (GPU) sizes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
MARKER = "<!-- runnable -->"
FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)$")

# Pages that must keep at least one runnable block: losing the marker must not silently turn
# the examples of these pages into untested text.
PAGES_WITH_EXAMPLES = ("getting-started.md", "guides/moe.md", "guides/rbf.md")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line number of the first code line
    code: str


class DocsFormatError(ValueError):
    """A runnable marker that is not followed by a python fence, or an unclosed fence."""


def display_name(page: Path) -> str:
    return str(page.relative_to(DOCS)) if page.is_relative_to(DOCS) else str(page)


def runnable_blocks(page: Path) -> list[Block]:
    """The runnable blocks of ``page`` in page order, their indentation removed.

    Markers inside other fenced blocks (e.g. a markdown example of the convention) are text.
    """
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks = []
    number = 0
    while number < len(lines):
        line = lines[number]
        opening = FENCE_OPEN.match(line)
        if opening is not None:  # an unmarked fence: skip to its end
            number = fence_end(lines, number, opening, page)
            continue
        if line.strip() == MARKER:
            block, number = marked_block(lines, number, page)
            blocks.append(block)
            continue
        number += 1
    return blocks


def fence_end(lines: list[str], start: int, opening: re.Match[str], page: Path) -> int:
    """Index of the line after the fence that opens at ``lines[start]``."""
    indent, fence = opening["indent"], opening["fence"]
    for number in range(start + 1, len(lines)):
        closing = lines[number].strip()
        if closing.startswith(fence) and set(closing) == {fence[0]}:
            if lines[number].startswith(indent) or not lines[number][: len(indent)].strip():
                return number + 1
    raise DocsFormatError(f"{display_name(page)}:{start + 1}: the fence is never closed")


def marked_block(lines: list[str], marker: int, page: Path) -> tuple[Block, int]:
    """The python block right after the marker at ``lines[marker]``, and the index after it."""
    where = f"{display_name(page)}:{marker + 1}"
    opening = FENCE_OPEN.match(lines[marker + 1]) if marker + 1 < len(lines) else None
    if opening is None:
        raise DocsFormatError(f"{where}: {MARKER} must be followed directly by a code fence")
    words = opening["info"].split()
    language = words[0].lstrip(".{") if words else ""
    if language != "python":
        raise DocsFormatError(f"{where}: runnable blocks must be python, got {language!r}")
    indent = opening["indent"]
    end = fence_end(lines, marker + 1, opening, page)
    body = [
        line[len(indent) :] if line.startswith(indent) else line.lstrip()
        for line in lines[marker + 2 : end - 1]
    ]
    return Block(page, marker + 3, "\n".join(body) + "\n"), end


def pages_with_runnable_blocks() -> list[Path]:
    return [page for page in sorted(DOCS.rglob("*.md")) if runnable_blocks(page)]


@pytest.mark.parametrize("page", pages_with_runnable_blocks(), ids=display_name)
def test_runnable_blocks_of_page(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = runnable_blocks(page)
    monkeypatch.setenv("TILAX_DOCS_SMALL", os.environ.get("TILAX_DOCS_SMALL", "1"))
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for block in blocks:
        # Pad with newlines so that tracebacks name the page's own line numbers.
        source = "\n" * (block.line - 1) + block.code
        code = compile(source, str(block.page), "exec")
        exec(code, namespace)


@pytest.mark.parametrize("name", PAGES_WITH_EXAMPLES)
def test_example_pages_keep_runnable_blocks(name: str) -> None:
    assert runnable_blocks(DOCS / name), f"docs/{name} lost its runnable blocks"


def test_marker_must_precede_a_python_fence(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"{MARKER}\n```bash\nls\n```\n", encoding="utf-8")
    with pytest.raises(DocsFormatError, match="must be python"):
        runnable_blocks(page)
    page.write_text(f"{MARKER}\n\n```python\nx = 1\n```\n", encoding="utf-8")
    with pytest.raises(DocsFormatError, match="followed directly"):
        runnable_blocks(page)
    page.write_text(f"{MARKER}\n```python\nx = 1\n", encoding="utf-8")
    with pytest.raises(DocsFormatError, match="never closed"):
        runnable_blocks(page)


def test_blocks_keep_order_lines_and_indentation(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n"
        f"{MARKER}\n```python\nx = 1\n```\n"
        "```python\nnot_run()\n```\n"
        f'!!! note\n    {MARKER}\n    ```python title="a.py"\n    if x:\n        y = 2\n    ```\n'
        f"````markdown\n{MARKER}\n```python\nexample_only()\n```\n````\n",
        encoding="utf-8",
    )
    blocks = runnable_blocks(page)
    assert [(b.line, b.code) for b in blocks] == [(4, "x = 1\n"), (12, "if x:\n    y = 2\n")]
