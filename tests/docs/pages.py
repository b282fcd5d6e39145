"""The README and the docs pages, and the code blocks in them, for the docs tests."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """README.md and every page under docs/ (not docs/results, a link to the committed results)."""
    under_docs = [p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).parts[0] != "results"]
    return [ROOT / "README.md", *sorted(under_docs)]


@dataclass(frozen=True)
class Block:
    language: str  # the fence's first word: python, bash, yaml, ...
    info: str  # the rest of the fence line (title="...")
    code: str
    line: int  # the line of the block's first code line in its page, from 1


_FENCE = re.compile(r"^```(?P<language>\w*)(?P<info>[^\n]*)\n(?P<code>.*?)^```\s*$", re.M | re.S)


def blocks(page: Path, language: str | None = None) -> list[Block]:
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        if language is None or match["language"] == language:
            line = text.count("\n", 0, match.start("code")) + 1
            found.append(Block(match["language"], match["info"].strip(), match["code"], line))
    return found


def relative(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()
