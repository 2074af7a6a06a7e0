"""Planted-bug tests from a mutation review of minicb/course/grade.py, cuda_graphs.py,
attention/__init__.py and exercises.py: each test fails on the bug its docstring names and
passes on the real code. No kernel runs: `grade.execute` and nbclient's client are stood in for.
They read only exercises/ and `grade.SOURCES`, which the student copy has too."""

from __future__ import annotations

import csv
import os
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

from minicb.course import exercises, grade
from minicb.course.exercises import ROOT, MarkerError, cell_tags, generate, stub_code

PAGED = "01_paged_kv.ipynb"  # page_pool, prefix_hashes, match_prefix, quantize_int8


def code(source: str = "pass", tags: tuple[str, ...] = (), markdown: bool = False):
    """A cell with `tags` (a markdown cell when `markdown`)."""
    make = nbformat.v4.new_markdown_cell if markdown else nbformat.v4.new_code_cell
    return make(source, metadata={"tags": list(tags)})


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


# --------------------------------------------------------------------------- grade.py
def test_check_cells_read_points_tags_and_skip_markdown():
    """check_cells: `points:<n>` may be a decimal (the `(\\.\\d+)?` part dropped made 0.5 a 1),
    the default is 1 point, and a markdown cell tagged `check:` is no check cell."""
    nb = nbformat.v4.new_notebook(cells=[
        code(tags=("check:a", "points:0.5")), code(tags=("check:b",)),
        code("text", ("check:c",), markdown=True)])
    assert grade.check_cells(nb) == [(0, "a", 0.5), (1, "b", 1.0)]


def test_exercise_names_come_from_exercise_tags_too():
    """exercise_names counted only `check:` tags: a notebook whose check cells were deleted
    (only its `exercise:` stubs left) named no exercise."""
    nb = nbformat.v4.new_notebook(cells=[code(tags=("exercise:page_pool", "exercise:")),
                                         code("check.match_prefix(m)")])
    assert grade.exercise_names(nb) == {"page_pool", "match_prefix"}


def test_a_notebook_with_no_exercise_name_needs_two_cells_of_a_source(tmp_path):
    """identify_source took one shared cell ("import torch") for a match: any notebook was
    graded as whichever source it shared a line with. Two shared cells identify it."""
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
    again; `timeout + 5` killed a cell the interrupt was about to stop); its kill names the
    running cell, and the grader's PYTHONPATH and IPYTHONDIR are undone afterwards."""
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
    """CappedClient dropped the grader's mark with the rest once a cell had printed
    MAX_CELL_OUTPUT characters: a check that printed a lot and passed scored 0."""
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
    """Exercise 3's notebook saved as 02_...: graded as 03 with a note saying so; with
    --source naming 03 the teacher chose it, and "named like ..., graded as those" is
    not said (the `not source` condition dropped said it)."""
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
    """A NameError in a check follows the error of a cell since the previous check cell,
    never one before it (the previous check's own failure was named as the cause); an
    ImportError is explained the same way as a NameError."""
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
    """restore_checks looked a check up by its cell id even when a cell carried its tag: the
    original (untagged) cell was restored, and the cell the learner had tagged `check:a` (its
    text "pass", after the original) kept its own text and earned the point."""
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
    """write_gradebook quoted only = + -: `@SUM(...)` (and a leading tab or carriage return)
    ran as a formula in a spreadsheet. No rows: an empty file."""
    book = tmp_path / "book.csv"
    grade.write_gradebook(book, [{"a": "@SUM(A1)", "b": "\tx", "c": "\ry", "d": "ok", "e": 3}])
    with open(book, newline="", encoding="utf-8-sig") as f:
        assert list(csv.DictReader(f)) == [{"a": "'@SUM(A1)", "b": "'\tx", "c": "'\ry",
                                            "d": "ok", "e": "3"}]
    grade.write_gradebook(book, [])
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


# --------------------------------------------------------------------------- cuda_graphs.py
def test_graph_runner_buckets_are_sorted_and_its_steps_are_decode_rows():
    """DecodeGraphRunner took its buckets in the order given ((4, 2): a step of 1 ran in the
    4-row graph, max_batch was 2), and its metadata must say every row is a decode row (with
    num_decodes 0 the step ran the prefill kernel, whose work list is built on the host)."""
    from minicb.cuda_graphs import DecodeGraphRunner
    runner = DecodeGraphRunner(None, [], 16, 3, "cpu", buckets=(4, 2), capture=False)
    assert (runner.buckets, runner.max_batch, runner.bucket(1), runner.bucket(3)) == \
        ((2, 4), 4, 2, 4)
    meta = runner.metadata(2)
    assert (meta.num_decodes, meta.num_members, meta.query_start_loc.tolist()) == (2, 2,
                                                                                  [0, 1, 2])
    assert meta.page_tables.shape == (2, 3)


# --------------------------------------------------------------------------- attention
def test_num_decode_tokens_counts_only_the_decode_rows():
    """AttentionMetadata.num_decode_tokens is the decode rows (one token each), not every
    member of the step."""
    from minicb.attention import build_metadata
    meta = build_metadata([[0], [1], [2]], [4, 7, 0], [1, 1, 5], 16)
    assert (meta.num_decode_tokens, meta.num_members) == (2, 3)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_auto_picks_triton_on_any_cuda_device(monkeypatch, device):
    """'auto' on "cuda:1" took the device for a CPU (`== "cuda"` for `startswith`) and picked
    the C kernel; on CUDA it is Triton (picking torch there is a slip too), and 'cpu' is
    refused there. An empty backend name is no backend."""
    from minicb.attention import resolve_backend
    monkeypatch.delenv("MINICB_ATTENTION", raising=False)
    assert resolve_backend("auto", device) == "triton"
    with pytest.raises(ValueError, match="C kernel for the CPU"):
        resolve_backend("cpu", device)
    with pytest.raises(ValueError, match="got ''"):
        resolve_backend("", device)


def test_the_torch_fallback_is_announced_once(monkeypatch, caplog):
    """Without the C kernel, 'auto' on the CPU falls back to torch with one warning per
    process, not one per engine built (`if message not in _warned` dropped)."""
    import logging

    from minicb import attention
    from minicb.attention import cpu_kernel
    monkeypatch.delenv("MINICB_ATTENTION", raising=False)
    monkeypatch.setattr(attention, "_warned", set())
    monkeypatch.setattr(cpu_kernel, "unavailable_reason", lambda: "no compiler here")
    with caplog.at_level(logging.WARNING, logger="minicb"):
        assert [attention.resolve_backend("auto", "cpu") for _ in range(3)] == ["torch"] * 3
    assert [r.getMessage() for r in caplog.records] == [
        "no compiler here; using the torch reference for attention"]


# --------------------------------------------------------------------------- exercises.py
def test_a_stub_keeps_only_the_hint_comment_that_opens_its_region():
    """_hint_lines: a comment after the answer's first code line (the `elif out: break`
    dropped), or one that merely starts with HINT (`# HINTED`, the `\\b` dropped), is the
    answer's and stays out of the stub. Without an exercise the message names none."""
    body = ["def f():", "    ### BEGIN SOLUTION", "    # HINT: add one", "    y = 1",
            "    # the answer's own note", "    return y", "    ### END SOLUTION",
            "def g():", "    ### BEGIN SOLUTION", "    # HINTED: return 2", "    return 2",
            "    ### END SOLUTION"]
    assert stub_code("\n".join(body)).split("\n") == [
        "def f():", "    # HINT: add one",
        '    raise NotImplementedError("write f: see the HINT above")', "def g():",
        '    raise NotImplementedError("write g: replace this line with your code")']


def test_a_cell_with_only_one_marker_is_refused_not_copied():
    """generate skipped a cell holding BEGIN without END (`or` for `and`): its answer went
    into the exercise notebook unchanged. Only a tag `exercise:<name>` names the exercise."""
    nb = nbformat.v4.new_notebook(cells=[code("### BEGIN SOLUTION\nanswer = 42\n### END SOLUTON")])
    with pytest.raises(MarkerError, match="never closed"):
        generate(nb, "t")
    cell = code(tags=("exercises:x", "exercise", "exercise:page_pool"))
    assert exercises._exercise_of(cell) == "page_pool"


def test_build_rewrites_only_what_changed(tmp_path):
    """build: a second build changes nothing and says so (it rewrote, and listed, every file)."""
    shutil.copytree(grade.SOURCES, tmp_path / grade.SOURCES.relative_to(ROOT))
    first = exercises.build(tmp_path)
    assert len(first) == 2 * len(list(grade.SOURCES.glob("*.ipynb"))) and \
        exercises.build(tmp_path) == []
