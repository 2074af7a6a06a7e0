"""The autograder: `python -m minicb grade NOTEBOOK|DIR [...] [--json] [--gradebook FILE]
[--feedback DIR] [--hidden-seed N] [--jobs N]` (exercises, chapters 01-08; docs/teaching.md).

It executes a copy of each notebook from top to bottom in a fresh kernel, carrying on past
errors, and scores every exercise by its check cell: the cell tagged `check:<exercise>` (and
`points:<n>`, default 1, and `weight:<case>=<w>`). The check runs named cases and the
exercise earns its points in proportion to those that passed (`check.case_points`); with
`--hidden-seed N` every check adds hidden cases drawn from N. A failed exercise reports the
error its check cell raised (a `CheckFailed` explanation: the first failed case in full, one
line for each other; or the `NotImplementedError` of an untouched stub), or the first error
among the exercise's own cells when the check never got that far. A cell that ignores the
timeout's interrupt has its kernel killed, and the notebook runs again in a fresh kernel with
that cell raising `TimeoutError`, so one endless loop does not cost the exercises after it; a
cell whose kernel dies under it (a segfault, out of memory) is replaced the same way by one
raising `RuntimeError`.

Check cells are restored from the exercise's source before the run: `--source PATH`, else
`exercises/source/<same file name>`, else the source the notebook's content names (its
`exercise:`/`check:` tags, its `check.<name>(...)` calls, its unchanged cells). A notebook
whose source cannot be identified is refused, never graded on its own check cells. Every
exercise of the source is reported: editing a check cell changes nothing, a check cell that
lost its tag is found again by its cell id, its text or its lone `check.<name>(` call, a pasted
copy keeping the tag keeps its code as an ordinary cell before the check, and a deleted one is
put back after the exercise's own cell (the exercise scores 0 only when that is gone too).
`--no-restore` grades the notebook as it is (its own check cells, which prove nothing).

Each restored check cell first loads a fresh copy of `minicb.course.check` from its file (so an
earlier cell that replaced `check.<name>` or rebound `check` changes nothing), sets its hidden
seed, prints the check's cases (even when it fails or is stopped) and ends by printing a mark
that changes with every run; an exercise gets full marks only when that mark was printed. This
raises the bar, it is no sandbox: the learner's code runs in the same kernel before the checks
and can still patch the engine the checks drive, or IPython itself.

A class's submissions are graded in one call (`minicb.course.classroom` reads the student from
the folder's layout): `--jobs N` grades N notebooks at a time (each in its own process and
kernel; a notebook whose process dies, out of memory say, is reported as not graded and the
others are still graded); each result is appended to `--results FILE` as it finishes
(`--resume` skips those); `--gradebook FILE` writes a row per student, `--feedback DIR` a page
per student and notebook, `--csv FILE` a row per notebook, including one for every notebook
that could not be graded, so nobody drops out of the spreadsheet unnoticed.

The original notebook is never modified. Exit status: 0 when every notebook was graded (whatever
the score), 2 when a notebook could not be read, its exercise source could not be identified
or its kernel ran no cell, 130 when the run was interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import nbformat
from traitlets.config import Config

from minicb.course.classroom import (
    Submission,
    feedback_html,
    feedback_path,
    gradebook_rows,
    submission,
    write_csv,
)
from minicb.course.exercises import ROOT, cell_tags

CHECK_TAG = re.compile(r"^check:(?P<name>[\w.-]+)$")
POINTS_TAG = re.compile(r"^points:(?P<points>\d+(\.\d+)?)$")
# weight:<group or case>=<w>: a case's share of its exercise's points (default 1 each)
WEIGHT_TAG = re.compile(r"^weight:(?P<case>[\w.-]+)=(?P<weight>\d+(\.\d+)?)$")
CHECK_CALL = re.compile(r"\bcheck\.(?P<name>\w+)\(")
# a line installing packages, as a magic or a shell escape: never run by the grader
INSTALL = re.compile(r"^(?P<indent>[ \t]*)(?P<line>[%!]{1,2}[ \t]*(?:pip3?|conda|mamba|"
                     r"micromamba|uv[ \t]+pip|python3?[ \t]+-m[ \t]+pip)\b.*)$", re.M)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
MAX_MESSAGE = 1200
SOURCES = ROOT / "exercises" / "source"
CHECK_MODULE = Path(__file__).resolve().with_name("check.py")
# Put before every restored check cell: `check` is a fresh module loaded from
# minicb/course/check.py.
GUARD = """\
import importlib.util as _minicb_grade_util  # added by minicb grade: a fresh minicb.course.check
_minicb_grade_spec = _minicb_grade_util.spec_from_file_location("minicb.course.check", {path!r})
check = _minicb_grade_check = _minicb_grade_util.module_from_spec(_minicb_grade_spec)
__import__("sys").modules["minicb.course.check"] = check  # its dataclasses look their module up
_minicb_grade_spec.loader.exec_module(check)
check.HIDDEN_SEED = {seed!r}
try:
{code}
finally:  # how many cases passed and the points, even when the check failed or was stopped
    print({cases!r} + __import__("json").dumps(
        _minicb_grade_check.RESULTS[{name!r}].summary({points!r}, {weights!r})
        if {name!r} in _minicb_grade_check.RESULTS else None))
print({mark!r})
"""
STUB_ERROR = "NotImplementedError: write "  # what an untouched stub raises
MARK_PREFIX = "minicb-grade-"  # the grader's lines: never cut by the output cap
MARK = MARK_PREFIX + "check-done:{nonce}:{name}"  # printed after a check cell's own code
CASES = MARK_PREFIX + "cases:{nonce}:{name}:"  # then the check's cases as JSON
MAX_SOCKET_PREFIX = 90  # bytes; Linux allows 107 in a Unix socket's path, macOS 103
MAX_CELL_OUTPUT = 1_000_000  # characters of output kept per cell; errors and marks always
MAX_RESTARTS = 2  # fresh kernels after a killed one; each costs a re-run and 2 timeouts
STOPPED = "execution stopped: "  # a note saying the notebook's last run did not reach its end
KERNEL_DIED = "was running when its kernel died (out of memory? a crash?)"
WORKER_DIED = "the grading process died (out of memory?)"  # a --jobs worker killed under it


class GradeError(ValueError):
    """A notebook that cannot be graded as asked (its exercise source is unknown or unreadable)."""


@dataclass
class ExerciseResult:
    """One exercise's score and, when it failed, why: its points are its share of the cases
    its check ran (`case_points`), the message gives the first failed case in full and one
    line for each other."""

    name: str
    points: float
    max_points: float
    passed: bool
    message: str = ""
    attempted: bool = True  # False: the stub still raises its NotImplementedError
    cases_passed: int = 0
    cases_total: int | None = None  # None: the check never got to its cases
    failed_cases: list[dict[str, str]] = field(default_factory=list)  # {"name", "message"}


@dataclass
class GradeReport:
    """A graded notebook: per-exercise results, the total, and how the run went."""

    notebook: str
    exercises: list[ExerciseResult] = field(default_factory=list)
    seconds: float = 0.0
    source: str = ""  # the exercise source's name ("05_pd_interleaving"); "" with --no-restore
    notes: list[str] = field(default_factory=list)  # kernel died, restored cells, ...
    student: str = ""  # from the class folder's layout (`student_of`); "" for a lone notebook

    @property
    def score(self) -> float:
        """Points earned."""
        return sum(e.points for e in self.exercises)

    @property
    def max_score(self) -> float:
        """Points available."""
        return sum(e.max_points for e in self.exercises)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `--json` and `--results`: student, notebook, source, score,
        max_score, seconds, exercises (each with its points, max_points, cases_passed,
        cases_total and failed_cases), notes."""
        return {"student": self.student, "notebook": self.notebook, "source": self.source,
                "score": _num(self.score), "max_score": _num(self.max_score),
                "seconds": round(self.seconds, 2),
                "exercises": [{**asdict(e), "points": _num(e.points),
                               "max_points": _num(e.max_points)} for e in self.exercises],
                "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GradeReport:
        """The report `to_dict` wrote (a `--results` line read back by `--resume`)."""
        return cls(data["notebook"], [ExerciseResult(**e) for e in data["exercises"]],
                   data.get("seconds", 0.0), data.get("source", ""), list(data.get("notes", [])),
                   data.get("student", ""))


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else round(x, 2)


def case_weights(cell: nbformat.NotebookNode) -> dict[str, float]:
    """A check cell's `weight:<group or case>=<w>` tags: {group or case name: weight}."""
    return {m["case"]: float(m["weight"]) for t in cell_tags(cell) for m in [WEIGHT_TAG.match(t)]
            if m}


def check_cells(nb: nbformat.NotebookNode) -> list[tuple[int, str, float]]:
    """(cell index, exercise name, points) of every check cell, in notebook order."""
    found = []
    for i, cell in enumerate(nb.cells):
        name, points = None, 1.0
        for tag in cell_tags(cell):
            if m := CHECK_TAG.match(tag):
                name = m.group("name")
            elif m := POINTS_TAG.match(tag):
                points = float(m.group("points"))
        if name and cell.cell_type == "code":
            found.append((i, name, points))
    return found


def exercise_names(nb: nbformat.NotebookNode) -> set[str]:
    """The exercises a notebook names: its `exercise:`/`check:` tags and `check.<name>(`
    calls."""
    names = set()
    for cell in nb.cells:
        for tag in cell_tags(cell):
            kind, _, name = tag.partition(":")
            if kind in ("exercise", "check") and name:
                names.add(name)
        if cell.cell_type == "code":
            text = cell.source if isinstance(cell.source, str) else "".join(cell.source)
            names.update(m.group("name") for m in CHECK_CALL.finditer(text))
    return names


def identify_source(nb: nbformat.NotebookNode, sources: Path = SOURCES) -> Path | None:
    """The exercise source a notebook was made from, judged by its content: the source
    sharing the most exercise names with it (tags, check calls), then the most cells left
    word for word as they were. None when it names no exercise and shares fewer than two
    cells with any source, or when two sources tie."""
    names = exercise_names(nb)
    texts = {c.source.strip() for c in nb.cells if isinstance(c.source, str) and c.source.strip()}
    scores = []
    for src in sorted(sources.glob("*.ipynb")):
        try:
            source = nbformat.read(src, as_version=4)
        except Exception:
            continue
        own = {n for _, n, _ in check_cells(source)}
        same_cells = sum(1 for c in source.cells
                         if c.source.strip() and c.source.strip() in texts)
        scores.append(((len(names & own), same_cells), src))
    scores.sort(key=lambda item: item[0], reverse=True)
    if not scores or scores[0][0][0] == 0 and scores[0][0][1] < 2:
        return None  # no exercise name, at most one common cell ("import torch"): not ours
    if len(scores) > 1 and scores[1][0] == scores[0][0]:
        return None
    return scores[0][1]


def source_for(path: Path, nb: nbformat.NotebookNode | None = None, name: str | None = None
               ) -> Path | None:
    """The exercise source of the notebook at `path`: the file of the same name (or named
    `name`, the notebook an LMS download's name ends with) in exercises/source, unless (given
    the notebook) its content names only another source's exercises (exercise 3's work saved
    as 02_static_batching.ipynb is graded as exercise 3); else the one its content
    identifies, else None."""
    candidate = SOURCES / (name or Path(path).name)
    identified = identify_source(nb) if nb is not None else None
    if candidate.is_file():
        if identified is not None and identified != candidate:
            names = exercise_names(nb)
            if names & _own_exercises(identified) and not names & _own_exercises(candidate):
                return identified
        return candidate
    return identified


def _own_exercises(source: Path) -> set[str]:
    return {name for _, name, _ in check_cells(nbformat.read(source, as_version=4))}


def restore_checks(nb: nbformat.NotebookNode, source: nbformat.NotebookNode
                   ) -> tuple[list[tuple[str, float]], list[str]]:
    """Put the source's check cells back into `nb` (by exercise name). Returns the exercises
    the source defines, with their points, and notes on what was changed. A check cell is the
    cell tagged `check:<name>`, else (its tag lost) the untagged one with its cell id, its text
    or only its `check.<name>(` call; a deleted one is put back after the exercise's own cell,
    and is missing only when that cell cannot be found either."""
    notes: list[str] = []
    expected = []
    claimed: set[int] = set()  # id() of the cells already standing for a check
    for i, name, points in check_cells(source):
        expected.append((name, points))
        check = source.cells[i]
        cell = _tagged_check(nb, name, check, notes)
        if cell is None:
            cell = (_untagged_check(nb, name, check, claimed, notes)
                    or _put_back(nb, name, source, check, notes))
            if cell is None:
                notes.append(f"check cell of {name!r} is missing: that exercise scores 0")
                continue
        elif cell.source != check.source:
            notes.append(f"check cell of {name!r} was edited: restored from the source")
        claimed.add(id(cell))
        cell.source = check.source
        ours = (POINTS_TAG, CHECK_TAG, WEIGHT_TAG)
        tags = [t for t in cell_tags(cell) if not any(tag.match(t) for tag in ours)]
        tags += [t for t in cell_tags(check) if any(tag.match(t) for tag in ours)]
        cell.setdefault("metadata", {})["tags"] = tags
    return expected, notes


def _check_name(cell: nbformat.NotebookNode) -> str | None:
    """The exercise a code cell is tagged the check cell of (as `check_cells` reads it)."""
    names = [m["name"] for t in cell_tags(cell) for m in [CHECK_TAG.match(t)] if m]
    return names[-1] if names and cell.cell_type == "code" else None


def _same_text(cell: nbformat.NotebookNode, check: nbformat.NotebookNode) -> bool:
    return cell.source.strip() == check.source.strip()


def _index(nb: nbformat.NotebookNode, cell: nbformat.NotebookNode) -> int:
    # by identity: two copies of a cell compare equal
    return next(k for k, c in enumerate(nb.cells) if c is cell)


def _tagged_check(nb: nbformat.NotebookNode, name: str, check: nbformat.NotebookNode,
                  notes: list[str]) -> nbformat.NotebookNode | None:
    """The cell tagged `check:<name>`. Of several (JupyterLab keeps the tags of a pasted copy,
    where a learner may write an answer), the one with the source's id, else its text, else
    the last; the others lose the tag, an exact copy of the check is dropped, and the check
    moves after any that holds other code."""
    tagged = [c for c in nb.cells if _check_name(c) == name]
    if not tagged:
        return None
    chosen = next((c for c in tagged if check.get("id") and c.get("id") == check.get("id")),
                  None) or next((c for c in tagged if _same_text(c, check)), tagged[-1])
    others = [c for c in tagged if c is not chosen]
    for cell in others:
        cell.metadata["tags"] = [t for t in cell_tags(cell)
                                 if not POINTS_TAG.match(t) and not CHECK_TAG.match(t)]
        if _same_text(cell, check):
            del nb.cells[_index(nb, cell)]
    kept = [c for c in others if not _same_text(c, check)]
    if kept:
        notes.append(f"check cell of {name!r} was pasted again: the copies' code is kept as "
                     "ordinary cells, the check runs after them")
        last = max(_index(nb, c) for c in kept)
        if last > _index(nb, chosen):
            nb.cells.insert(last + 1, chosen)
            del nb.cells[_index(nb, chosen)]  # the first of the two: the old place
    return chosen


def _untagged_check(nb: nbformat.NotebookNode, name: str, check: nbformat.NotebookNode,
                    claimed: set[int], notes: list[str]) -> nbformat.NotebookNode | None:
    """A check cell that lost its tag (an editor that drops tags, a retyped cell): the free
    untagged code cell with the source's cell id, else its text, else nothing but
    `check.<name>(...)` calls (a cell holding other code may hold an answer: never that)."""
    free = [c for c in nb.cells if c.cell_type == "code" and id(c) not in claimed
            and not any(t.startswith("check:") for t in cell_tags(c))]
    ways = (("its cell id", lambda c: bool(check.get("id")) and c.get("id") == check.get("id")),
            ("its text", lambda c: _same_text(c, check)),
            (f"its check.{name}( call", lambda c: _only_checks(c, name)))
    for how, matches in ways:
        if cell := next((c for c in free if matches(c)), None):
            notes.append(f"check cell of {name!r} had lost its tag: found by {how}, restored "
                         "from the source")
            return cell
    return None


def _only_checks(cell: nbformat.NotebookNode, name: str) -> bool:
    """Whether a cell calls `check.<name>(` and holds nothing but `check.` lines and comments."""
    lines = [ln.strip() for ln in cell.source.splitlines()
             if ln.strip() and not ln.strip().startswith("#")]
    return f"check.{name}(" in cell.source and all(ln.startswith("check.") for ln in lines)


def _put_back(nb: nbformat.NotebookNode, name: str, source: nbformat.NotebookNode,
              check: nbformat.NotebookNode, notes: list[str]) -> nbformat.NotebookNode | None:
    """A new check cell in `nb` after the last cell calling `check.<name>(` among other code
    (an answer merged into the check cell), else after the exercise's own cell (tagged
    `exercise:<name>`, else with the source's cell id, else starting with its first line);
    None when there is neither."""
    stub = next((c for c in reversed(source.cells) if f"exercise:{name}" in cell_tags(c)),
                nbformat.v4.new_code_cell(""))
    first = _first_line(stub)
    code = [c for c in nb.cells if c.cell_type == "code"]
    caller = next((c for c in reversed(code) if f"check.{name}(" in c.source
                   and not any(t.startswith("check:") for t in cell_tags(c))), None)
    own = next((c for c in reversed(code) if f"exercise:{name}" in cell_tags(c)), None) \
        or next((c for c in code if stub.get("id") and c.get("id") == stub.get("id")), None) \
        or next((c for c in code if first and _first_line(c) == first), None)
    if (anchor := caller or own) is None:
        return None
    cell = nbformat.v4.new_code_cell(check.source)
    nb.cells.insert(_index(nb, anchor) + 1, cell)
    where = "the cell calling it" if caller else "the exercise's own cell"
    notes.append(f"check cell of {name!r} was not found: put back after {where}, restored "
                 "from the source")
    return cell


def _first_line(cell: nbformat.NotebookNode) -> str:
    return next((line.strip() for line in cell.source.splitlines() if line.strip()), "")


def guard_checks(nb: nbformat.NotebookNode, nonce: str, hidden_seed: int | None = None
                 ) -> None:
    """Wrap every check cell: a fresh `minicb.course.check` (drawing hidden cases from
    `hidden_seed`, if any) first, the check's cases and the grader's mark last."""
    for i, name, points in check_cells(nb):
        cell = nb.cells[i]
        code = "\n".join("    " + line for line in cell.source.splitlines()) or "    pass"
        cell.source = GUARD.format(path=str(CHECK_MODULE), seed=hidden_seed, code=code,
                                   points=points, weights=case_weights(cell),
                                   name=name, cases=CASES.format(nonce=nonce, name=name),
                                   mark=MARK.format(nonce=nonce, name=name))


def skip_installs(nb: nbformat.NotebookNode) -> list[str]:
    """Replace every package-install line (`%pip`, `!pip`, `%conda`, `!conda`, ...) by a print
    saying it was skipped: it would install into the grader's own environment. Returns a note
    naming the cells, if any."""
    cells = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and INSTALL.search(cell.source):
            cell.source = INSTALL.sub(lambda m: f"{m['indent']}print({_skipped(m['line'])!r})",
                                      cell.source)
            cells.append(str(i + 1))
    if not cells:
        return []
    return [f"package installs skipped in cell{'s' * (len(cells) > 1)} {', '.join(cells)} "
            "(they would run in the grader's own environment)"]


def _skipped(line: str) -> str:
    return f"minicb grade: skipped {line.strip()} (no installs while grading)"


def _printed(cell: nbformat.NotebookNode, text: str) -> bool:
    return text in _stream_text(cell)


def _stream_text(cell: nbformat.NotebookNode) -> str:
    return "".join(str(out.get("text", "")) for out in cell.get("outputs", [])
                   if out.get("output_type") == "stream")


def _cases_printed(cell: nbformat.NotebookNode, nonce: str, name: str) -> dict[str, Any] | None:
    """The check's cases as its restored check cell printed them (`CASES`), else None."""
    marker = CASES.format(nonce=nonce, name=name)
    text = _stream_text(cell)
    if marker not in text:
        return None
    try:
        data = json.loads(text.split(marker, 1)[1].split("\n", 1)[0])
    except ValueError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("cases"), list) else None


def _error_of(cell: nbformat.NotebookNode) -> str | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            value = ANSI.sub("", str(out.get("evalue", ""))).strip()
            text = f"{out.get('ename', 'Error')}: {value}" if value else out.get("ename", "Error")
            return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 3] + "..."
    return None


def kernel_config(workdir: Path) -> Config:
    """How the grader reaches its kernel: over Unix sockets in the work folder where there are
    such sockets (over TCP any local user could reach it, and ipykernel 7 prints a warning per
    kernel saying so: thirty of them grading a class). A socket's path must fit in about 100
    bytes, "-<port>" included: under a long TMPDIR, TCP it is."""
    socket = str(workdir / "kernel")
    if os.name == "posix" and len(socket.encode()) <= MAX_SOCKET_PREFIX:
        return Config({"KernelManager": {"transport": "ipc", "ip": socket}})
    return Config()


def execute(nb: nbformat.NotebookNode, workdir: Path, timeout: int) -> list[str]:
    """Run every cell in a fresh kernel, errors and all; returns notes on how the run went.
    A cell past `timeout` is interrupted; one still running `timeout` later (it caught the
    interrupt) has its kernel killed. The notebook is then run again from the top in a fresh
    kernel with that cell replaced by one raising `TimeoutError`, so the exercises after it
    are still graded (at most MAX_RESTARTS times; after that the cells before it are graded).
    A cell whose kernel died under it (a segfault, the out-of-memory killer, `os._exit`) is
    replaced the same way by one raising `RuntimeError`. A note starting with STOPPED means
    the last run did not reach the end."""
    notes: list[str] = []
    while True:
        killed_at, why = _run_kernel(nb, workdir, timeout)
        if why is None:
            return notes
        if killed_at is not None:
            cell = nb.cells[killed_at]
            why = f"{_describe_cell(cell, killed_at)} {why}"
        if killed_at is None or len(notes) == MAX_RESTARTS:
            return notes + [STOPPED + why]
        error = ("RuntimeError('minicb grade: the kernel died while this cell ran (out of "
                 "memory?)')" if why.endswith(KERNEL_DIED) else
                 f"TimeoutError('minicb grade: this cell ignored the interrupt at {timeout} s "
                 "and its kernel was killed')")
        notes.append(f"{why}; the notebook was run again in a fresh kernel with that cell "
                     f"raising {error.split('(')[0]}")
        cell.source = f"raise {error}"
        for other in nb.cells:
            if other.cell_type == "code":
                other.outputs, other.execution_count = [], None


def _describe_cell(cell: nbformat.NotebookNode, index: int) -> str:
    """A cell as a learner finds it: an exercise's check cell by name, others by number and
    first line (a restored check cell starts with the grader's own lines)."""
    name = next((m["name"] for tag in cell_tags(cell) for m in [CHECK_TAG.match(tag)] if m), None)
    if name:
        return f"the check cell of {name!r}"
    first_line = next((line.strip() for line in cell.source.splitlines() if line.strip()), "")
    return f"cell {index + 1} ({first_line[:60]!r})"


def _run_kernel(nb: nbformat.NotebookNode, workdir: Path, timeout: int
                ) -> tuple[int | None, str | None]:
    """One run of the notebook in a fresh kernel: (index of the cell whose kernel was killed,
    why the run stopped), both None when it ran to its end."""
    from nbclient.exceptions import DeadKernelError

    config = kernel_config(workdir)
    # the grader's own Python, whatever kernel the learner's notebook names
    # shut down at once: a polite shutdown waited 1-3 s a notebook for a kernel to tidy up,
    # and what it leaves (its temporary files, in `workdir`) goes with the work folder
    client = _capped_client()(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                              interrupt_on_timeout=True, record_timing=False, config=config,
                              shutdown_kernel="immediate",
                              resources={"metadata": {"path": str(workdir)}})
    killed: list[int] = []
    running: list[int] = [-1]
    timer: list[threading.Timer] = []

    def kill() -> None:
        process = getattr(getattr(client.km, "provisioner", None), "process", None)
        if process is not None and process.poll() is None:
            killed.append(running[0])
            process.kill()

    def arm(cell_index: int = -1, **_) -> None:  # a timeout, an interrupt, and as long again
        running[0] = cell_index
        for pending in timer:
            pending.cancel()
        timer[:] = [threading.Timer(2 * timeout + 5, kill)]
        timer[0].daemon = True
        timer[0].start()

    client.on_cell_execute = arm
    kernel_env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get(
        "PYTHONPATH")) if p), "IPYTHONDIR": str(_ipython_dir(workdir)), "TMPDIR": str(workdir)}
    old = {key: os.environ.get(key) for key in kernel_env}
    os.environ.update(kernel_env)
    try:
        client.execute()
    except Exception as exc:  # the kernel died, was killed or would not start: grade what ran
        if killed:
            index = killed[0] if 0 <= killed[0] < len(nb.cells) else None
            return index, f"ignored the interrupt at {timeout} s and its kernel was killed"
        if isinstance(exc, DeadKernelError) and 0 <= running[0] < len(nb.cells):
            return running[0], KERNEL_DIED
        return None, f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    finally:
        for pending in timer:
            pending.cancel()
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if getattr(client, "_async_cleanup_kernel_future", None) is not None:
            # nbclient took the grader's Ctrl-C (or SIGTERM) and shut the kernel down: the
            # notebook did not fail, the run was stopped. Stop grading instead of scoring it 0.
            raise KeyboardInterrupt("grading interrupted")
    return None, None


# Run by the kernel at its start (an IPython startup file): each cell's printed text is cut in
# the kernel a little past MAX_CELL_OUTPUT, so one print of 200 MB never reaches the grader
# whole (it cost 1 GB there); the grader's client then cuts it to MAX_CELL_OUTPUT with a note.
CAP_STARTUP = """\
import sys as _minicb_sys
_minicb_sent = [0]
def _minicb_cap(stream, limit={limit}):
    write = stream.write
    def capped(text):
        if {mark!r} in str(text):  # the grader's check marks always pass
            return write(text)
        room = limit - _minicb_sent[0]
        _minicb_sent[0] += len(text)
        return write(text[:max(room, 0)]) if room < len(text) else write(text)
    stream.write = capped
for _minicb_stream in (_minicb_sys.stdout, _minicb_sys.stderr):
    _minicb_cap(_minicb_stream)
get_ipython().events.register("pre_run_cell", lambda *_: _minicb_sent.__setitem__(0, 0))
del _minicb_stream, _minicb_cap
"""


def _ipython_dir(workdir: Path) -> Path:
    """An IPython folder for the grader's kernels whose startup file caps printed output."""
    startup = workdir / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "00-minicb-grade-cap.py").write_text(CAP_STARTUP.format(
        limit=MAX_CELL_OUTPUT + 10_000, mark=MARK_PREFIX))
    return workdir / "ipython"


def _capped_client() -> type:
    """nbclient's NotebookClient keeping at most MAX_CELL_OUTPUT characters of a cell's printed
    and displayed output: a cell that prints without end would otherwise grow the grader's
    memory until its timeout. Errors and the check marks are always kept."""
    from nbclient import NotebookClient

    class CappedClient(NotebookClient):
        def output(self, outs: list, msg: dict, display_id: str | None,
                   cell_index: int) -> Any:
            content = msg.get("content") or {}
            text = str(content.get("text", ""))
            size = len(text) + sum(len(str(v)) for v in (content.get("data") or {}).values())
            sizes = self.__dict__.setdefault("_minicb_sizes", {})
            kept = sizes.get(cell_index, 0)
            if msg.get("msg_type") in ("stream", "display_data", "execute_result") and \
                    kept + size > MAX_CELL_OUTPUT and MARK_PREFIX not in text:
                if kept <= MAX_CELL_OUTPUT:  # keep what fits, and say it once
                    if msg["msg_type"] == "stream" and kept < MAX_CELL_OUTPUT:
                        head = {**content, "text": text[:MAX_CELL_OUTPUT - kept]}
                        super().output(outs, {**msg, "content": head}, display_id, cell_index)
                    outs.append(nbformat.v4.new_output(
                        "stream", name="stderr",
                        text=f"[minicb grade: output past {MAX_CELL_OUTPUT:,} characters "
                             "dropped]\n"))
                sizes[cell_index] = MAX_CELL_OUTPUT + 1
                return None
            sizes[cell_index] = kept + size
            return super().output(outs, msg, display_id, cell_index)

    return CappedClient


def grade_notebook(path: str | Path, timeout: int = 300, restore: bool = True,
                   source: str | Path | None = None, hidden_seed: int | None = None,
                   student: str = "", name: str | None = None) -> GradeReport:
    """Execute a copy of the notebook at `path` and score each exercise by its check cell.
    `source`: the exercise source whose check cells are restored (default: the file named
    `name` (else the notebook's own name) in exercises/source, if any); `restore=False`
    grades the notebook as it is. `hidden_seed`: the checks add cases drawn from it."""
    path = Path(path)
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:
        raise GradeError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
    report = GradeReport(str(path), student=student)
    expected = [(ex, points) for _, ex, points in check_cells(nb)]
    nonce = None
    if restore:
        source_path = Path(source) if source else source_for(path, nb, name)
        if source_path is None:
            raise GradeError(
                f"cannot tell which exercise notebook {path} was made from: its name matches "
                "no file in exercises/source and its content (exercise tags, check calls) "
                "names no single one, so its check cells cannot be restored. Name the source: "
                f"python -m minicb grade {path} --source exercises/source/NN_name.ipynb")
        try:
            source_nb = nbformat.read(source_path, as_version=4)
        except Exception as exc:
            raise GradeError(f"cannot read the source {source_path}: "
                             f"{type(exc).__name__}: {exc}") from exc
        expected, notes = restore_checks(nb, source_nb)
        report.source = source_path.stem
        named = name or path.name
        if source_path.name != named:
            notes.insert(0, f"check cells restored from {_shown(source_path)}")
            if not source and (SOURCES / named).is_file():
                notes.insert(0, f"named like {named}, but it holds the exercises of "
                                f"{source_path.name}: graded as those")
        report.notes.extend(notes)
        nonce = secrets.token_hex(8)
        guard_checks(nb, nonce, hidden_seed)
    report.notes.extend(skip_installs(nb))
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    t0 = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="minicb-grade-"))
    try:
        notes = execute(nb, workdir, timeout)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report.seconds = time.perf_counter() - t0
    report.notes.extend(notes)
    stopped = [note for note in notes if note.startswith(STOPPED)]
    if stopped and not any(c.get("execution_count") is not None or c.get("outputs")
                           for c in nb.cells if c.cell_type == "code"):
        raise GradeError(f"cannot grade {path}: its kernel ran no cell ({stopped[-1]})")

    checks = {ex: i for i, ex, _ in check_cells(nb)}
    previous = -1
    for ex, points in expected:
        index = checks.get(ex)
        if index is None:
            report.exercises.append(ExerciseResult(ex, 0, points, False,
                                                   "its check cell is missing"))
            continue
        cell = nb.cells[index]
        error = _error_of(cell)
        ran = cell.get("execution_count") is not None or bool(cell.get("outputs"))
        earlier = next((e for c in nb.cells[previous + 1:index] if c.cell_type == "code"
                        for e in [_error_of(c)] if e), None)
        previous = index
        finished = nonce is None or _printed(cell, MARK.format(nonce=nonce, name=ex))
        cases = _cases_printed(cell, nonce, ex) if nonce else None
        counts = _case_counts(cases)
        if ran and error is None and finished:
            report.exercises.append(ExerciseResult(ex, points, points, True, **counts))
            continue
        if not ran:
            message = "its check cell did not run (see the notes below)"
        elif error is None and stopped:
            message = ("its check cell was still running when the kernel was stopped (see the "
                       "notes below)")
        elif error is None:
            message = ("its check cell reported no error but did not run to its end (did an "
                       "earlier cell change how errors or printed output are handled?)")
        elif error.startswith("KeyboardInterrupt"):
            message = (f"{error}: a cell ran longer than {timeout} s and was interrupted "
                       "(an endless loop?)")
        elif earlier and error.startswith(("NameError", "AttributeError", "ImportError")):
            message = f"{earlier}  (then the check failed with {error.split(':')[0]})"
        else:
            message = error
        earned = float(cases.get("points") or 0) if cases and ran else 0.0
        report.exercises.append(ExerciseResult(ex, earned, points, False, message,
                                               attempted=not message.startswith(STUB_ERROR),
                                               **counts))
    if not all(e.passed for e in report.exercises):
        report.notes.extend(_first_setup_error(nb, set(checks.values())))
    return report


def _case_counts(cases: dict[str, Any] | None) -> dict[str, Any]:
    """cases_passed, cases_total and failed_cases of an ExerciseResult, from the check's
    printed cases (none printed: the check never got to them)."""
    if not cases:
        return {}
    failed = [{"name": c[0], "message": c[3] if len(c) > 3 else ""} for c in cases["cases"]
              if not c[2]]
    ran = {c[0] for c in cases["cases"]}
    failed += [{"name": f"({cases['total'] - len(ran)} cases not run)", "message": ""}] \
        if cases["total"] > len(ran) else []
    return {"cases_passed": 0 if cases.get("refused") else sum(1 for c in cases["cases"] if c[2]),
            "cases_total": cases["total"], "failed_cases": failed}


def _first_setup_error(nb: nbformat.NotebookNode, check_indices: set[int]) -> list[str]:
    """A note naming the first error before the first check cell (an import typo in the setup
    cell, say): later cells then fail for want of what it should have defined."""
    for i, cell in enumerate(nb.cells[:min(check_indices, default=0)]):
        if cell.cell_type == "code" and _check_name(cell) is None and (error := _error_of(cell)):
            return [f"{_describe_cell(cell, i)} raised {error.splitlines()[0]}; the cells after "
                    "it ran without whatever it should have defined"]
    return []


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def format_report(report: GradeReport) -> str:
    """A plain-text table: the student and notebook, one line per exercise (with its cases
    passed where some failed), then the total."""
    who = f"{report.student}: " if report.student else ""
    lines = [f"{who}{report.notebook}  ({report.seconds:.1f} s)"]
    width = max([len(e.name) for e in report.exercises] + [8])
    for e in report.exercises:
        mark = "✓" if e.passed else "✗"
        score = f"{_num(e.points)}/{_num(e.max_points)}"
        line = f"  {mark} {e.name.ljust(width)}  {score:>7}"
        if not e.passed and e.cases_total:
            line += f"  ({e.cases_passed} of {e.cases_total} cases)"
        if not e.passed:
            first, *rest = e.message.splitlines() or [""]
            line += f"  {first}" + "".join(f"\n      {r}" for r in rest)
        lines.append(line)
    for note in report.notes:
        lines.append(f"  note: {note}")
    lines.append(f"  total: {_num(report.score)}/{_num(report.max_score)}")
    return "\n".join(lines)


def notebook_rows(reports: list[GradeReport], failures: dict[str, str] | None = None,
              order: list[str] | None = None) -> list[dict[str, Any]]:
    """One spreadsheet row per notebook: its name, exercise source, total, points per exercise
    (a column for every exercise any notebook holds, blank where it holds none), seconds, the
    first line of each failed exercise's message, the notes; a notebook that could not be
    graded (`failures`: notebook -> why) gets a row with its error and no score. Rows follow
    `order` (the notebooks as given), else reports first, then failures."""
    failures = failures or {}
    columns: list[str] = []
    for report in sorted(reports, key=lambda r: r.source):
        columns += [e.name for e in report.exercises if e.name not in columns]
    rows = {}
    for report in reports:
        points = {e.name: _num(e.points) for e in report.exercises}
        failed = [f"{e.name}: {(e.message.splitlines() or [''])[0]}"
                  for e in report.exercises if not e.passed]
        rows[report.notebook] = {
            "student": report.student, "notebook": report.notebook, "source": report.source,
            "score": _num(report.score), "max_score": _num(report.max_score),
            **{name: points.get(name, "") for name in columns},
            "seconds": round(report.seconds, 1), "error": "",
            "not_attempted": " ".join(e.name for e in report.exercises if not e.attempted),
            "feedback": " | ".join(failed), "notes": " | ".join(report.notes)}
    for notebook, why in failures.items():
        rows[notebook] = {"student": "", "notebook": notebook, "source": "", "score": "",
                          "max_score": "",
                          **{name: "" for name in columns}, "seconds": "", "error": why,
                          "not_attempted": "", "feedback": "", "notes": ""}
    names = order if order is not None else list(rows)
    return [rows[name] for name in names if name in rows]


def notebooks_in(paths: list[Path]) -> list[Path]:
    """The notebooks to grade: each path as given, a folder replaced by every .ipynb below it
    in name order (Jupyter's .ipynb_checkpoints copies left out); a notebook named twice (a
    folder and a file in it, `a.ipynb` and `./a.ipynb`) is graded once."""
    found, seen = [], set()
    for path in paths:
        below = (sorted(p for p in path.rglob("*.ipynb")
                        if ".ipynb_checkpoints" not in p.relative_to(path).parts)
                 if path.is_dir() else [path])
        for notebook in below:
            if (resolved := notebook.resolve()) not in seen:
                seen.add(resolved)
                found.append(notebook)
    return found


def _ignore_interrupts() -> None:
    """In a --jobs worker: Ctrl-C is the main process's to handle (it stops the workers), not
    one more error to grade the next notebook past."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def submissions_in(paths: list[Path]) -> list[Submission]:
    """`notebooks_in(paths)`, each with the student who handed it in and the exercise notebook
    it is, read from the class folder's layout (`classroom.submission`)."""
    known = [p.name for p in SOURCES.glob("*.ipynb")]
    found: dict[Path, Submission] = {}
    for path in paths:
        for notebook in notebooks_in([path]):
            if (resolved := notebook.resolve()) not in found:
                found[resolved] = submission(notebook, path if path.is_dir() else None, known)
    return list(found.values())


def _grade_or_why(sub: Submission, timeout: int, restore: bool, source: Path | None,
                  hidden_seed: int | None) -> GradeReport | str:
    """`grade_notebook`, or why the notebook cannot be graded (one line)."""
    try:
        return grade_notebook(sub.path, timeout=timeout, restore=restore, source=source,
                              hidden_seed=hidden_seed, student=sub.student, name=sub.notebook)
    except GradeError as exc:
        return str(exc)
    except Exception as exc:  # a malformed notebook: say so, grade the others
        return f"cannot grade {sub.path}: {type(exc).__name__}: {exc}"


def _in_workers(grade_one: Callable[[Any], GradeReport | str], notebooks: list[Any],
                jobs: int) -> Iterator[GradeReport | str]:
    """`grade_one` of each notebook in the order given, `jobs` at a time in worker processes.
    A worker that dies (out of memory, a crash) breaks its pool and fails every notebook the
    pool was grading: those are graded again one at a time, and one whose worker dies alone is
    `cannot grade ...: WORKER_DIED`; a fresh pool grades the rest."""
    results: dict[int, GradeReport | str] = {}
    queue, suspects, shown = list(range(len(notebooks))), [], 0
    while queue or suspects:
        alone = bool(suspects)  # the culprit is among them: one at a time finds it
        for i, result in _pool_run(grade_one, notebooks, suspects if alone else queue,
                                   1 if alone else jobs):
            if result is None and not alone:
                suspects.append(i)
                continue
            path = getattr(notebooks[i], "path", notebooks[i])
            results[i] = f"cannot grade {path}: {WORKER_DIED}" if result is None else result
            while shown in results:
                yield results.pop(shown)
                shown += 1


def _pool_run(grade_one: Callable[[Any], GradeReport | str], notebooks: list[Any],
              batch: list[int], width: int) -> Iterator[tuple[int, GradeReport | str | None]]:
    """(index, result) of the notebooks at the indices in `batch` as they finish, `width` at a
    time in a fresh pool; None when the pool broke under it. Indices are taken from `batch` as
    they are submitted, and none after the pool broke: the rest stay there for the next pool."""
    # Separate processes, not threads: each grading drives its own kernel client and its own
    # timers; "spawn" because a forked child would inherit the parent's.
    pool = ProcessPoolExecutor(min(width, len(batch)), initializer=_ignore_interrupts,
                               mp_context=multiprocessing.get_context("spawn"))
    running: dict[Future, int] = {}
    broken = finished = False
    try:
        while running or (batch and not broken):
            while batch and not broken and len(running) < width:
                try:
                    running[pool.submit(grade_one, notebooks[batch[0]])] = batch[0]
                    batch.pop(0)
                except BrokenProcessPool:
                    broken = True
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                index = running.pop(future)
                try:
                    result = future.result()
                except BrokenProcessPool:
                    broken, result = True, None
                yield index, result
        finished = True
    finally:  # interrupted: no waiting for the workers (the caller kills them)
        pool.shutdown(wait=finished, cancel_futures=True)


def _entry(sub: Submission, result: GradeReport | str) -> dict[str, Any]:
    """A notebook's line in `--results` and entry in `--json`: the report's `to_dict`, or
    {"student", "notebook", "error"} for one that could not be graded (a script must not
    lose it unnoticed)."""
    if isinstance(result, str):
        return {"student": sub.student, "notebook": str(sub.path), "error": result}
    return result.to_dict()


def read_results(path: Path) -> dict[str, dict[str, Any]]:
    """The entries a `--results` file holds, by notebook path (a line cut off by a stopped
    run is left out: that notebook is graded again)."""
    entries = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and "notebook" in entry:
                entries[entry["notebook"]] = entry
    return entries


def _writable(parser: argparse.ArgumentParser, option: str, path: Path | None) -> None:
    """Refuse an output file that would overwrite a notebook or whose folder cannot be
    written, before grading, so no run is lost."""
    if path is None:
        return
    if path.suffix == ".ipynb":
        parser.error(f"{option} {path} would overwrite a notebook: name a .csv file")
    if not (path.parent.is_dir() and os.access(path.parent, os.W_OK)):
        parser.error(f"{option} {path}: its folder does not exist or cannot be written "
                     "(checked before grading, so no run is lost)")


def main(argv: list[str] | None = None) -> int:
    """`python -m minicb grade NOTEBOOK|DIR [...] [--json] [--csv FILE] [--gradebook FILE]
    [--feedback DIR] [--results FILE [--resume]] [--hidden-seed N] [--jobs N] [--timeout S]
    [--no-restore] [--source PATH]`."""
    parser = argparse.ArgumentParser(
        prog="python -m minicb grade",
        description="Execute exercise notebooks and score each exercise by its check cell.")
    parser.add_argument("notebooks", nargs="+", type=Path,
                        help="notebooks, or folders: every .ipynb below one (a class's "
                             "submissions: DIR/<student>/<assignment>/<nb>.ipynb as nbgrader "
                             "keeps them, DIR/<student>/<nb>.ipynb, or LMS downloads named "
                             "<student>_<anything>_<nb>.ipynb), checkpoints left out")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON object (a list of them for several notebooks); one "
                             "that could not be graded is {\"notebook\": ..., \"error\": ...}")
    parser.add_argument("--csv", type=Path, metavar="FILE",
                        help="also write a table with one row per notebook, a column per "
                             "exercise, rows for notebooks that could not be graded")
    parser.add_argument("--gradebook", type=Path, metavar="FILE",
                        help="also write a gradebook: one row per student (total, max, a "
                             "column per exercise, the notebooks missing)")
    parser.add_argument("--feedback", type=Path, metavar="DIR",
                        help="also write DIR/<student>/<notebook>.html for each notebook: "
                             "points and explanations, for the student")
    parser.add_argument("--results", type=Path, metavar="FILE",
                        help="append each notebook's result to FILE (JSON Lines) as it "
                             "finishes (default with --gradebook: the gradebook's name with "
                             ".jsonl)")
    parser.add_argument("--resume", action="store_true",
                        help="skip the notebooks the --results file already holds (a stopped "
                             "run goes on where it stopped)")
    parser.add_argument("--hidden-seed", type=int, metavar="N",
                        help="add hidden cases to every check, drawn from N (keep N to "
                             "yourself; students' own check cells run the public cases only)")
    parser.add_argument("--jobs", "-j", type=int, default=1, metavar="N",
                        help="grade N notebooks at a time, each in its own process and kernel "
                             "(default 1; at most one per core pays)")
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds a single cell may run before it is interrupted (default "
                             "300; 60 keeps a class batch short: an endless loop costs a "
                             "timeout per cell that calls it)")
    parser.add_argument("--no-restore", action="store_true",
                        help="grade the notebook's own check cells as they are (proves "
                             "nothing about a submission)")
    parser.add_argument("--source", type=Path,
                        help="the exercise source to restore check cells from (default: "
                             "exercises/source/<same file name>, else the one the "
                             "notebook's content identifies)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.timeout < 1:  # 0 or less would interrupt every cell at once and kill its kernel
        parser.error(f"--timeout must be at least 1 second, got {args.timeout}")
    if args.results is None and args.gradebook is not None:
        args.results = args.gradebook.with_suffix(".jsonl")
    if args.resume and args.results is None:
        parser.error("--resume needs the --results file of the run to go on with")
    for option in ("csv", "gradebook", "results"):
        _writable(parser, f"--{option}", getattr(args, option))
    if args.feedback is not None and args.feedback.suffix == ".ipynb":
        parser.error(f"--feedback {args.feedback} names a notebook: name a folder")
    subs = submissions_in(args.notebooks)
    if not subs:
        parser.error("no .ipynb file in the folders given")
    done = read_results(args.results) if args.resume else {}
    if args.results is not None and not args.resume:
        args.results.write_text("", encoding="utf-8")
    todo = [sub for sub in subs if str(sub.path) not in done]
    if done:
        print(f"resuming: {len(subs) - len(todo)} notebook(s) already in {args.results}",
              file=sys.stderr)
    grade_one = functools.partial(_grade_or_why, timeout=args.timeout,
                                  restore=not args.no_restore, source=args.source,
                                  hidden_seed=args.hidden_seed)
    entries = {str(sub.path): done[str(sub.path)] for sub in subs if str(sub.path) in done}
    interrupted = False
    parallel = args.jobs > 1 and len(todo) > 1
    results = _in_workers(grade_one, todo, args.jobs) if parallel else map(grade_one, todo)
    try:
        for sub, result in zip(todo, results):
            entries[str(sub.path)] = entry = _entry(sub, result)
            if args.results is not None:
                with open(args.results, "a", encoding="utf-8") as f:
                    f.write(json.dumps(entry, ensure_ascii=False) + "\n")
            if isinstance(result, str):
                print(f"error: {result}", file=sys.stderr)
            elif not args.json:
                print(format_report(result), flush=True)
    except KeyboardInterrupt:  # Ctrl-C: stop now, keep what was graded
        interrupted = True
        for worker in multiprocessing.active_children():
            worker.kill()  # its kernel exits with it (ipykernel polls its parent)
    if interrupted:
        print(f"interrupted: {len(entries)} notebook(s) graded", file=sys.stderr)
        for sub in subs:
            entries.setdefault(str(sub.path), _entry(
                sub, "not graded: the run was interrupted (Ctrl-C)"))
    ordered = [entries[str(sub.path)] for sub in subs if str(sub.path) in entries]
    reports = [GradeReport.from_dict(e) for e in ordered if "exercises" in e]
    failures = {e["notebook"]: e["error"] for e in ordered if "error" in e}
    if args.json:
        one = len(subs) == 1  # a list whenever several were asked for
        print(json.dumps(ordered[0] if one and ordered else ordered, indent=1,
                         ensure_ascii=False))
    elif len(reports) > 1:
        total = sum(r.score for r in reports)
        top = sum(r.max_score for r in reports)
        print(f"all notebooks: {_num(total)}/{_num(top)}")
    if args.csv is not None:
        write_csv(args.csv, notebook_rows(reports, failures, order=[str(s.path) for s in subs]))
        print(f"table: {args.csv} ({len(reports)} graded, {len(failures)} not)",
              file=sys.stderr)
    if args.gradebook is not None:
        write_csv(args.gradebook, gradebook_rows(ordered))
        print(f"gradebook: {args.gradebook} ({len({e.get('student') for e in ordered})} "
              "student(s))", file=sys.stderr)
    if args.feedback is not None:
        for entry in ordered:
            page = feedback_path(args.feedback, entry)
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(feedback_html(entry), encoding="utf-8")
        print(f"feedback: {len(ordered)} page(s) in {args.feedback}", file=sys.stderr)
    return 130 if interrupted else 2 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
