"""Build notebooks from percent-format sources and store them executed, with outputs.

    python tools/nb.py chapters/src/03_continuous_batching.py [...]   # -> chapters/03_....ipynb
    python tools/nb.py --no-exec SRC                                   # structure only
    python tools/nb.py --markdown-only SRC      # prose edits: keep the stored outputs

A source file is plain Python: `# %% [markdown]` starts a markdown cell (each line prefixed with
`# `), `# %%` starts a code cell. Run from the repository root; outputs are stored so a reader on
the web sees the pictures without running anything."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

CELL = re.compile(r"^# %%(?P<md> \[markdown\])?.*$", re.M)


def parse(text: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    marks = list(CELL.finditer(text))
    for i, mark in enumerate(marks):
        body = text[mark.end():marks[i + 1].start() if i + 1 < len(marks) else len(text)]
        body = body.strip("\n")
        if mark.group("md"):
            lines = [line[2:] if line.startswith("# ") else line.lstrip("#")
                     for line in body.splitlines()]
            nb.cells.append(nbformat.v4.new_markdown_cell("\n".join(lines)))
        elif body.strip():
            nb.cells.append(nbformat.v4.new_code_cell(body))
    return nb


def notebook_path(src: Path, out_dir: Path | None = None) -> Path:
    """chapters/src/NN_name.py -> chapters/NN_name.ipynb (or into `out_dir`)."""
    return (out_dir or src.parent.parent) / (src.stem + ".ipynb")


def build(src: Path, out_dir: Path | None = None, execute: bool = True,
          timeout: int = 600) -> Path:
    nb = parse(src.read_text())
    out = notebook_path(src, out_dir)
    if execute:
        t0 = time.time()
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(out.parent)}}).execute()
        print(f"{out}: executed in {time.time() - t0:.0f} s")
    for i, cell in enumerate(nb.cells):  # stable ids keep diffs small
        cell["id"] = f"cell-{i:02d}"
    nbformat.write(nb, out)
    return out


def sync_markdown(src: Path, out_dir: Path | None = None) -> Path:
    """Copy the source's markdown cells into the stored notebook, keeping its code and outputs:
    for prose edits, without a re-run that would change the measured numbers the prose quotes.
    Refuses if any code cell differs (those need a build)."""
    fresh = parse(src.read_text())
    out = notebook_path(src, out_dir)
    nb = nbformat.read(out, as_version=4)
    kinds = [c.cell_type for c in fresh.cells], [c.cell_type for c in nb.cells]
    if kinds[0] != kinds[1] or any(a.source != b.source for a, b in zip(fresh.cells, nb.cells)
                                   if a.cell_type == "code"):
        raise SystemExit(f"{src}: code cells changed since {out} was built: build it")
    for new, old in zip(fresh.cells, nb.cells):
        old.source = new.source
    nbformat.write(nb, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path)
    parser.add_argument("--no-exec", action="store_true")
    parser.add_argument("--markdown-only", action="store_true",
                        help="update the stored notebook's prose only (code must be unchanged)")
    parser.add_argument("--out-dir", type=Path)
    args = parser.parse_args(argv)
    for src in args.sources:
        if args.markdown_only:
            sync_markdown(src, args.out_dir)
        else:
            build(src, args.out_dir, execute=not args.no_exec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
