"""The course's word budget: words of chapter prose (markdown cells) per chapter, and the length
of its sentences.

    python tools/wordcount.py          # a table; exit status 1 if a limit is broken

Limits: at most 16,000 words in all, 3,000 in one chapter, 40 in one sentence. Code blocks and
table rows are not prose: they are left out of the sentences (a table's words still count)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from nb import parse  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOTAL, PER_CHAPTER, PER_SENTENCE = 16_000, 3_000, 40
SENTENCE_END = re.compile(r"(?<=[.!?])(?:\*\*|[\"')\]])?\s+(?=[A-Za-z0-9`*(\"'\[])|(?<=[。！？])")


def markdown_cells(source: Path) -> list[str]:
    return [c.source for c in parse(source.read_text()).cells if c.cell_type == "markdown"]


def prose(cell: str) -> str:
    """The cell without fenced code, table rows and headings: what reads as sentences."""
    kept, fenced = [], False
    for line in cell.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.lstrip().startswith(("|", "#", "$$")):
            continue
        kept.append(line)
    text = "\n".join(kept)
    return re.sub(r"\n\s*(?:[-*]|\d+\.)\s+", "\n\n", text)  # a list item starts afresh


def sentences(cell: str) -> list[str]:
    out = []
    for paragraph in re.split(r"\n\s*\n", prose(cell)):
        text = " ".join(paragraph.split()).replace("e.g.", "eg").replace("i.e.", "ie")
        out += [s for s in SENTENCE_END.split(text) if s.strip()]
    return out


def count(source: Path) -> dict:
    cells = markdown_cells(source)
    lengths = [len(s.split()) for c in cells for s in sentences(c)]
    return {"words": sum(len(c.split()) for c in cells), "cells": len(cells),
            "sentences": len(lengths),
            "mean_sentence": sum(lengths) / len(lengths) if lengths else 0.0,
            "longest_sentence": max(lengths, default=0),
            "long": [s for c in cells for s in sentences(c) if len(s.split()) > PER_SENTENCE]}


def chapters() -> list[Path]:
    return sorted((ROOT / "chapters" / "src").glob("[0-9][0-9]_*.py"))


def main() -> int:
    counts = {p.stem: count(p) for p in chapters()}
    print(f"{'chapter':<36}{'words':>7}{'cells':>6}{'mean sentence':>14}{'longest':>8}")
    for name, c in counts.items():
        print(f"{name:<36}{c['words']:>7}{c['cells']:>6}{c['mean_sentence']:>14.1f}"
              f"{c['longest_sentence']:>8}")
    total = sum(c["words"] for c in counts.values())
    print(f"{'all':<36}{total:>7}   (limits: {TOTAL:,} in all, {PER_CHAPTER:,} a chapter, "
          f"{PER_SENTENCE} a sentence)")
    broken = [f"{n}: {c['words']} words" for n, c in counts.items() if c["words"] > PER_CHAPTER]
    broken += [f"{n}: {s[:80]}..." for n, c in counts.items() for s in c["long"]]
    if total > TOTAL:
        broken.append(f"all chapters: {total} words")
    for line in broken:
        print("over the limit:", line)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
