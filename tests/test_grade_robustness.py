"""The grader against submissions that break its machinery rather than its checks: a worker
process or a kernel that dies, check cells that lost their tags and ids or were pasted twice,
package installs in a cell, a feedback line that says nothing. Notebooks here are a few cells
long and run with short timeouts."""

from __future__ import annotations

import csv
import json

import nbformat
import pytest

from minicb import grade


def write(path, *sources: str):
    """A notebook of code cells `sources` at `path`."""
    nbformat.write(nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(s) for s in sources]), path)
    return path


@pytest.mark.slow
def test_a_dead_worker_fails_only_its_notebook_and_the_gradebook_is_written(tmp_path, capsys):
    """--jobs 2: a notebook whose kernel kills its grading process (as the out-of-memory killer
    would) broke the pool; the grader exited with a BrokenProcessPool traceback and no
    gradebook. Now that notebook is reported as not graded and the others are graded."""
    kill = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"
    paths = [write(tmp_path / "a.ipynb", "print('a')"), write(tmp_path / "b.ipynb", kill),
             write(tmp_path / "c.ipynb", "print('c')")]
    book = tmp_path / "book.csv"
    assert grade.main([*map(str, paths), "--jobs", "2", "--no-restore", "--timeout", "20",
                       "--csv", str(book), "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert [e["notebook"] for e in data] == list(map(str, paths))
    assert "error" not in data[0] and "error" not in data[2]
    assert data[1]["error"] == f"cannot grade {paths[1]}: {grade.WORKER_DIED}"
    with open(book, newline="", encoding="utf-8-sig") as f:
        assert [r["error"] for r in csv.DictReader(f)] == ["", data[1]["error"], ""]


@pytest.mark.slow
def test_a_kernel_that_dies_costs_only_its_own_cell(tmp_path):
    """A cell whose kernel dies (a segfault, the out-of-memory killer; here os._exit) stopped
    the run: every later exercise scored 0. Now the notebook runs again with that cell raising
    an error that says so, and a note names the cell."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in (
        "print('a')", "import os\nos._exit(9)", "print('c')")])
    notes = grade.execute(nb, tmp_path, timeout=20)
    assert notes == [f"cell 2 ('import os') {grade.KERNEL_DIED}; the notebook was run again in "
                     "a fresh kernel with that cell raising RuntimeError"]
    assert "the kernel died while this cell ran (out of memory?)" in grade._error_of(nb.cells[1])
    assert [o.get("text") for o in nb.cells[2].outputs] == ["c\n"]
