"""An nbgrader course made from the exercise sources: `python -m minicb nbgrader-course DEST`
(exercises, chapters 01-08).

For a class that already grades with nbgrader (JupyterHub, formgrader, its gradebook
database), DEST becomes an nbgrader course directory:

    DEST/nbgrader_config.py
    DEST/source/<assignment>/<assignment>.ipynb    one assignment per exercise notebook

Each notebook is its source with nbgrader's cell metadata: the exercise's own cell (tagged
`exercise:<name>`) is a solution cell (its `### BEGIN SOLUTION` region becomes nbgrader's
stub, its `# HINT:` comment stays above it), each check cell an autograded test cell worth the
exercise's points, a written answer a manually graded cell worth nothing, and every other cell
is locked. A test cell's last line is `check.score(...)`: the points its cases earned (nbgrader
takes a test cell's numeric value as partial credit, the same share `minicb grade` gives), and
its hidden part, between `### BEGIN HIDDEN TESTS` and `### END HIDDEN TESTS`, sets the seed
of the hidden cases, which `nbgrader generate_assignment` removes and `nbgrader autograde` puts
back. Then, from DEST: `nbgrader generate_assignment 02_static_batching`, `nbgrader autograde
02_static_batching`, `nbgrader generate_feedback 02_static_batching`.
"""

from __future__ import annotations

import argparse
import copy
import re
import secrets
import sys
from pathlib import Path

import nbformat

from minicb.course.exercises import (
    BEGIN,
    END,
    ROOT,
    _clean,
    _hint_lines,
    _regions,
    cell_tags,
    points_of,
    show_points,
)
from minicb.course.grade import case_weights

CHECK_CALL = re.compile(r"^check\.(?P<name>\w+)\((?P<answer>.*)\)\s*$")
CONFIG = '''\
# nbgrader's configuration for the minicb exercises (python -m minicb nbgrader-course).
c = get_config()  # noqa: F821 (nbgrader provides it)
c.CourseDirectory.course_id = "minicb"
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\\nraise NotImplementedError()"}
c.Execute.timeout = 300  # seconds a cell may run
c.Execute.kernel_name = "python3"
'''


def hints_outside(source: str) -> str:
    """A solution cell with each region's `# HINT:` comment moved above its BEGIN marker:
    nbgrader replaces the whole region by its stub, and the hint is for the student."""
    lines = source.split("\n")
    out, last = [], 0
    for begin, end in _regions(lines, "cell"):
        hint = _hint_lines(lines[begin + 1:end])
        out += lines[last:begin] + hint + [lines[begin]]
        out += [line for line in lines[begin + 1:end + 1] if line not in hint]
        last = end + 1
    return "\n".join(out + lines[last:])


def _meta(cell: nbformat.NotebookNode, grade: bool, solution: bool, locked: bool,
          points: float | None = None) -> None:
    meta = {"grade": grade, "grade_id": cell.get("id") or "cell", "locked": locked,
            "schema_version": 3, "solution": solution, "task": False}
    if grade:
        meta["points"] = points or 0
    cell.metadata["nbgrader"] = meta


def test_cell_source(check_source: str, points: float, weights: dict[str, float],
                     hidden_seed: int) -> str:
    """An nbgrader test cell for a check cell (`check.<name>(<answer>)`): the hidden seed
    between nbgrader's hidden-test markers, then the points the check's cases earn."""
    calls = [m for line in check_source.splitlines() if (m := CHECK_CALL.match(line.strip()))]
    if len(calls) != 1:
        raise ValueError(f"a check cell must be one line `check.<name>(answer)`: {check_source!r}")
    name, answer = calls[0]["name"], calls[0]["answer"]
    extra = f", weights={weights!r}" if weights else ""
    shown = int(points) if float(points).is_integer() else points
    return (f"### BEGIN HIDDEN TESTS\ncheck.HIDDEN_SEED = {hidden_seed}\n"
            f"### END HIDDEN TESTS\ncheck.score(check.{name}, {answer}, points={shown}{extra})")


def course_notebook(source: nbformat.NotebookNode, hidden_seed: int) -> nbformat.NotebookNode:
    """One exercise source as an nbgrader source notebook (see the module's docstring)."""
    nb = copy.deepcopy(source)
    points = points_of(nb)
    show_points(nb)
    _clean(nb)
    for cell in nb.cells:
        tags = cell_tags(cell)
        check = next((t.split(":", 1)[1] for t in tags if t.startswith("check:")), None)
        if check is not None and cell.cell_type == "code":
            cell.source = test_cell_source(cell.source, points[check], case_weights(cell),
                                           hidden_seed)
            _meta(cell, grade=True, solution=False, locked=True, points=points[check])
        elif BEGIN in cell.source or END in cell.source:
            if cell.cell_type == "code":
                cell.source = hints_outside(cell.source)
                _meta(cell, grade=False, solution=True, locked=False)
            else:  # a written answer: nbgrader grades markdown answers by hand
                _meta(cell, grade=True, solution=True, locked=False, points=0)
        else:
            _meta(cell, grade=False, solution=False, locked=True)
    return nb


def write_course(dest: Path, hidden_seed: int, root: Path = ROOT) -> list[Path]:
    """Write the nbgrader course into `dest` (see the module's docstring); returns the
    notebooks written."""
    written = []
    for src in sorted((root / "exercises" / "source").glob("*.ipynb")):
        nb = course_notebook(nbformat.read(src, as_version=4), hidden_seed)
        path = dest / "source" / src.stem / src.name
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, path)
        written.append(path)
    (dest / "nbgrader_config.py").write_text(CONFIG)
    return written


def main(argv: list[str] | None = None) -> int:
    """`python -m minicb nbgrader-course DEST [--hidden-seed N]`."""
    parser = argparse.ArgumentParser(
        prog="python -m minicb nbgrader-course",
        description="Write an nbgrader course directory from the exercise sources.")
    parser.add_argument("dest", type=Path, help="the course directory to write (created)")
    parser.add_argument("--hidden-seed", type=int, metavar="N",
                        help="seed of the hidden cases (default: drawn at random, printed); "
                             "it lives only in DEST/source, the teacher's copy")
    args = parser.parse_args(argv)
    if args.dest.resolve() in (ROOT, *ROOT.parents):
        parser.error(f"{args.dest} is the repository or a folder above it: name a new folder")
    seed = args.hidden_seed if args.hidden_seed is not None else secrets.randbelow(10**9)
    written = write_course(args.dest, seed)
    print(f"{len(written)} assignments in {args.dest / 'source'} (hidden seed {seed}); from "
          f"{args.dest}: nbgrader generate_assignment <name>, then autograde and "
          "generate_feedback")
    return 0


if __name__ == "__main__":
    sys.exit(main())
