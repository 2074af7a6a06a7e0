"""The grader (`python -m minicb grade`, exercises 01-08): restoring check cells, scoring by
case, surviving loops, dead kernels and tampering, grading a class into a gradebook per
student with feedback pages, resuming a run, and the nbgrader course. Fast tests stand in for
the kernel (`grade.execute`); slow ones execute notebooks."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
from helpers import EXPECTED, code, tagged

from minicb.course import classroom, exercises, grade
from minicb.course.exercises import ROOT, cell_tags

PAGED = "01_paged_kv.ipynb"  # page_pool, prefix_hashes, match_prefix, quantize_int8


def ran(errors: dict[str, str] | None = None, stopped: tuple[str, ...] = (), counted=True):
    """A stand-in for `grade.execute`: every code cell ran (with an execution count unless not
    `counted`), no check printed its mark, and the cell tagged with a key of `errors` raised
    that error ("Name: value"). Returns the run's notes, `stopped`."""
    def execute(nb, workdir, timeout):
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                cell.execution_count = i + 1 if counted else None
                raised = next((errors[t] for t in cell_tags(cell) if t in (errors or {})), None)
                if raised:
                    ename, _, evalue = raised.partition(": ")
                    cell.outputs = [nbformat.v4.new_output("error", ename=ename, evalue=evalue,
                                                           traceback=[])]
        return list(stopped)
    return execute


def graded(tmp_path, monkeypatch, execute, name: str = PAGED, **kw) -> grade.GradeReport:
    """The untouched exercise notebook `name`, saved as tmp_path/name, graded with `execute`."""
    path = tmp_path / name
    if not path.exists():
        shutil.copy(ROOT / "exercises" / name, path)
    monkeypatch.setattr(grade, "execute", execute)
    return grade.grade_notebook(path, **kw)


def test_check_cells_read_points_tags_and_skip_markdown():
    """check_cells: `points:<n>` may be a decimal (the `(\\.\\d+)?` part dropped made 0.5 a 1),
    the default is 1 point, and a markdown cell tagged `check:` is no check cell."""
    nb = nbformat.v4.new_notebook(cells=[
        code(tags=("check:a", "points:0.5")), code(tags=("check:b",)),
        code("text", ("check:c",), markdown=True)])
    assert grade.check_cells(nb) == [(0, "a", 0.5), (1, "b", 1.0)]


def test_exercise_names_come_from_exercise_tags_too():
    """exercise_names reads `exercise:` tags as well as check calls: a notebook whose check cells
    are deleted (only its `exercise:` stubs left) still names its exercises."""
    nb = nbformat.v4.new_notebook(cells=[code(tags=("exercise:page_pool", "exercise:")),
                                         code("check.match_prefix(m)")])
    assert grade.exercise_names(nb) == {"page_pool", "match_prefix"}


def test_a_notebook_with_no_exercise_name_needs_two_cells_of_a_source(tmp_path):
    """identify_source needs two cells shared with a source to identify an untagged notebook: one
    shared cell ("import torch") identifies nothing."""
    source = nbformat.v4.new_notebook(cells=[code("import torch"), code("x = 1"),
                                             code(tags=("check:a",))])
    nbformat.write(source, tmp_path / "01_a.ipynb")
    one = nbformat.v4.new_notebook(cells=[code("import torch"), code("y = 2")])
    assert grade.identify_source(one, tmp_path) is None
    one.cells.append(code("x = 1"))
    assert grade.identify_source(one, tmp_path) == tmp_path / "01_a.ipynb"


def test_an_edited_check_cell_is_restored_with_a_note():
    """restore_checks put an edited check cell back silently: the teacher never learned that
    a submission had changed one."""
    source = nbformat.v4.new_notebook(cells=[code("check.a(f)", ("check:a",))])
    nb = nbformat.v4.new_notebook(cells=[code("print('ok')", ("check:a",))])
    assert grade.restore_checks(nb, source) == (
        [("a", 1.0)], ["check cell of 'a' was edited: restored from the source"])
    assert nb.cells[0].source == "check.a(f)"


def test_an_error_message_loses_its_colours_and_is_cut_to_max_message():
    """_error_of kept the ANSI colour codes of an error (unreadable in a CSV) and cut a long
    one to MAX_MESSAGE + 3 characters."""
    def error_of(evalue):
        cell = code()
        cell.outputs = [nbformat.v4.new_output("error", ename="CheckFailed", evalue=evalue,
                                               traceback=[])]
        return grade._error_of(cell)
    assert error_of("\x1b[0;31mwrong\x1b[0m answer") == "CheckFailed: wrong answer"
    long = error_of("x" * 2 * grade.MAX_MESSAGE)
    assert len(long) == grade.MAX_MESSAGE and long.endswith("x...")


def test_a_socket_path_of_exactly_max_socket_prefix_bytes_is_used():
    """kernel_config: a socket path of exactly MAX_SOCKET_PREFIX bytes fits (`<=`)."""
    workdir = Path("w" * (grade.MAX_SOCKET_PREFIX - len("/kernel")))
    if os.name == "posix":
        assert grade.kernel_config(workdir).KernelManager.transport == "ipc"


class FakeTimer:
    """threading.Timer that never fires by itself: `made` holds every one started."""
    made: list[FakeTimer] = []

    def __init__(self, interval, function):
        self.interval, self.function, self.cancelled = interval, function, False
        FakeTimer.made.append(self)

    def start(self):
        pass

    def cancel(self):
        self.cancelled = True


def test_a_cell_is_killed_twice_its_timeout_after_it_started_and_pythonpath_restored(
        monkeypatch, tmp_path):
    """_run_kernel's watchdog fires at 2 * timeout + 5 s (a timeout, an interrupt, and as long
    again, so a cell the interrupt is about to stop is not killed); its kill names the running cell,
    and the grader's PYTHONPATH and IPYTHONDIR are undone afterwards."""
    killed = []

    class Client:
        def __init__(self, nb, **kw):
            process = SimpleNamespace(poll=lambda: None, kill=lambda: killed.append(True))
            self.km = SimpleNamespace(provisioner=SimpleNamespace(process=process))

        def execute(self):
            assert os.environ["PYTHONPATH"].split(os.pathsep)[:2] == [str(ROOT), "elsewhere"]
            self.on_cell_execute(cell=None, cell_index=1)
            FakeTimer.made[-1].function()  # the cell outlived its interrupt
            raise RuntimeError("Kernel died")

    monkeypatch.setattr(FakeTimer, "made", [])
    monkeypatch.setattr(threading, "Timer", FakeTimer)
    monkeypatch.setattr(grade, "_capped_client", lambda: Client)
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    monkeypatch.delenv("IPYTHONDIR", raising=False)
    nb = nbformat.v4.new_notebook(cells=[code(), code()])
    assert grade._run_kernel(nb, tmp_path, 7) == (
        1, "ignored the interrupt at 7 s and its kernel was killed")
    assert [t.interval for t in FakeTimer.made] == [19] and FakeTimer.made[0].cancelled
    assert killed and os.environ["PYTHONPATH"] == "elsewhere"
    assert "IPYTHONDIR" not in os.environ


def test_the_check_mark_is_kept_past_the_output_cap():
    """CappedClient drops a cell's output past MAX_CELL_OUTPUT characters with a note, but keeps the
    grader's check mark printed after it, so a check that prints a lot and passes scores."""
    nb = nbformat.v4.new_notebook(cells=[code()])
    client = grade._capped_client()(nb, timeout=5, kernel_name="python3")
    client.clear_before_next_output = False  # what nbclient sets as a cell starts
    outs: list = []

    def say(text):
        client.output(outs, {"msg_type": "stream", "header": {"msg_type": "stream"},
                             "parent_header": {}, "content": {"name": "stdout", "text": text}},
                      None, 0)
    mark = grade.MARK.format(nonce="n0", name="a")
    for text in ("x" * (grade.MAX_CELL_OUTPUT - 10), "y" * 100, "z" * 100, mark):
        say(text)
    assert [o.text for o in outs] == [
        "x" * (grade.MAX_CELL_OUTPUT - 10), "y" * 10,
        f"[minicb grade: output past {grade.MAX_CELL_OUTPUT:,} characters dropped]\n", mark]
    assert grade._printed(nb.cells[0] | {"outputs": outs}, mark)


def test_the_named_like_note_is_left_out_when_the_source_was_given(tmp_path, monkeypatch):
    """Exercise 3's notebook saved as 02_...: graded as 03 with a note saying so; with --source
    naming 03 the teacher chose it, and "named like ..., graded as those" is not said."""
    three = "03_continuous_batching.ipynb"
    shutil.copy(ROOT / "exercises" / three, tmp_path / "02_static_batching.ipynb")
    guessed = graded(tmp_path, monkeypatch, ran(), "02_static_batching.ipynb")
    assert guessed.source == Path(three).stem
    assert guessed.notes[0].startswith("named like 02_static_batching.ipynb, but it holds the "
                                       f"exercises of {three}: graded as those")
    given = graded(tmp_path, monkeypatch, ran(), "02_static_batching.ipynb",
                   source=grade.SOURCES / three)
    assert not any(n.startswith("named like") for n in given.notes)
    assert given.notes[0].startswith("check cells restored from ")


def test_a_cell_with_output_but_no_execution_count_ran(tmp_path, monkeypatch):
    """A cell whose output came but whose execution count did not (the kernel stopped as it
    ran) counts as run: its error is the exercise's message, and the notebook is graded, not
    refused as "its kernel ran no cell"."""
    report = graded(tmp_path, monkeypatch, ran({"check:page_pool": "CheckFailed: wrong"},
                                               stopped=("execution stopped: killed",),
                                               counted=False))
    assert report.exercises[0].message == "CheckFailed: wrong"


def test_a_check_is_blamed_on_its_own_exercise_only(tmp_path, monkeypatch):
    """A NameError in a check follows the error of a cell since the previous check cell, never one
    before it (not the previous check's own failure); an ImportError is explained the same way as a
    NameError."""
    report = graded(tmp_path, monkeypatch, ran({
        "check:page_pool": "CheckFailed: wrong", "check:prefix_hashes": "NameError: name 'h'",
        "exercise:match_prefix": "SyntaxError: bad", "check:match_prefix": "ImportError: m"}))
    messages = [e.message for e in report.exercises]
    assert messages[:3] == ["CheckFailed: wrong", "NameError: name 'h'",
                            "SyntaxError: bad  (then the check failed with ImportError)"]


def test_a_deleted_check_cell_still_counts_its_points_in_the_maximum(tmp_path, monkeypatch):
    """A missing check cell scores 0 of its points (not 0 of 0): deleting a check cell must not
    shrink the maximum score. (Deleted with the exercise's own cell, so it cannot be put back.)"""
    nb = nbformat.read(ROOT / "exercises" / PAGED, as_version=4)
    nb.cells = [c for c in nb.cells
                if not {"check:page_pool", "exercise:page_pool"} & set(cell_tags(c))]
    nbformat.write(nb, tmp_path / PAGED)
    report = graded(tmp_path, monkeypatch, ran())
    assert (report.exercises[0].message, report.max_score) == ("its check cell is missing", 4)


def test_a_check_tag_moved_to_another_cell_is_restored_where_it_now_is():
    """restore_checks finds a check by its tag before its cell id: when the learner tags another
    cell `check:a`, that cell gets the source's check text back and the original untagged cell is
    not taken for the check."""
    source = nbformat.v4.new_notebook(cells=[code("check.a(f)", ("check:a",))])
    nb = nbformat.v4.new_notebook(cells=[code("check.a(f)"), code("pass", ("check:a",))])
    nb.cells[0].id = source.cells[0].id
    grade.restore_checks(nb, source)
    assert [nb.cells[i].source for i, _, _ in grade.check_cells(nb)] == ["check.a(f)"]


def test_a_multi_line_failure_is_indented_under_its_exercise():
    """format_report printed only the first line of a failure's message."""
    report = grade.GradeReport("a.ipynb", [grade.ExerciseResult("a", 0, 1, False,
                                                                "CheckFailed: one\ntwo")])
    assert grade.format_report(report).endswith("0/1  CheckFailed: one\n      two\n  total: 0/1")


def test_a_gradebook_cell_starting_with_at_tab_or_return_is_text(tmp_path):
    """A CSV cell starting with = + - @, a tab or a carriage return is written as text (a
    leading apostrophe), so a spreadsheet never runs it as a formula. No rows: an empty
    file."""
    book = tmp_path / "book.csv"
    classroom.write_csv(book, [{"a": "@SUM(A1)", "b": "\tx", "c": "\ry", "d": "ok", "e": 3}])
    with open(book, newline="", encoding="utf-8-sig") as f:
        assert list(csv.DictReader(f)) == [{"a": "'@SUM(A1)", "b": "'\tx", "c": "'\ry",
                                            "d": "ok", "e": "3"}]
    classroom.write_csv(book, [])
    assert book.read_text(encoding="utf-8-sig") == ""


def test_notebooks_in_sorts_and_leaves_out_only_checkpoints_below_the_folder(tmp_path):
    """notebooks_in: a folder's notebooks in name order (not the file system's), checkpoint
    copies below the folder left out, but a folder given inside .ipynb_checkpoints is
    searched (the filter looked at the whole path, so it found nothing)."""
    folder = tmp_path / "class"
    names = ["m.ipynb", "z.ipynb", "a.ipynb", "q/b.ipynb", "c.ipynb", "y.ipynb", "k.ipynb"]
    for name in names + [".ipynb_checkpoints/a-checkpoint.ipynb"]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("{}")
    assert grade.notebooks_in([folder]) == sorted(folder / n for n in names)
    kept = tmp_path / ".ipynb_checkpoints" / "old"
    kept.mkdir(parents=True)
    (kept / "x.ipynb").write_text("{}")
    assert grade.notebooks_in([kept]) == [kept / "x.ipynb"]


@pytest.mark.parametrize("args", [["--jobs", "0"], ["--csv", "book.ipynb"], [],
                                  ["--timeout", "0"], ["--timeout", "-1"]])
def test_bad_arguments_are_refused_before_grading(tmp_path, monkeypatch, args):
    """main: --jobs 0, a --csv file named .ipynb, a folder without a notebook and a --timeout
    under 1 s stop with a usage error before anything is graded (each check dropped graded or
    overwrote instead; --timeout 0 killed the kernel of any cell running a few seconds)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(grade, "grade_notebook", lambda *a, **kw: pytest.fail("graded"))
    notebook = tmp_path / "x.ipynb"
    if args:
        notebook.write_text("{}")
    with pytest.raises(SystemExit):
        grade.main([str(tmp_path), *args])


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_solution_notebook_grades_full_marks_with_no_notes(name):
    """Each solution notebook grades full marks with no notes."""
    report = grade.grade_notebook(ROOT / "solutions" / name)
    assert report.exercises and report.score == report.max_score, grade.format_report(report)
    assert report.notes == []


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_untouched_exercise_notebook_grades_zero_with_a_message_each(name, capsys):
    """An untouched exercise notebook scores 0 on every check of its source, each with a "write ..."
    message naming the exercise and marked not attempted, and its setup cell runs."""
    assert grade.main([str(ROOT / "exercises" / name), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    source = nbformat.read(ROOT / "exercises" / "source" / name, as_version=4)
    assert [e["name"] for e in data["exercises"]] == list(tagged(source, "check"))
    assert data["score"] == 0 and data["max_score"] >= len(data["exercises"]) >= 2
    for e in data["exercises"]:
        assert not e["passed"] and e["points"] == 0
        assert e["message"].startswith("NotImplementedError: write "), e
        assert f"(exercise {e['name']})" in e["message"]
        assert e["attempted"] is False  # a gradebook tells "not attempted" from "wrong"
    assert not any("raised" in note for note in data["notes"])  # the setup cell ran


@pytest.mark.slow
def test_a_broken_setup_cell_is_named_and_costs_only_what_needs_it(tmp_path, capsys):
    """A typo in the first cell (`import numpyy`) costs only the exercises that need that cell:
    the others still score (the check module the grader loads is registered for its dataclasses),
    and a note names the cell that broke."""
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    setup = next(c for c in nb.cells if c.cell_type == "code")
    setup.source = "import numpyy\n" + setup.source
    path = tmp_path / EXPECTED[0]
    nbformat.write(nb, path)
    assert grade.main([str(path), "--json", "--timeout", "60"]) == 0
    data = json.loads(capsys.readouterr().out)
    results = {e["name"]: e for e in data["exercises"]}
    assert results["page_pool"]["passed"]
    assert not any("NoneType" in e["message"] for e in data["exercises"])
    assert all(e["attempted"] for e in data["exercises"])
    assert any("('import numpyy') raised ModuleNotFoundError" in note for note in data["notes"])


@pytest.mark.slow
def test_grader_restores_checks_and_survives_endless_loops(tmp_path, capsys):
    """The grader restores an edited check cell, puts back a deleted one after its exercise,
    interrupts an endless loop after the timeout and grades the rest; a missing notebook exits
    with status 2."""
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    checks = tagged(nb, "check")
    nb.cells[checks["page_pool"]].source = "print('trust me')"  # edited: restored, still passes
    stubs = tagged(nb, "exercise")
    nb.cells[stubs["match_prefix"]].source = (
        "def my_match_prefix(cached, token_ids, page_size):\n    while True:\n        pass")
    del nb.cells[checks["prefix_hashes"]]
    assert grade.source_for(tmp_path / EXPECTED[0]) == ROOT / "exercises" / "source" / EXPECTED[0]
    path = tmp_path / "alice.ipynb"  # a renamed submission: name its source
    nbformat.write(nb, path)
    source = ROOT / "exercises" / "source" / EXPECTED[0]
    # a timeout of a few seconds can interrupt the import cell on a loaded machine
    assert grade.main([str(path), "--timeout", "15", "--source", str(source)]) == 0
    out = capsys.readouterr().out
    assert "✓ page_pool" in out and "✓ quantize_int8" in out and "total: 3/4" in out
    assert "check cell of 'page_pool' was edited: restored from the source" in out
    assert "✓ prefix_hashes" in out and "check cell of 'prefix_hashes' was not found: put " \
        "back after the exercise's own cell" in out  # deleted: it earns nothing by that
    assert "KeyboardInterrupt" in out and "longer than 15 s" in out
    assert grade.main([str(tmp_path / "missing.ipynb")]) == 2


@pytest.mark.slow
def test_a_cell_that_swallows_the_interrupt_is_killed_and_the_rest_still_graded(tmp_path,
                                                                              capsys):
    """A cell catching KeyboardInterrupt in a loop has its kernel killed one timeout after the
    interrupt; the notebook runs again in a fresh kernel with that cell raising TimeoutError,
    and the exercises before and after it keep their points. The learner's notebook names a
    kernel this machine lacks: the grader runs its own."""
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    nb.metadata["kernelspec"] = {"name": "some-env-of-mine", "display_name": "mine",
                                 "language": "python"}
    stubs = tagged(nb, "exercise")
    nb.cells[stubs["match_prefix"]].source = (
        "import time\nwhile True:\n    try:\n        time.sleep(60)\n"
        "    except BaseException:\n        print('not stopping')")
    path = tmp_path / EXPECTED[0]
    nbformat.write(nb, path)
    t0 = time.monotonic()
    # 15 s: the cell importing torch needs several seconds on a loaded machine
    assert grade.main([str(path), "--timeout", "15"]) == 0
    assert time.monotonic() - t0 < 120
    out = capsys.readouterr().out
    assert "✓ page_pool" in out and "✓ prefix_hashes" in out and "✓ quantize_int8" in out
    assert "total: 3/4" in out and "TimeoutError" in out
    assert "('import time') ignored the interrupt at 15 s and its kernel was killed; the " \
           "notebook was run again in a fresh kernel" in out
    assert "execution stopped" not in out
    assert "reported no error but did not run to its end" not in out


def test_malformed_tags_and_batches_do_not_stop_the_grader(tmp_path, capsys):
    """A hand-edited notebook may hold `"tags": null`; a notebook that cannot be graded is
    reported and the others still are; --json gives a list whenever several were asked, with
    an entry saying why for each notebook that could not be graded (they were left out)."""
    assert exercises.cell_tags({"metadata": {"tags": None}}) == []
    assert exercises.cell_tags({"metadata": None}) == []
    assert exercises.cell_tags({"metadata": {"tags": ["check", 3]}}) == ["check"]
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{not json")
    assert grade.main(["--json", str(bad), str(tmp_path / "missing.ipynb")]) == 2
    data = json.loads(capsys.readouterr().out)
    assert [e["notebook"] for e in data] == [str(bad), str(tmp_path / "missing.ipynb")]
    assert all(set(e) == {"student", "notebook", "error"} and "cannot read" in e["error"]
               for e in data)
    assert grade.main(["--json", str(bad)]) == 2  # one notebook: the object itself
    assert json.loads(capsys.readouterr().out)["error"].startswith(f"cannot read {bad}")


def test_the_notebook_table_has_a_row_per_notebook_and_a_column_per_exercise():
    """Submissions of two exercise sets share one sheet: a column for every exercise, blank
    where a notebook has none, the first line of each failure; a notebook that could not be
    graded keeps its row (with why), in the order the notebooks were given."""
    R, E = grade.GradeReport, grade.ExerciseResult
    failed = E("static_finish_steps", 0, 1, False, "CheckFailed: R2 finishes at 9\nmore")
    alice = R("alice.ipynb", [E("static_batch", 1, 1, True), failed], seconds=12.34,
              source="02_static_batching")
    bob = R("bob.ipynb", [E("page_pool", 1, 1, True), E("quantize_int8", 0.5, 1, False, ""),
                          E("match_prefix", 0, 1, False, "NotImplementedError: write it",
                            attempted=False)],
            source="01_paged_kv", notes=["kernel died"])
    rows = grade.notebook_rows([alice, bob], {"carol.ipynb": "cannot read carol.ipynb"},
                               order=["carol.ipynb", "bob.ipynb", "alice.ipynb"])
    assert [r["notebook"] for r in rows] == ["carol.ipynb", "bob.ipynb", "alice.ipynb"]
    assert list(rows[0]) == ["student", "notebook", "source", "score", "max_score", "page_pool",
                             "quantize_int8", "match_prefix", "static_batch",
                             "static_finish_steps", "seconds", "error", "not_attempted",
                             "feedback", "notes"]  # exercises in the sources' order
    carol, bob_row, alice_row = rows
    assert carol["error"] == "cannot read carol.ipynb" and carol["score"] == ""
    assert (bob_row["score"], bob_row["max_score"], bob_row["quantize_int8"]) == (1.5, 3, 0.5)
    assert bob_row["not_attempted"] == "match_prefix" and alice_row["not_attempted"] == ""
    assert bob_row["static_batch"] == "" and bob_row["notes"] == "kernel died"
    assert (alice_row["score"], alice_row["page_pool"], alice_row["seconds"]) == (1, "", 12.3)
    assert alice_row["feedback"] == "static_finish_steps: CheckFailed: R2 finishes at 9"
    assert [r["notebook"] for r in grade.notebook_rows([alice, bob])] == \
        ["alice.ipynb", "bob.ipynb"]


@pytest.mark.slow
def test_a_class_is_graded_two_at_a_time_into_a_gradebook(tmp_path, capfd):
    """`--jobs 2 --csv` on a folder of submissions (one folder per student, Jupyter's
    checkpoint copies left out): each notebook graded in its own process, reports printed in
    name order, a spreadsheet with every submission, the unreadable one included. The kernels
    talk over Unix sockets: no warning per kernel that TCP is unencrypted."""
    folder = tmp_path / "submissions"
    for student, source in [("alice", "solutions"), ("bob", "exercises")]:
        (folder / student).mkdir(parents=True)
        shutil.copy(ROOT / source / EXPECTED[student == "bob"], folder / student)
    (folder / "carol").mkdir()
    (folder / "carol" / EXPECTED[0]).write_text("{not json")
    (folder / "alice" / ".ipynb_checkpoints").mkdir()
    (folder / "alice" / ".ipynb_checkpoints" / "old-checkpoint.ipynb").write_text("{not json")
    paths = [str(folder / s / EXPECTED[s == "bob"]) for s in ("alice", "bob", "carol")]
    book = tmp_path / "gradebook.csv"
    assert grade.main([str(folder), "--jobs", "2", "--csv", str(book), "--timeout", "60"]) == 2
    out, err = capfd.readouterr()
    assert out.index("alice") < out.index("bob") and "total: 4/4" in out
    assert "without encryption" not in err and "table: " in err
    with open(book, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    assert [r["notebook"] for r in rows] == paths
    alice, bob, carol = rows
    assert (alice["source"], alice["score"], alice["page_pool"]) == ("01_paged_kv", "4", "1")
    assert alice["static_batch"] == "" and bob["page_pool"] == ""
    assert bob["source"] == Path(EXPECTED[1]).stem and bob["score"] == "0"
    assert bob["static_batch"] == "0" and "static_batch: NotImplementedError" in bob["feedback"]
    assert carol["score"] == "" and carol["error"].startswith("cannot read")
    with pytest.raises(SystemExit):
        grade.main([paths[0], "--jobs", "0"])
    with pytest.raises(SystemExit):
        grade.main([paths[0], "--csv", paths[1]])  # would overwrite a notebook
    with pytest.raises(SystemExit):
        grade.main([str((tmp_path / "empty").mkdir() or tmp_path / "empty")])  # no notebook


def test_each_notebook_is_graded_once_and_the_gradebook_is_safe_in_a_spreadsheet(tmp_path):
    """A folder and a file in it, or `a.ipynb` and `./a.ipynb`, name one notebook: graded once.
    The CSV starts with a byte-order mark (a spreadsheet on Windows then reads UTF-8), and a
    cell that would run as a formula (a file named `=HYPERLINK(...)`) is written as text."""
    folder = tmp_path / "class"
    (folder / "a").mkdir(parents=True)
    for name in ("a/x.ipynb", "b.ipynb"):
        (folder / name).write_text("{}")
    found = grade.notebooks_in([folder / "a" / "x.ipynb", folder, folder / "a" / ".." / "b.ipynb"])
    assert found == [folder / "a" / "x.ipynb", folder / "b.ipynb"]
    book = tmp_path / "book.csv"
    rows = grade.notebook_rows([grade.GradeReport("=HYPERLINK(\"http://x\").ipynb", source="é")],
                           {"-bad.ipynb": "+cannot read"})
    classroom.write_csv(book, rows)
    raw = book.read_bytes()
    assert raw.startswith(b"\xef\xbb\xbf")
    with open(book, newline="", encoding="utf-8-sig") as f:
        first, second = csv.DictReader(f)
    assert first["notebook"] == "'=HYPERLINK(\"http://x\").ipynb" and first["source"] == "é"
    assert second["notebook"] == "'-bad.ipynb" and second["error"] == "'+cannot read"
    with pytest.raises(SystemExit):  # checked before grading, so no run is lost
        grade.main([str(folder), "--csv", str(tmp_path / "no-such-folder" / "book.csv")])


def test_kernels_use_unix_sockets_unless_the_path_is_too_long(tmp_path):
    """Grading kernels talk over a Unix socket in the work folder, and fall back to TCP when the
    socket path is too long to bind."""
    short = grade.kernel_config(tmp_path)
    assert short.KernelManager.transport == "ipc"
    assert short.KernelManager.ip == str(tmp_path / "kernel")
    long_path = tmp_path / ("x" * 100)  # a socket path past ~107 bytes cannot be bound
    assert "transport" not in grade.kernel_config(long_path).KernelManager


def test_a_kernel_that_ran_no_cell_is_not_a_score_of_zero(tmp_path, monkeypatch, capsys):
    """A kernel that never started (a socket it could not bind, a broken environment) is an
    error row, not zeros for a student."""
    path = tmp_path / EXPECTED[1]
    shutil.copy(ROOT / "solutions" / EXPECTED[1], path)
    monkeypatch.setattr(grade, "execute",
                        lambda nb, workdir, timeout: ["execution stopped: ZMQError: too long"])
    with pytest.raises(grade.GradeError, match="its kernel ran no cell .*ZMQError"):
        grade.grade_notebook(path)
    assert grade.main([str(path), "--json"]) == 2
    entry = json.loads(capsys.readouterr().out)  # an error entry, not a list without it
    assert entry["notebook"] == str(path) and "ran no cell" in entry["error"]


def test_an_interrupted_run_stops_and_keeps_what_was_graded(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the second of three notebooks runs: the first keeps its score, the others
    are rows saying they were not graded, the exit status is 130, nothing more is graded."""
    for i in range(3):
        shutil.copy(ROOT / "solutions" / EXPECTED[1], tmp_path / f"s{i}.ipynb")
    calls = []
    fake = fake_execute({})

    def execute(nb, workdir, timeout):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return fake(nb, workdir, timeout)

    monkeypatch.setattr(grade, "execute", execute)
    book = tmp_path / "book.csv"
    assert grade.main([str(tmp_path), "--csv", str(book), "--source",
                       str(ROOT / "exercises" / "source" / EXPECTED[1])]) == 130
    assert len(calls) == 2
    with open(book, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    assert [(r["score"], r["error"]) for r in rows] == [
        ("2", ""), ("", "not graded: the run was interrupted (Ctrl-C)"),
        ("", "not graded: the run was interrupted (Ctrl-C)")]


@pytest.mark.slow
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_ctrl_c_stops_a_real_grading_run_at_once(tmp_path, jobs):
    """A teacher's Ctrl-C reaches the grader, its workers and their kernels (one process
    group). nbclient takes SIGINT to shut its kernel down; the grader then stops instead of
    scoring that notebook 0 and going on, and with --jobs stops its workers."""
    import signal
    import subprocess
    import sys

    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    started = tmp_path / "started"
    nb.cells.insert(1, nbformat.v4.new_code_cell(
        f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(60)"))
    for i in range(3):
        nbformat.write(nb, tmp_path / f"s{i}.ipynb")
    book = tmp_path / "book.csv"
    run = subprocess.Popen(
        [sys.executable, "-m", "minicb", "grade", *(str(tmp_path / f"s{i}.ipynb")
                                                   for i in range(3)),
         "--jobs", jobs, "--csv", str(book), "--source",
         str(ROOT / "exercises" / "source" / EXPECTED[0])],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    os.killpg(run.pid, signal.SIGINT)
    t0 = time.monotonic()
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err.decode()[-2000:]
    assert time.monotonic() - t0 < 30  # not after the 60 s cells, nor the other notebooks
    with open(book, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and all(r["error"].startswith("not graded: the run was interrupted")
                                  for r in rows)


def untagged(nb):
    """The notebook with every cell tag removed (ids and sources kept)."""
    for cell in nb.cells:
        cell.get("metadata", {}).pop("tags", None)
    return nb


def test_a_notebook_is_identified_by_its_content():
    """A renamed submission still names its source: by its tags and check calls, and with
    every tag stripped and every check cell replaced, by the cells it left as they were."""
    for folder in ("exercises", "solutions"):
        for name in EXPECTED:
            nb = nbformat.read(ROOT / folder / name, as_version=4)
            source = ROOT / "exercises" / "source" / name
            assert grade.source_for(ROOT / "submissions" / "alice.ipynb", nb) == source
            for index in tagged(nb, "check").values():
                nb.cells[index].source = "print('✓ passed')"
            assert grade.identify_source(untagged(nb)) == source, (folder, name)
    chapter = nbformat.read(ROOT / "chapters" / "04_chunked_prefill.ipynb", as_version=4)
    assert grade.identify_source(chapter) is None
    mixed = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "check.next_chunk(next_chunk)\ncheck.latencies(latencies)")])
    assert grade.identify_source(mixed) is None  # two sources tie: refuse to guess


def test_restore_checks_puts_the_sources_check_cells_back():
    """In memory, no kernel: an edited check cell gets the source's text back, an untagged
    one is found by its id, a deleted one is put back after its exercise's cell, and one
    deleted with that cell is reported missing."""
    source = nbformat.read(ROOT / "exercises" / "source" / EXPECTED[0], as_version=4)
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    checks = tagged(source, "check")
    first, second, third, fourth = checks
    nb.cells[checks[first]].source = "print('✓ passed')"
    nb.cells[checks[second]].metadata["tags"] = []
    nb.cells[checks[second]].source = "pass"
    del nb.cells[checks[fourth]], nb.cells[checks[fourth] - 1]  # check and stub
    del nb.cells[checks[third]]
    expected, notes = grade.restore_checks(nb, source)
    assert [name for name, _ in expected] == list(checks)
    restored = {name: nb.cells[i].source for i, name, _ in grade.check_cells(nb)}
    assert restored[first] == source.cells[checks[first]].source
    assert restored[second] == source.cells[checks[second]].source
    assert restored[third] == source.cells[checks[third]].source
    at = {name: i for i, name, _ in grade.check_cells(nb)}
    assert tagged(nb, "exercise")[third] == at[third] - 1
    assert fourth not in restored
    assert f"check cell of {fourth!r} is missing: that exercise scores 0" in notes


def test_a_check_cell_retagged_as_another_exercise_serves_only_that_one():
    """A learner re-tags the first check cell as the second exercise's and deletes the
    second's: that cell is the second exercise's check (restored), and the first exercise's
    check is put back after its own cell. Finding the first by its cell id as well would make
    one cell stand for two exercises."""
    source = nbformat.read(ROOT / "exercises" / "source" / EXPECTED[0], as_version=4)
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    checks = tagged(source, "check")
    first, second, *_ = checks
    nb.cells[checks[first]].metadata["tags"] = [f"check:{second}"]
    del nb.cells[checks[second]]
    _, notes = grade.restore_checks(nb, source)
    restored = {name: i for i, name, _ in grade.check_cells(nb)}
    assert restored[first] != restored[second]
    assert restored[first] == tagged(nb, "exercise")[first] + 1
    assert f"check cell of {first!r} was not found: put back after the exercise's own cell, " \
        "restored from the source" in notes
    assert nb.cells[restored[second]].source == source.cells[checks[second]].source


def test_a_notebook_saved_under_another_exercises_name_is_graded_as_what_it_holds():
    """Exercise 3's work saved as 02_static_batching.ipynb names only exercise 3's checks: it
    is graded as exercise 3. A file that names its own exercises keeps its name's source."""
    source = ROOT / "exercises" / "source"
    for folder in ("exercises", "solutions"):
        nb = nbformat.read(ROOT / folder / EXPECTED[2], as_version=4)
        assert grade.source_for(ROOT / "submissions" / EXPECTED[1], nb) == source / EXPECTED[2]
        own = nbformat.read(ROOT / folder / EXPECTED[1], as_version=4)
        assert grade.source_for(ROOT / "submissions" / EXPECTED[1], own) == source / EXPECTED[1]
        own.cells += nb.cells  # both exercises' cells: its name decides
        assert grade.source_for(ROOT / "submissions" / EXPECTED[1], own) == source / EXPECTED[1]


@pytest.mark.slow
def test_endless_printing_is_capped(tmp_path):
    """A cell that prints 6 MB keeps about MAX_CELL_OUTPUT characters and a note; the cells
    after it run and keep their output."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("for i in range(60_000):\n    print('x' * 99)"),
        nbformat.v4.new_code_cell("print('after')")])
    assert grade.execute(nb, tmp_path, timeout=60) == []
    first = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert grade.MAX_CELL_OUTPUT - 10_000 < len(first) < grade.MAX_CELL_OUTPUT + 200
    assert "output past 1,000,000 characters dropped" in first
    assert [o.get("text") for o in nb.cells[1].outputs] == ["after\n"]


def test_a_notebook_of_unknown_source_is_refused(tmp_path, capsys):
    """No source, no grade: the grader never scores a notebook by its own check cells."""
    nb = nbformat.read(ROOT / "chapters" / "04_chunked_prefill.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("print('✓ passed')",  # a check of its own
                                              metadata={"tags": ["check:homework"]}))
    path = tmp_path / "alice.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(grade.GradeError, match="--source"):
        grade.grade_notebook(path)
    assert grade.main([str(path), "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["notebook"] == str(path)
    assert "cannot tell which exercise notebook" in captured.err and "--source" in captured.err
    missing = tmp_path / "nowhere.ipynb"
    with pytest.raises(grade.GradeError, match="cannot read the source"):
        grade.grade_notebook(path, source=missing)


@pytest.mark.slow
def test_a_renamed_tampered_submission_scores_zero(tmp_path, capsys):
    """Check cells replaced by a print in a notebook named alice.ipynb, no --source: the
    source is found from the content, the checks are restored, the stubs score 0."""
    nb = nbformat.read(ROOT / "exercises" / EXPECTED[1], as_version=4)
    checks = tagged(nb, "check")
    for index in checks.values():
        nb.cells[index].source = "print('✓ passed')"
    path = tmp_path / "alice.ipynb"
    nbformat.write(nb, path)
    assert grade.main([str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in data["exercises"]] == list(checks)
    assert data["score"] == 0 and data["max_score"] == len(checks)
    assert all(e["message"].startswith("NotImplementedError: ") for e in data["exercises"])
    assert f"check cells restored from exercises/source/{EXPECTED[1]}" in data["notes"]
    for name in checks:
        assert f"check cell of {name!r} was edited: restored from the source" in data["notes"]


@pytest.mark.slow
def test_a_removed_check_tag_does_not_drop_the_exercise(tmp_path):
    """Untagged check cells are found by their cell id and restored; one that lost its tag,
    its id and its text is put back after its exercise's cell, never left out of the report."""
    nb = untagged(nbformat.read(ROOT / "solutions" / EXPECTED[1], as_version=4))
    source = nbformat.read(ROOT / "exercises" / "source" / EXPECTED[1], as_version=4)
    checks = tagged(source, "check")
    first, second = checks  # static_batch, static_finish_steps
    nb.cells[checks[first]].source = "print('✓ passed')"  # untagged and edited: restored
    nb.cells[checks[second]]["id"] = "mine"  # untagged, new id, new text: cannot be found
    nb.cells[checks[second]].source = "pass"
    path = tmp_path / "carol.ipynb"
    nbformat.write(nb, path)
    report = grade.grade_notebook(path)
    by_name = {e.name: e for e in report.exercises}
    assert list(by_name) == [first, second], grade.format_report(report)
    assert by_name[first].passed and by_name[second].passed
    assert f"check cell of {first!r} had lost its tag: found by its cell id, restored from " \
           "the source" in report.notes
    assert f"check cell of {second!r} was not found: put back after the exercise's own cell, " \
           "restored from the source" in report.notes


@pytest.mark.slow
def test_an_earlier_cell_cannot_patch_the_checks_away(tmp_path):
    """A cell that replaces `check.pd_scheduler` changes nothing (the check cell loads a fresh
    minicb.course.check), and one that silences errors scores 0 (the check never printed its mark);
    the same patches leave a solution notebook at full marks."""
    for folder, full in (("exercises", False), ("solutions", True)):
        nb = nbformat.read(ROOT / folder / EXPECTED[4], as_version=4)
        stubs = tagged(nb, "exercise")
        nb.cells.insert(stubs["dec_at_p"], nbformat.v4.new_code_cell(
            "get_ipython().set_custom_exc((Exception,), lambda *a, **k: None)"))
        nb.cells.insert(stubs["pd_scheduler"], nbformat.v4.new_code_cell(
            'setattr(check, "pd_scheduler", lambda *a, **k: None)\n'
            "import minicb.course.check\nminicb.check.pd_scheduler = check.pd_scheduler"))
        path = tmp_path / EXPECTED[4]
        nbformat.write(nb, path)
        report = grade.grade_notebook(path)
        by_name = {e.name: e for e in report.exercises}
        assert list(by_name) == ["pd_scheduler", "dec_at_p", "short_p"]
        if full:
            assert report.score == report.max_score == 4, grade.format_report(report)
            continue
        assert report.score == 0, grade.format_report(report)
        assert by_name["pd_scheduler"].message.startswith("NotImplementedError: write ")
        for name in ("dec_at_p", "short_p"):
            assert "did not run to its end" in by_name[name].message


def fake_execute(outcome: dict[str, str]):
    """A stand-in for `grade.execute` (no kernel): every code cell counts as run. A cell tagged
    `check:<name>` or `exercise:<name>` does what `outcome[tag]` says: "pass" (a check cell's
    default) prints the grader's mark (a restored check cell's last line) or, unrestored,
    "passed"; "silent" ends with no mark and no error (an earlier cell swallowed errors);
    any other value is the error it raises, "Name: message"."""
    def execute(nb, workdir, timeout):
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            cell.execution_count = i + 1
            tag = next((t for t in cell_tags(cell) if t.startswith(("check:", "exercise:"))),
                       "")
            what = outcome.get(tag, "pass" if tag.startswith("check:") else "silent")
            if what == "pass":
                mark = re.search(r"print\('(minicb-grade-check-done:[^']*)'\)\s*$",
                                 cell.source)
                cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=(
                    mark.group(1) if mark else "passed") + "\n")]
            elif what != "silent":
                ename, _, evalue = what.partition(": ")
                cell.outputs = [nbformat.v4.new_output("error", ename=ename, evalue=evalue,
                                                       traceback=[])]
        return []
    return execute


def test_scores_follow_the_check_cells_marks_and_points(tmp_path, monkeypatch):
    """In memory, no kernel: a passing check earns its `points:<n>` (pd_scheduler is worth 2),
    a failing one 0 with its error, and one that ended without printing the grader's mark
    (errors silenced by an earlier cell) 0, even though it raised nothing."""
    name = EXPECTED[4]  # pd_scheduler (2 points), dec_at_p, short_p
    path = tmp_path / name
    shutil.copy(ROOT / "solutions" / name, path)
    monkeypatch.setattr(grade, "execute", fake_execute({
        "check:dec_at_p": "CheckFailed: wrong answer", "check:short_p": "silent"}))
    report = grade.grade_notebook(path)
    got = {e.name: (e.points, e.max_points, e.passed) for e in report.exercises}
    assert got == {"pd_scheduler": (2, 2, True), "dec_at_p": (0, 1, False),
                   "short_p": (0, 1, False)}
    assert (report.score, report.max_score) == (2, 4)
    by_name = {e.name: e for e in report.exercises}
    assert by_name["dec_at_p"].message == "CheckFailed: wrong answer"
    assert "did not run to its end" in by_name["short_p"].message
    assert "total: 2/4" in grade.format_report(report)
    # --no-restore: no mark is asked for, so the silent check passes (proves nothing)
    assert grade.grade_notebook(path, restore=False).score == 3


def test_a_killed_kernel_is_restarted_with_its_cell_raising_at_most_max_restarts_times(
        tmp_path, monkeypatch):
    """In memory, no kernel: each run that ends with a killed kernel is followed by a run in
    which that cell raises TimeoutError; the notes name each killed cell (an exercise's check
    cell by its exercise's name); after MAX_RESTARTS restarts the run is graded as stopped."""
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    stub = tagged(nb, "exercise")["match_prefix"]
    check_cell = tagged(nb, "check")["quantize_int8"]
    runs = []

    def run_kernel(nb, workdir, timeout):
        runs.append([c.source for c in nb.cells])
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran")]
            if i in (stub, check_cell) and not cell.source.startswith("raise TimeoutError"):
                return i, "ignored the interrupt at 9 s and its kernel was killed"
        return None, None

    monkeypatch.setattr(grade, "_run_kernel", run_kernel)
    first_line = nb.cells[stub].source.strip().splitlines()[0]
    notes = grade.execute(nb, tmp_path, 9)
    assert len(runs) == 3 and notes == [
        f"cell {stub + 1} ({first_line[:60]!r}) ignored the interrupt at 9 s and its kernel "
        "was killed; the notebook was run again in a fresh kernel with that cell raising "
        "TimeoutError",
        "the check cell of 'quantize_int8' ignored the interrupt at 9 s and its kernel was "
        "killed; the notebook was run again in a fresh kernel with that cell raising "
        "TimeoutError"]
    assert runs[1][stub].startswith("raise TimeoutError") and runs[1][check_cell] == \
        runs[0][check_cell]
    assert nb.cells[check_cell].source.startswith("raise TimeoutError('minicb grade: this "
                                                  "cell ignored the interrupt at 9 s")
    # no restarts left: the last run is reported as stopped and nothing is replaced
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    runs.clear()
    monkeypatch.setattr(grade, "MAX_RESTARTS", 0)
    notes = grade.execute(nb, tmp_path, 9)
    assert len(runs) == 1 and notes == [
        f"execution stopped: cell {stub + 1} ({first_line[:60]!r}) ignored the interrupt at 9 "
        "s and its kernel was killed"]
    assert not nb.cells[stub].source.startswith("raise")


def test_a_failed_check_names_the_learners_own_error_only_when_it_caused_it(tmp_path,
                                                                              monkeypatch):
    """A check failing with NameError after the exercise's own cell raised reports that
    earlier error (the name was never defined because of it); a check failing on its own
    (CheckFailed) reports its own message, whatever failed before it."""
    path = tmp_path / EXPECTED[0]  # page_pool, prefix_hashes, match_prefix, quantize_int8
    shutil.copy(ROOT / "solutions" / EXPECTED[0], path)
    monkeypatch.setattr(grade, "execute", fake_execute({
        "exercise:prefix_hashes": "ZeroDivisionError: division by zero",
        "check:prefix_hashes": "NameError: name 'prompt_page_hashes' is not defined",
        "exercise:match_prefix": "TypeError: bad operand",
        "check:match_prefix": "CheckFailed: match_prefix([1, 2]) returned 3, expected 2",
        "check:quantize_int8": "KeyboardInterrupt: "}))
    messages = {e.name: e.message for e in grade.grade_notebook(path, timeout=7).exercises}
    assert messages["page_pool"] == ""
    assert messages["prefix_hashes"] == ("ZeroDivisionError: division by zero  (then the check "
                                         "failed with NameError)")
    assert messages["match_prefix"] == "CheckFailed: match_prefix([1, 2]) returned 3, expected 2"
    assert messages["quantize_int8"].startswith("KeyboardInterrupt: a cell ran longer than 7 s")


def test_json_is_a_list_whenever_several_notebooks_were_asked_for(tmp_path, monkeypatch,
                                                                   capsys):
    """With several notebooks, --json prints a list with one entry each, an unreadable one saying
    why, and the exit status is 2."""
    path = tmp_path / EXPECTED[1]
    shutil.copy(ROOT / "solutions" / EXPECTED[1], path)
    monkeypatch.setattr(grade, "execute", fake_execute({}))
    assert grade.main(["--json", str(path), str(tmp_path / "missing.ipynb")]) == 2
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data, list) and [d.get("score") for d in data] == [2, None]
    assert data[1]["error"].startswith("cannot read")  # the ungradable one is there, saying why


def test_a_file_holding_its_own_exercises_keeps_its_name_even_when_outweighed():
    """02's stubs and checks plus all of exercise 3's cells: by content alone it looks like
    exercise 3, but it names 02's exercises and is called 02_...: graded as 02."""
    source = ROOT / "exercises" / "source"
    own = nbformat.read(ROOT / "solutions" / EXPECTED[1], as_version=4)
    other = nbformat.read(ROOT / "solutions" / EXPECTED[2], as_version=4)
    keep = set(tagged(own, "check").values()) | set(tagged(own, "exercise").values())
    own.cells = [c for i, c in enumerate(own.cells) if i in keep] + other.cells
    assert grade.identify_source(own) == source / EXPECTED[2]
    assert grade.source_for(ROOT / "submissions" / EXPECTED[1], own) == source / EXPECTED[1]


# read solutions/, which the student copy does not have) ---
def _graded(tmp_path, monkeypatch, outcome, stopped=(), setup_error=None):
    """Grade a copy of solutions/01 in memory (fake_execute): `outcome` per
    tag, the run's notes `stopped`, and `setup_error` raised by its first code cell."""
    path = tmp_path / EXPECTED[0]  # page_pool, prefix_hashes, match_prefix, quantize_int8
    shutil.copy(ROOT / "solutions" / EXPECTED[0], path)
    fake = fake_execute(outcome)

    def execute(nb, workdir, timeout):
        fake(nb, workdir, timeout)
        if setup_error:
            first = next(c for c in nb.cells if c.cell_type == "code")
            ename, _, evalue = setup_error.partition(": ")
            first.outputs = [nbformat.v4.new_output("error", ename=ename, evalue=evalue,
                                                    traceback=[])]
        return list(stopped)
    monkeypatch.setattr(grade, "execute", execute)
    return grade.grade_notebook(path)


def test_a_check_cell_cut_off_by_a_stopped_kernel_says_so(tmp_path, monkeypatch):
    """A check cell that was running when its kernel was killed (no error, no mark) is reported as
    still running when the kernel was stopped, not as a cell that hid its error."""
    report = _graded(tmp_path, monkeypatch, {"check:match_prefix": "silent"},
                     stopped=["execution stopped: cell 3 ignored the interrupt at 300 s "
                              "and its kernel was killed"])
    message = {e.name: e.message for e in report.exercises}["match_prefix"]
    assert message.startswith("its check cell was still running when the kernel was stopped")


def test_only_an_untouched_stubs_error_is_not_attempted(tmp_path, monkeypatch):
    """attempted is False only for the stub's own NotImplementedError ("write ..."); a learner's
    code raising NotImplementedError counts as attempted."""
    report = _graded(tmp_path, monkeypatch, {
        "check:prefix_hashes": "NotImplementedError: write prompt_page_hashes (exercise "
                               "prefix_hashes)",
        "check:match_prefix": "NotImplementedError: pages of size 0"})
    attempted = {e.name: e.attempted for e in report.exercises}
    assert attempted == {"page_pool": True, "prefix_hashes": False, "match_prefix": True,
                         "quantize_int8": True}


def test_the_setup_note_names_only_a_cell_before_the_first_check(tmp_path, monkeypatch):
    """_first_setup_error looks only at cells before the first check cell, so an exercise's own
    error after it is not named as a setup error; a setup error is named by the first line of its
    message only, and only when an exercise failed."""
    report = _graded(tmp_path, monkeypatch, {"exercise:match_prefix": "TypeError: bad operand",
                                             "check:match_prefix": "CheckFailed: wrong"})
    assert not any("raised" in note for note in report.notes)
    report = _graded(tmp_path, monkeypatch, {"check:match_prefix": "CheckFailed: wrong"},
                     setup_error="ModuleNotFoundError: No module named 'numpyy'\nsecond line")
    notes = [n for n in report.notes if "raised" in n]
    assert len(notes) == 1 and "raised ModuleNotFoundError: No module named 'numpyy'; the " \
        "cells after it" in notes[0] and "second line" not in notes[0]
    report = _graded(tmp_path, monkeypatch, {}, setup_error="ModuleNotFoundError: numpyy")
    assert report.score == report.max_score
    assert not any("raised" in note for note in report.notes)


# ------------------------------------------------------------------------------ partial credit
def cases_printed(nb_cell_source: str, passed: int, total: int, points: float) -> str:
    """The line a restored check cell prints after its check: `passed` of `total` cases."""
    marker = re.search(r"print\('(minicb-grade-cases:[^']*)'", nb_cell_source).group(1)
    cases = [[f"case {i}", "random", i < passed, "" if i < passed else f"wrong at {i}"]
             for i in range(total)]
    summary = {"total": total, "refused": False, "cases": cases,
               "points": round(points * passed / total, 4)}
    return marker + json.dumps(summary) + "\n"


def test_an_exercise_scores_the_share_of_cases_its_check_printed(tmp_path, monkeypatch):
    """A check that failed some cases earns its points in proportion, and its report gives
    cases_passed, cases_total and each failed case; one that never printed its cases (it did
    not get to them) earns 0 with no count."""
    path = tmp_path / EXPECTED[1]  # static_batch, static_finish_steps
    shutil.copy(ROOT / "exercises" / EXPECTED[1], path)

    def execute(nb, workdir, timeout):
        for i, cell in enumerate(nb.cells):
            if "check:static_batch" in cell_tags(cell):
                cell.execution_count = i + 1
                cell.outputs = [
                    nbformat.v4.new_output("stream", name="stdout",
                                           text=cases_printed(cell.source, 3, 4, 1.0)),
                    nbformat.v4.new_output("error", ename="CheckFailed", traceback=[],
                                           evalue="[static_batch] 3 of 4 cases passed")]
            elif cell.cell_type == "code":
                cell.execution_count = i + 1
        return []
    monkeypatch.setattr(grade, "execute", execute)
    report = grade.grade_notebook(path)
    batch, finish = report.exercises
    assert (batch.points, batch.passed, batch.cases_passed, batch.cases_total) == \
        (0.75, False, 3, 4)
    assert batch.failed_cases == [{"name": "case 3", "message": "wrong at 3"}]
    assert (finish.points, finish.cases_total) == (0, None)
    assert "(3 of 4 cases)" in grade.format_report(report)
    data = report.to_dict()["exercises"][0]
    assert {k: data[k] for k in ("points", "max_points", "cases_passed", "cases_total")} == \
        {"points": 0.75, "max_points": 1, "cases_passed": 3, "cases_total": 4}


def test_a_restored_check_cell_sets_the_hidden_seed_and_prints_its_cases():
    """Each restored check cell loads a fresh check module, sets its hidden seed, runs the
    learner's check inside try/finally (its cases print even when it fails or is stopped),
    with the points and weights of the cell's tags, and prints the mark last."""
    nb = nbformat.v4.new_notebook(cells=[code("check.static_batch(f)", (
        "check:static_batch", "points:2", "weight:edge=3"))])
    grade.guard_checks(nb, "abc", hidden_seed=41)
    source = nb.cells[0].source
    assert "check.HIDDEN_SEED = 41" in source and "try:\n    check.static_batch(f)\n" in source
    assert ".summary(2.0, {'edge': 3.0})" in source
    assert source.index("finally:") < source.index("minicb-grade-cases:abc:static_batch:")
    assert source.rstrip().endswith("print('minicb-grade-check-done:abc:static_batch')")
    compile(source, "cell", "exec")


# ------------------------------------------------------------------------------ a class
KNOWN = ["02_static_batching.ipynb", "05_pd_interleaving.ipynb"]


@pytest.mark.parametrize("relative, student, notebook", [
    ("alice/05_pd/05_pd_interleaving.ipynb", "alice", "05_pd_interleaving.ipynb"),
    ("alice/05_pd_interleaving.ipynb", "alice", "05_pd_interleaving.ipynb"),
    ("bob/my work.ipynb", "bob", "my work.ipynb"),
    ("smithjo_12345_678_05_pd_interleaving.ipynb", "smithjo", "05_pd_interleaving.ipynb"),
    ("Jo Smith_98_assignsubmission_file_02_static_batching-1.ipynb", "Jo Smith",
     "02_static_batching.ipynb"),
    ("05_pd_interleaving.ipynb", "", "05_pd_interleaving.ipynb"),
    ("scratch_notes.ipynb", "", "scratch_notes.ipynb"),
])
def test_the_student_is_read_from_the_class_folders_layout(relative, student, notebook):
    """nbgrader's DIR/<student>/<assignment>/<nb>, a folder per student and LMS names
    (<student>_<anything>_<nb>, a resubmission suffix allowed) name the student; a notebook
    alone in the folder under its own name, or under a name no exercise ends, names none."""
    folder = Path("/class")
    sub = classroom.submission(folder / relative, folder, KNOWN)
    assert (sub.student, sub.notebook) == (student, notebook)
    assert classroom.submission(folder / relative, None, KNOWN).student == (
        student if "/" not in relative else "")


def entry(student, source, points, max_points=(1, 1)):
    """A --results line: `student`'s report on exercise notebook `source`."""
    names = {"02_static_batching": ["static_batch", "static_finish_steps"],
             "05_pd_interleaving": ["pd_scheduler", "dec_at_p"]}[source]
    exercises = [{"name": n, "points": p, "max_points": m, "passed": p == m, "message":
                  "" if p == m else f"[{n}] 1 of 4 cases passed. <b>",
                  "attempted": True, "cases_passed": 4 if p == m else 1, "cases_total": 4,
                  "failed_cases": []} for n, p, m in zip(names, points, max_points)]
    return {"student": student, "notebook": f"class/{student}/{source}.ipynb",
            "source": source, "score": sum(points), "max_score": sum(max_points),
            "seconds": 1.0, "exercises": exercises, "notes": []}


def test_the_gradebook_has_a_row_per_student_and_names_what_is_missing():
    """One row per student: total, max over every notebook of the class (handed in or not),
    a column per exercise of every notebook (blank where not handed in), then the notebooks
    missing and those that could not be graded."""
    rows = classroom.gradebook_rows([
        entry("bob", "02_static_batching", (1, 0.5)),
        entry("alice", "02_static_batching", (1, 1)),
        entry("alice", "05_pd_interleaving", (2, 0), (2, 1)),
        {"student": "bob", "notebook": "class/bob/05_pd_interleaving.ipynb",
         "error": "cannot read it"}])
    assert [list(r.values()) for r in rows] == [
        ["alice", 4, 5, 1, 1, 2, 0, "", ""],
        ["bob", 1.5, 5, 1, 0.5, "", "", "05_pd_interleaving",
         "05_pd_interleaving.ipynb: cannot read it"]]
    assert list(rows[0]) == ["student", "total", "max", "static_batch", "static_finish_steps",
                             "pd_scheduler", "dec_at_p", "missing", "not_graded"]


def test_a_feedback_page_shows_points_cases_and_explanations_escaped(tmp_path):
    """A feedback page names the student and notebook, gives the total and each exercise's
    points and cases passed, and the check's explanation as text (HTML in it is escaped); it
    is written to FEEDBACK/<student>/<exercise notebook>.html."""
    data = entry("carol", "02_static_batching", (1, 0.25))
    page = classroom.feedback_html(data)
    assert "carol: 02_static_batching.ipynb" in page and "Total: 1.25 / 2 points" in page
    assert "0.25 / 1" in page and "1 of 4" in page and "&lt;b&gt;" in page and "<b>" not in \
        page.split("</style>")[1].replace("<b>Total", "")
    assert classroom.feedback_path(tmp_path, data) == \
        tmp_path / "carol" / "02_static_batching.html"
    failed = classroom.feedback_html({"student": "", "notebook": "x.ipynb", "error": "bad"})
    assert "(no name): x.ipynb" in failed and "could not be graded: bad" in failed


def test_results_are_written_as_each_notebook_finishes_and_resume_skips_them(
        tmp_path, monkeypatch, capsys):
    """--results gets one JSON line per notebook as it finishes; --resume grades only the
    notebooks the file does not hold, and the gradebook and feedback cover them all."""
    for student in ("alice", "bob"):
        (tmp_path / "class" / student).mkdir(parents=True)
        shutil.copy(ROOT / "exercises" / EXPECTED[1], tmp_path / "class" / student)
    graded = []

    def execute(nb, workdir, timeout):
        graded.append(nb)
        return fake_execute({})(nb, workdir, timeout)
    monkeypatch.setattr(grade, "execute", execute)
    results = tmp_path / "run.jsonl"
    book = tmp_path / "book.csv"
    args = [str(tmp_path / "class"), "--results", str(results), "--gradebook", str(book),
            "--feedback", str(tmp_path / "fb")]
    assert grade.main(args) == 0
    lines = results.read_text().splitlines()
    assert [json.loads(line)["student"] for line in lines] == ["alice", "bob"]
    results.write_text(lines[0] + "\n")  # a run stopped after alice
    graded.clear()
    assert grade.main([*args, "--resume"]) == 0
    assert len(graded) == 1 and len(results.read_text().splitlines()) == 2
    with open(book, encoding="utf-8-sig") as f:
        assert [row["student"] for row in csv.DictReader(f)] == ["alice", "bob"]
    assert sorted(p.relative_to(tmp_path / "fb").as_posix()
                  for p in (tmp_path / "fb").rglob("*.html")) == [
        "alice/02_static_batching.html", "bob/02_static_batching.html"]
    with pytest.raises(SystemExit):
        grade.main([str(tmp_path / "class"), "--resume"])
    assert "--resume needs the --results file" in capsys.readouterr().err


def planted_class(folder: Path) -> None:
    """Three students of exercise 02: alice's solution (a folder per student), bob's blank
    notebook, and carol's solution with one planted bug (an LMS download name): static_batch
    rounds pages down, which only some cases notice."""
    for student in ("alice", "bob"):
        (folder / student).mkdir(parents=True)
    shutil.copy(ROOT / "solutions" / EXPECTED[1], folder / "alice")
    shutil.copy(ROOT / "exercises" / EXPECTED[1], folder / "bob")
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[1], as_version=4)
    stub = next(c for c in nb.cells if "exercise:static_batch" in cell_tags(c))
    assert "need = -(-prompt_len // page_size)" in stub.source
    stub.source = stub.source.replace("need = -(-prompt_len // page_size)",
                                      "need = prompt_len // page_size")
    nbformat.write(nb, folder / f"carol_4242_1_{EXPECTED[1]}")


@pytest.mark.slow
def test_a_mini_class_gets_full_marks_zero_and_a_fraction(tmp_path):
    """A class of three graded with --gradebook, --feedback and --hidden-seed, two at a time:
    the solution gets full marks, the blank notebook 0, the planted bug a fraction of
    static_batch's point (hidden cases included); each gets a feedback page."""
    planted_class(tmp_path / "class")
    book, feedback = tmp_path / "grades.csv", tmp_path / "feedback"
    assert grade.main([str(tmp_path / "class"), "--gradebook", str(book), "--feedback",
                       str(feedback), "--hidden-seed", "1234", "--jobs", "2",
                       "--timeout", "120"]) == 0
    with open(book, encoding="utf-8-sig") as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    assert sorted(rows) == ["alice", "bob", "carol"]
    assert (rows["alice"]["total"], rows["alice"]["max"]) == ("2", "2")
    assert (rows["bob"]["total"], rows["bob"]["static_batch"]) == ("0", "0")
    assert 0 < float(rows["carol"]["static_batch"]) < 1
    assert rows["carol"]["static_finish_steps"] == "1"
    assert float(rows["carol"]["total"]) == pytest.approx(1 + float(rows["carol"]["static_batch"]))
    for student in rows:
        assert (feedback / student / "02_static_batching.html").is_file()
    carol = (feedback / "carol" / "02_static_batching.html").read_text()
    assert "cases passed" in carol and "Your batch needs" in carol
    lines = [json.loads(line) for line in book.with_suffix(".jsonl").read_text().splitlines()]
    cases = {e["student"]: e["exercises"][0] for e in lines}
    assert cases["carol"]["cases_total"] > 159  # the hidden cases ran
    assert cases["carol"]["failed_cases"] and cases["alice"]["failed_cases"] == []


@pytest.mark.slow
def test_nbgrader_scores_agree_with_minicb_grade(tmp_path):
    """The nbgrader course: generate_assignment, autograde and generate_feedback on a solution
    and on a blank submission give the scores `minicb grade --hidden-seed` gives the same
    notebooks, hidden cases included."""
    import subprocess
    import sys

    from nbgrader.api import Gradebook

    from minicb.course import nbgrader_course
    name = "08_speculative_decoding"
    course = tmp_path / "course"
    nbgrader_course.write_course(course, hidden_seed=99)
    source = nbformat.read(course / "source" / name / f"{name}.ipynb", as_version=4)
    test = next(c for c in source.cells if c.metadata["nbgrader"]["grade"])
    assert test.source.startswith("### BEGIN HIDDEN TESTS\ncheck.HIDDEN_SEED = 99\n")
    bin_dir = Path(sys.executable).parent  # nbgrader runs alembic from the PATH
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])}

    def nbgrader(*args):
        done = subprocess.run([str(bin_dir / "nbgrader"), *args], cwd=course, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    nbgrader("generate_assignment", name, "--force")
    release = nbformat.read(course / "release" / name / f"{name}.ipynb", as_version=4)
    assert "HIDDEN" not in nbformat.writes(release)
    solved = nbformat.read(course / "release" / name / f"{name}.ipynb", as_version=4)
    for cell, src in zip(solved.cells, source.cells):
        if cell.metadata["nbgrader"]["solution"] and cell.cell_type == "code":
            cell.source = exercises.solution_code(src.source)
    for student, nb in (("alice", solved), ("bob", release)):
        (course / "submitted" / student / name).mkdir(parents=True)
        nbformat.write(nb, course / "submitted" / student / name / f"{name}.ipynb")
    nbgrader("autograde", name)
    nbgrader("generate_feedback", name)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        scores = {s: gb.find_submission(name, s).score for s in ("alice", "bob")}
    ours = {}
    for student in ("alice", "bob"):
        report = grade.grade_notebook(course / "submitted" / student / name / f"{name}.ipynb",
                                      hidden_seed=99, student=student, name=f"{name}.ipynb")
        ours[student] = report.score
        assert (course / "feedback" / student / name / f"{name}.html").is_file()
    assert scores == ours == {"alice": 2, "bob": 0}
