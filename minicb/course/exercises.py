"""One source, two notebooks (exercises for chapters 01-08).

Each exercise notebook has a single source, `exercises/source/NN_name.ipynb`, whose code cells
mark the reference answer with nbgrader-style markers:

    def allocate(self, n):
        ### BEGIN SOLUTION
        # HINT: take pages from the free list; a page you hand out has ref count 1.
        ...the answer...
        ### END SOLUTION

`python -m minicb.course.exercises build` writes two notebooks from every source:

    exercises/NN_name.ipynb   each marked region becomes its `# HINT:` comment (if any) and
                              `raise NotImplementedError("...")` naming what to write
    solutions/NN_name.ipynb   the markers are removed, the answer stays

Both are written without outputs, with the source's cell ids, so the output is a pure function
of the source (the tests regenerate it and compare). `python -m minicb.course.exercises check`
exits 1 if the committed notebooks differ from what the sources generate. A markdown cell may mark a
written answer the same way; the exercise version shows `*Write your answer here.*`.

Cell tags tie an exercise together: its stub cell carries `exercise:<name>` (the name goes into
the NotImplementedError message), its check cell `check:<name>` and optionally `points:<n>`
(default 1) and `weight:<case group or case>=<w>` (`minicb.course.grade.case_points`); the
generated notebooks show each exercise's points in its `## Exercise` heading and the total in
the first cell. `minicb.course.grade` scores a notebook by its check cells, and
`minicb.course.check.<name>` is the function the check cell calls. Only cell tags survive
generation; other cell metadata and
all outputs are dropped. Markdown links out of the folder (`../../chapters/...`) are written
relative to the source's folder, so they work where a teacher edits them, and rewritten for
the generated notebooks one folder up.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import time
from pathlib import Path

import nbformat

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
HINT = re.compile(r"^\s*#\s*HINT\b")
DEF = re.compile(r"^(?P<indent>\s*)(?:async\s+)?def\s+(?P<name>\w+)")
CLASS = re.compile(r"^(?P<indent>\s*)class\s+(?P<name>\w+)")
ROOT = Path(__file__).resolve().parents[2]
MARKDOWN_STUB = "*Write your answer here.*"
TOTAL = "**Points:**"  # opens the line giving a notebook's points, in its first cell
POINTS_SHOWN = re.compile(r"\(\d+(\.\d+)? points?\)\s*$")  # a heading's "(2 points)"


class MarkerError(ValueError):
    """A source cell's solution markers are unbalanced or nested."""


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _enclosing(lines: list[str], index: int) -> str:
    """Qualified name (`Class.method` or `function`) of the def around line `index`."""
    depth = len(_indent(lines[index]))
    names: list[str] = []
    for line in reversed(lines[:index]):
        match = DEF.match(line) or CLASS.match(line)
        if match and len(match.group("indent")) < depth:
            names.append(match.group("name"))
            depth = len(match.group("indent"))
            if depth == 0:
                break
    return ".".join(reversed(names))


def _regions(lines: list[str], where: str) -> list[tuple[int, int]]:
    """(begin, end) line indices of every marked region; MarkerError if unbalanced."""
    regions, start = [], None
    for i, line in enumerate(lines):
        text = line.strip()
        if text == BEGIN:
            if start is not None:
                raise MarkerError(f"{where}: line {i + 1}: {BEGIN} inside another solution")
            start = i
        elif text == END:
            if start is None:
                raise MarkerError(f"{where}: line {i + 1}: {END} without {BEGIN}")
            regions.append((start, i))
            start = None
    if start is not None:
        raise MarkerError(f"{where}: line {start + 1}: {BEGIN} is never closed")
    return regions


def _hint_lines(body: list[str]) -> list[str]:
    """The `# HINT:` comment of a region: its first line and the comment lines right after."""
    out: list[str] = []
    for line in body:
        if out and line.strip().startswith("#") and not HINT.match(line):
            out.append(line)
        elif HINT.match(line):
            out.append(line)
        elif out:
            break
    return out


def stub_code(source: str, exercise: str = "", where: str = "cell") -> str:
    """The exercise version of a code cell: every marked region becomes its hint and a
    `raise NotImplementedError` that names the function to write and the exercise."""
    lines = source.split("\n")
    regions = _regions(lines, where)
    out: list[str] = []
    last = 0
    for begin, end in regions:
        out.extend(lines[last:begin])
        indent = _indent(lines[begin])
        body = lines[begin + 1:end]
        hint = _hint_lines(body)
        what = _enclosing(lines, begin) or "this part"
        label = f" (exercise {exercise})" if exercise else ""
        tail = "see the HINT above" if hint else "replace this line with your code"
        out.extend(hint)
        out.append(f'{indent}raise NotImplementedError("write {what}{label}: {tail}")')
        last = end + 1
    out.extend(lines[last:])
    return "\n".join(out)


def solution_code(source: str, where: str = "cell") -> str:
    """The solution version of a cell: the marker lines removed, everything else kept."""
    lines = source.split("\n")
    drop = {i for region in _regions(lines, where) for i in region}
    return "\n".join(line for i, line in enumerate(lines) if i not in drop)


def stub_markdown(source: str, where: str = "cell") -> str:
    """The exercise version of a markdown cell: each marked region becomes a prompt line."""
    lines = source.split("\n")
    out, last = [], 0
    for begin, end in _regions(lines, where):
        out.extend(lines[last:begin])
        out.append(MARKDOWN_STUB)
        last = end + 1
    out.extend(lines[last:])
    return "\n".join(out)


def cell_tags(cell: dict) -> list[str]:
    """The cell's metadata tags (an empty list when it has none)."""
    tags = (cell.get("metadata") or {}).get("tags") or []  # a hand-edited file may hold null
    return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []


def _exercise_of(cell: dict) -> str:
    """The name in the cell's `exercise:<name>` tag (stub cells carry one), else ''."""
    for tag in cell_tags(cell):
        if tag.startswith("exercise:"):
            return tag.split(":", 1)[1]
    return ""


def points_of(nb: nbformat.NotebookNode) -> dict[str, float]:
    """{exercise: points} of every check cell (`check:<name>`, `points:<n>`, default 1)."""
    points: dict[str, float] = {}
    for cell in nb.cells:
        tags = cell_tags(cell)
        names = [t.split(":", 1)[1] for t in tags if t.startswith("check:")]
        values = [t.split(":", 1)[1] for t in tags if t.startswith("points:")]
        if names and cell.cell_type == "code":
            points[names[-1]] = float(values[-1]) if values else 1.0
    return points


def _points(n: float) -> str:
    n = int(n) if float(n).is_integer() else n
    return f"{n} point{'' if n == 1 else 's'}"


def show_points(nb: nbformat.NotebookNode) -> None:
    """Write each exercise's points after its `## Exercise` heading (the last before its stub
    cell) and a line giving the total at the end of the first cell. A notebook that shows
    them already (a student copy's stubs, which are its sources) is left as it is."""
    points = points_of(nb)
    if not points:
        return
    for name, value in points.items():
        stub = next((i for i, c in enumerate(nb.cells) if f"exercise:{name}" in cell_tags(c)),
                    None)
        heading = next((c for c in reversed(nb.cells[:stub or 0]) if c.cell_type == "markdown"
                        and c.source.lstrip().startswith("## Exercise")), None)
        if heading is not None and POINTS_SHOWN.search(heading.source.partition("\n")[0]) is None:
            first, _, rest = heading.source.partition("\n")
            heading.source = f"{first} ({_points(value)})" + ("\n" + rest if rest else "")
    if TOTAL in nb.cells[0].source:
        return
    each = ", ".join(f"`{name}` {_points(value)}" for name, value in points.items())
    nb.cells[0].source = (nb.cells[0].source.rstrip("\n")
                          + f"\n\n{TOTAL} {_points(sum(points.values()))} in all: {each}.")


def _clean(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """No outputs, no execution counts, only the metadata the course uses."""
    nb.metadata = nbformat.from_dict({
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    })
    for i, cell in enumerate(nb.cells):
        keep = {k: v for k, v in cell.get("metadata", {}).items() if k in ("tags",)}
        cell.metadata = nbformat.from_dict(keep)
        cell.setdefault("id", f"cell-{i:02d}")
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nb.nbformat, nb.nbformat_minor = 4, 5
    return nb


MARKDOWN_LINK = re.compile(r"(\]\()(\.\./[^)\s#]+)")  # ](../target: out of the folder


def relink(text: str, source_dir: str = "exercises/source", target_dir: str = "exercises") -> str:
    """Markdown with each link out of `source_dir` (`../...`) rewritten for `target_dir`
    (folders relative to the repository root). Links to siblings (the next exercise notebook)
    stay: they name the sibling in either folder."""
    def moved(match: re.Match) -> str:
        absolute = os.path.normpath(os.path.join(source_dir, match.group(2)))
        return match.group(1) + Path(os.path.relpath(absolute, target_dir)).as_posix()
    return MARKDOWN_LINK.sub(moved, text)


def generate(source_nb: nbformat.NotebookNode, name: str = "notebook"
             ) -> tuple[nbformat.NotebookNode, nbformat.NotebookNode]:
    """(exercise notebook, solution notebook) made from one source notebook."""
    exercise, solution = copy.deepcopy(source_nb), copy.deepcopy(source_nb)
    for i, (ex_cell, sol_cell) in enumerate(zip(exercise.cells, solution.cells)):
        where = f"{name} cell {i} ({ex_cell.get('id', '?')})"
        text = ex_cell.source if isinstance(ex_cell.source, str) else "".join(ex_cell.source)
        if ex_cell.cell_type == "markdown":  # exercises/ and solutions/ sit one folder up
            text = ex_cell.source = sol_cell.source = relink(text)
        if BEGIN not in text and END not in text:
            continue
        if ex_cell.cell_type == "code":
            ex_cell.source = stub_code(text, _exercise_of(ex_cell), where)
            sol_cell.source = solution_code(text, where)
        elif ex_cell.cell_type == "markdown":
            ex_cell.source = stub_markdown(text, where)
            sol_cell.source = solution_code(text, where)
    show_points(exercise)
    show_points(solution)
    return _clean(exercise), _clean(solution)


def render(nb: nbformat.NotebookNode) -> str:
    """The exact text written to disk (sorted keys, one-space indent, final newline)."""
    text = nbformat.writes(nb, version=4)
    return text if text.endswith("\n") else text + "\n"


def outputs(root: Path = ROOT) -> dict[Path, str]:
    """Every generated file and its text, from every source under exercises/source."""
    sources = sorted((root / "exercises" / "source").glob("*.ipynb"))
    files: dict[Path, str] = {}
    for src in sources:
        nb = nbformat.read(src, as_version=4)
        exercise, solution = generate(nb, src.name)
        files[root / "exercises" / src.name] = render(exercise)
        files[root / "solutions" / src.name] = render(solution)
    return files


def build(root: Path = ROOT) -> list[Path]:
    """Write exercises/ and solutions/ from the sources; returns the files that changed."""
    changed = []
    for path, text in outputs(root).items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed.append(path)
    return changed


def reset(notebook: Path, root: Path = ROOT) -> Path | None:
    """Put a fresh copy of one exercise notebook in place, for a learner who wants to start it
    over. The learner's version is moved to `exercises/.backup/NAME.<time>.ipynb` (returned;
    None if there was none), out of the way of `grade exercises/*.ipynb`. Works in the student
    copy too, whose sources are the stubs themselves."""
    source = root / "exercises" / "source" / Path(notebook).name
    if not source.is_file():
        names = sorted(p.name for p in source.parent.glob("*.ipynb"))
        raise FileNotFoundError(f"no exercise notebook named {Path(notebook).name!r}: "
                                f"the exercises are {', '.join(names)}")
    exercise, _ = generate(nbformat.read(source, as_version=4), source.name)
    target = root / "exercises" / source.name
    backup = None
    if target.exists():
        stamp = time.strftime("%Y%m%d-%H%M%S")
        backup = root / "exercises" / ".backup" / f"{target.stem}.{stamp}.ipynb"
        for n in range(1, 1000):  # two resets within a second keep both versions
            if not backup.exists():
                break
            backup = backup.with_name(f"{target.stem}.{stamp}-{n}.ipynb")
        backup.parent.mkdir(exist_ok=True)
        target.replace(backup)
    target.write_text(render(exercise))
    return backup


def stale(root: Path = ROOT) -> list[str]:
    """Generated files that are missing or differ from what the sources give, and generated
    notebooks whose source is gone."""
    files = outputs(root)
    bad = [str(p.relative_to(root)) for p, text in files.items()
           if not p.exists() or p.read_text() != text]
    for folder in ("exercises", "solutions"):
        for path in sorted((root / folder).glob("*.ipynb")):
            if path not in files:
                bad.append(f"{path.relative_to(root)} (no source)")
    return bad


def main(argv: list[str] | None = None) -> int:
    """`python -m minicb.course.exercises build|check|reset NOTEBOOK...`."""
    parser = argparse.ArgumentParser(
        prog="python -m minicb.course.exercises",
        description="Generate exercise and solution notebooks (build, check), or put a fresh "
                    "copy of exercise notebooks in place (reset; the old one is kept in "
                    "exercises/.backup/).")
    parser.add_argument("command", choices=("build", "check", "reset"))
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="reset: the notebooks, e.g. exercises/03_continuous_batching.ipynb")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root")
    args = parser.parse_args(argv)
    if (args.command == "reset") != bool(args.notebooks):
        parser.error("reset takes the notebooks to reset; build and check take none")
    try:
        if args.command == "reset":
            for notebook in args.notebooks:
                backup = reset(notebook, args.root)
                kept = f" (yours is kept as {backup.relative_to(args.root)})" if backup else ""
                print(f"exercises/{notebook.name}: a fresh copy{kept}")
            return 0
        if args.command == "build":
            changed = build(args.root)
            count = len(outputs(args.root))
            print(f"{count} notebooks generated, {len(changed)} changed"
                  + "".join(f"\n  {p.relative_to(args.root)}" for p in changed))
            return 0
        bad = stale(args.root)
        if bad:
            print("out of date (run `python -m minicb.course.exercises build`):\n  "
                  + "\n  ".join(bad), file=sys.stderr)
            return 1
        print("exercises/ and solutions/ match their sources")
        return 0
    except (MarkerError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
