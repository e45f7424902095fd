"""The runnable code blocks of the docs pages (a plain module shared by tests/docs and the
guide benchmarks in tests/bench): a block is runnable when the line right before its opening
fence is ``<!-- runnable -->`` and the fence is a python fence (see docs/contributing.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
MARKER = "<!-- runnable -->"
FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)$")


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


def page_script(page: Path) -> str:
    """The runnable blocks of ``page`` as one script, each code line on its own page line
    (every other line blank), so that a traceback names the line of the page."""
    lines = [""] * len(page.read_text(encoding="utf-8").splitlines())
    for block in runnable_blocks(page):
        for offset, line in enumerate(block.code.splitlines()):
            lines[block.line - 1 + offset] = line
    return "\n".join(lines) + "\n"
