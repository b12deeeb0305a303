"""The code blocks of the README and the documentation pages (docs/), for the tests that run them.

A block that a test runs is marked by an HTML comment on the line before it, `<!-- NAME:
tests/test_x.py runs this block ... -->`; `marked_block(NAME)` returns its code, the same
wherever the block is shown (tests/test_docs.py checks that every Python block is marked, that
the file it names exists and mentions NAME, and that a block shown twice is one block).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!-- ([\w-]+): (tests/[\w/]+\.py)[^>]*-->\n```(\w+)\n(.*?)```", re.S)
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def pages() -> list[Path]:
    """The README and every page of the documentation site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: Path
    language: str
    code: str
    marker: str | None = None
    test_file: str | None = None


def blocks(language: str | None = None) -> list[Block]:
    """Every fenced block of every page (of `language` when given), with its marker if it has one."""
    found = []
    for page in pages():
        text = page.read_text()
        marked = {m.start(3) - 3: m for m in MARKER.finditer(text)}
        for match in BLOCK.finditer(text):
            if language is not None and match.group(1) != language:
                continue
            mark = marked.get(match.start())
            found.append(
                Block(page, match.group(1), match.group(2), mark.group(1) if mark else None, mark.group(2) if mark else None)
            )
    return found


def marked_block(marker: str) -> str:
    """The code of the block marked `marker` (the first page that shows it)."""
    for block in blocks():
        if block.marker == marker:
            return block.code
    raise LookupError(f"no page shows a block marked {marker!r}")


def shell_lines(command: str) -> list[str]:
    """Every line of every `sh` block that starts with `command`."""
    return [line for block in blocks("sh") for line in block.code.splitlines() if line.startswith(command)]
