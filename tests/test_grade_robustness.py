"""The grader against submissions that break its machinery rather than its checks: a worker
process or a kernel that dies, check cells that lost their tags and ids or were pasted twice,
package installs in a cell, a feedback line that says nothing. Notebooks here are a few cells
long and run with short timeouts."""

from __future__ import annotations

import csv
import json

import nbformat
import pytest

from minicb.course import grade
from minicb.course.exercises import ROOT, cell_tags

PAGED = "01_paged_kv.ipynb"  # page_pool, prefix_hashes, match_prefix, quantize_int8


def paged() -> tuple[nbformat.NotebookNode, nbformat.NotebookNode]:
    """(exercise 01's notebook, its source): only what the student copy has too."""
    return (nbformat.read(ROOT / "exercises" / PAGED, as_version=4),
            nbformat.read(grade.SOURCES / PAGED, as_version=4))


def checks_of(nb) -> dict[str, int]:
    """{exercise: index} of the check cells, once restored."""
    return {name: i for i, name, _ in grade.check_cells(nb)}


def write(path, *sources: str):
    """A notebook of code cells `sources` at `path`."""
    nbformat.write(nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(s) for s in sources]), path)
    return path


@pytest.mark.slow
def test_a_dead_worker_fails_only_its_notebook_and_the_gradebook_is_written(tmp_path, capsys):
    """--jobs 2: a notebook whose kernel kills its grading process (as the out-of-memory killer
    would) is reported as not graded, the others are graded, and the gradebook is written."""
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
    """A cell whose kernel dies (a segfault, the out-of-memory killer; here os._exit) costs only
    that cell: the notebook runs again with that cell raising an error that says so, later cells
    run, and a note names the cell."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in (
        "print('a')", "import os\nos._exit(9)", "print('c')")])
    notes = grade.execute(nb, tmp_path, timeout=20)
    assert notes == [f"cell 2 ('import os') {grade.KERNEL_DIED}; the notebook was run again in "
                     "a fresh kernel with that cell raising RuntimeError"]
    assert "the kernel died while this cell ran (out of memory?)" in grade._error_of(nb.cells[1])
    assert [o.get("text") for o in nb.cells[2].outputs] == ["c\n"]


def test_check_cells_without_tags_or_ids_are_found_by_their_text():
    """A check cell that lost its tag and id (an editor that drops them, or a check cell deleted and
    retyped) is found by its text, or by a cell of nothing but its `check.<name>(` call; a cell
    holding other code beside the call is never taken for it (it may hold the answer)."""
    nb, source = paged()
    for cell in nb.cells:
        cell.metadata.pop("tags", None)
        cell.pop("id", None)
    at = {name: i for i, name, _ in grade.check_cells(source)}
    nb.cells[at["prefix_hashes"]].source = "# mine\ncheck.prefix_hashes(my_prompt_page_hashes) "
    nb.cells[at["match_prefix"]].source = ("my_match_prefix = my_match_prefix\n"
                                           + nb.cells[at["match_prefix"]].source)
    expected, notes = grade.restore_checks(nb, source)
    assert list(checks_of(nb)) == [name for name, _ in expected]
    assert "check cell of 'page_pool' had lost its tag: found by its text, restored from the " \
        "source" in notes
    assert "check cell of 'prefix_hashes' had lost its tag: found by its check.prefix_hashes( " \
        "call, restored from the source" in notes
    mixed = next(c for c in nb.cells if c.source.startswith("my_match_prefix = "))
    assert "match_prefix" not in [grade._check_name(c) for c in nb.cells if c is mixed]
    assert checks_of(nb)["match_prefix"] == grade._index(nb, mixed) + 1  # put back after it
    for name, i in checks_of(nb).items():
        assert nb.cells[i].source == source.cells[at[name]].source


def test_a_deleted_check_cell_is_put_back_after_its_exercise_cell():
    """A deleted check cell is put back after the exercise's own cell (found by tag, id or first
    line), so deleting it earns nothing and costs nothing."""
    nb, source = paged()
    for cell in nb.cells:
        cell.metadata.pop("tags", None)
        cell.pop("id", None)
    nb.cells = [c for c in nb.cells if not c.source.startswith("check.")]
    expected, notes = grade.restore_checks(nb, source)
    assert list(checks_of(nb)) == [name for name, _ in expected]
    first = {name: grade._first_line(source.cells[i - 1]) for i, name, _ in
             grade.check_cells(source)}
    for name, i in checks_of(nb).items():
        assert grade._first_line(nb.cells[i - 1]) == first[name]
        assert f"check cell of {name!r} was not found: put back after the exercise's own " \
            "cell, restored from the source" in notes


def test_an_answer_in_a_pasted_copy_of_a_check_cell_is_kept():
    """A learner's answer written in a pasted copy of a check cell (JupyterLab keeps its tags) is
    kept: the cell with the source's id is the check, the copy keeps its code as an ordinary cell
    and the check runs after it, and an exact copy of the check goes."""
    nb, source = paged()
    at = checks_of(nb)
    answer = nbformat.v4.new_code_cell("class MyPagePool:  # my answer\n    pass",
                                       metadata={"tags": ["check:page_pool", "points:1"]})
    copy = nbformat.v4.new_code_cell(nb.cells[at["match_prefix"]].source,
                                     metadata={"tags": ["check:match_prefix"]})
    nb.cells.insert(at["page_pool"] + 1, answer)
    nb.cells.insert(at["match_prefix"] + 2, copy)
    count = len(nb.cells)
    _, notes = grade.restore_checks(nb, source)
    assert len(nb.cells) == count - 1  # the exact copy dropped
    where = grade._index(nb, answer)
    assert cell_tags(answer) == [] and answer.source.endswith("pass")
    assert checks_of(nb)["page_pool"] == where + 1
    assert nb.cells[where + 1].source == "check.page_pool(MyPagePool)"
    assert "check cell of 'page_pool' was pasted again: the copies' code is kept as ordinary " \
        "cells, the check runs after them" in notes
    assert sum(grade._check_name(c) == "match_prefix" for c in nb.cells) == 1


def test_a_setup_error_note_skips_check_cells_and_names_cells_as_learners_see_them():
    """_first_setup_error leaves check cells out (the grader's own GUARD import is never quoted as
    the learner's setup) and names cells by the numbers a learner sees."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(grade.GUARD + "check.a(f)", metadata={"tags": ["check:b"]}),
        nbformat.v4.new_code_cell("import nump as np"),
        nbformat.v4.new_code_cell("check.a(f)", metadata={"tags": ["check:a"]})])
    for cell in nb.cells[:2]:
        cell.outputs = [nbformat.v4.new_output("error", ename="E", evalue="x", traceback=[])]
    assert grade._first_setup_error(nb, {2}) == [
        "cell 2 ('import nump as np') raised E: x; the cells after it ran without whatever it "
        "should have defined"]


def test_package_installs_never_run_in_the_graders_environment(tmp_path, monkeypatch):
    """`%pip`, `!pip` and `!conda` lines in a submission never run in the grader's environment: they
    become prints saying they were skipped, with a note naming the cells; code that only mentions
    them runs as written."""
    path = write(tmp_path / "a.ipynb", "%pip install torch==1.0\nx = 1",
                 "if x:\n    !pip show torch\n    !conda install numpy", "print('%pip') # !pip")
    ran = []
    monkeypatch.setattr(grade, "execute", lambda nb, *_: ran.extend(
        c.source for c in nb.cells) or [])
    report = grade.grade_notebook(path, restore=False)
    assert ran == ["print('minicb grade: skipped %pip install torch==1.0 (no installs while "
                   "grading)')\nx = 1",
                   "if x:\n    print('minicb grade: skipped !pip show torch (no installs while "
                   "grading)')\n    print('minicb grade: skipped !conda install numpy (no "
                   "installs while grading)')", "print('%pip') # !pip"]
    assert report.notes == ["package installs skipped in cells 1, 2 (they would run in the "
                            "grader's own environment)"]


@pytest.mark.slow
def test_one_huge_print_is_cut_in_the_kernel(tmp_path, monkeypatch):
    """The kernel cuts each cell's printed text a little past the cap, so the grader never receives
    a huge print whole; check marks always pass, and the grader's own cap and note follow."""
    from nbclient import NotebookClient

    monkeypatch.setattr(grade, "MAX_CELL_OUTPUT", 1000)
    sizes = []
    output = NotebookClient.output
    monkeypatch.setattr(NotebookClient, "output", lambda self, outs, msg, *a: sizes.append(
        len(str(msg["content"].get("text", "")))) or output(self, outs, msg, *a))
    mark = grade.MARK.format(nonce="n", name="a")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in (
        "print('x' * 5_000_000)", f"print('y' * 50_000)\nprint({mark!r})", "print('after')")])
    assert grade.execute(nb, tmp_path, timeout=20) == []
    assert max(sizes) < 20_000
    first = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert first.startswith("x" * 1000) and "output past 1,000 characters dropped" in first
    second = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert second == "y" * 11_000 + mark  # cut in the kernel, the mark kept
    assert [o.get("text") for o in nb.cells[2].outputs] == ["after\n"]  # a fresh count
