"""A class's submissions: who handed in what, a gradebook row per student, a feedback page
per student and notebook (`python -m minicb grade DIR --gradebook --feedback`).

The grader (`minicb.course.grade`) scores one notebook; this module reads a class folder and
writes what a teacher hands back. It works on the grader's plain results (`GradeReport.to_dict`:
the lines of its `--results` file), so a resumed run and a fresh one write the same files.

A class folder comes in one of three layouts, told apart notebook by notebook:

    DIR/<student>/<assignment>/<notebook>.ipynb   nbgrader's submitted/ or autograded/
    DIR/<student>/<notebook>.ipynb                a folder per student
    DIR/<student>_<anything>_<notebook>.ipynb     an LMS download (Canvas, Moodle, ...)

An LMS name is recognised by its end: an exercise notebook's name (`02_static_batching.ipynb`,
a `-1` resubmission suffix allowed); the student is what comes before the first underscore.
"""

from __future__ import annotations

import csv
import html
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESUBMITTED = re.compile(r"-\d+$")  # Canvas appends -1, -2 to a file handed in again


@dataclass(frozen=True)
class Submission:
    """One notebook of a class: its path, the student who handed it in ("" for a notebook
    named on its own) and the exercise notebook it is (its file name, or the one an LMS name
    ends with)."""

    path: Path
    student: str
    notebook: str


def submission(path: Path, folder: Path | None, known: Iterable[str]) -> Submission:
    """Who handed in the notebook at `path`, found below `folder` (None: named on its own),
    and which of the `known` exercise notebooks it is."""
    parts = path.relative_to(folder).parts if folder is not None else (path.name,)
    if len(parts) >= 2:  # a folder per student, or nbgrader's <student>/<assignment>/
        return Submission(path, parts[0], _lms_notebook(path.name, known) or path.name)
    if path.name in known:
        return Submission(path, "", path.name)
    notebook = _lms_notebook(path.name, known)
    if notebook is None or "_" not in path.name.removesuffix(notebook):
        return Submission(path, "", path.name)
    return Submission(path, path.name.split("_", 1)[0], notebook)


def _lms_notebook(name: str, known: Iterable[str]) -> str | None:
    """The known notebook a file name ends with (`<anything>_<notebook>`), if any."""
    stem = RESUBMITTED.sub("", name.removesuffix(".ipynb"))
    matches = [k for k in known if stem == k.removesuffix(".ipynb")
               or stem.endswith("_" + k.removesuffix(".ipynb"))]
    return max(matches, key=len) if matches else None


def student_label(student: str) -> str:
    """A student's name as the gradebook and the feedback folders show it."""
    return student or "(no name)"


def gradebook_rows(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per student: student, total, max, the points of every exercise of every
    notebook graded in the class (blank where the student handed nothing in for it), then the
    notebooks of the class the student did not hand in (`missing`) and those that could not
    be graded (`not_graded`, with why). `max` counts every notebook of the class, handed in or
    not. A notebook handed in twice counts once: the last one graded."""
    graded = [e for e in entries if "exercises" in e]
    columns: dict[str, str] = {}  # exercise -> its notebook
    notebooks: dict[str, float] = {}  # notebook -> its max score
    for entry in sorted(graded, key=lambda e: e.get("source", "")):
        for ex in entry["exercises"]:
            columns.setdefault(ex["name"], entry["source"])
        notebooks[entry["source"]] = max(notebooks.get(entry["source"], 0), entry["max_score"])
    students: dict[str, dict[str, dict[str, Any]]] = {}
    failed: dict[str, list[str]] = {}
    for entry in entries:
        student = entry.get("student", "")
        if "exercises" in entry:
            students.setdefault(student, {})[entry["source"]] = entry
        else:
            students.setdefault(student, {})
            failed.setdefault(student, []).append(
                f"{Path(entry['notebook']).name}: {entry['error']}")
    rows = []
    for student, handed_in in students.items():
        points = {ex["name"]: ex["points"] for e in handed_in.values() for ex in e["exercises"]}
        total = sum(e["score"] for e in handed_in.values())
        rows.append({"student": student_label(student), "total": _num(total),
                     "max": _num(sum(notebooks.values())),
                     **{name: points.get(name, "") for name in columns},
                     "missing": " ".join(n for n in notebooks if n not in handed_in),
                     "not_graded": " | ".join(failed.get(student, []))})
    return sorted(rows, key=lambda r: r["student"])


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Rows as a CSV file: UTF-8 with a byte-order mark (so a spreadsheet on Windows reads
    accented names and Chinese messages right), a header line, one line per row. A text cell
    that a spreadsheet would take for a formula (starting with = + - @) is written with a
    leading apostrophe, so a file name cannot run as one."""
    with open(path, "w", newline="", encoding="utf-8-sig") as f:
        if not rows:
            return
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({key: "'" + value if isinstance(value, str)
                          and value.startswith(("=", "+", "-", "@", "\t", "\r")) else value
                          for key, value in row.items()} for row in rows)


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else round(x, 2)


STYLE = """body{font-family:system-ui,sans-serif;max-width:52em;margin:2em auto;padding:0 1em;
color:#222}h1{font-size:1.4em}table{border-collapse:collapse;width:100%}td,th{border-bottom:1px
solid #ddd;padding:.4em;text-align:left;vertical-align:top}.ok{color:#1a7f37}.no{color:#b42318}
pre{white-space:pre-wrap;background:#f6f8fa;padding:.6em;border-radius:4px;font-size:.9em}
.note{color:#555;font-size:.9em}"""


def feedback_html(entry: dict[str, Any]) -> str:
    """A page for one student and notebook: the total, then each exercise with its points,
    how many of its check's cases passed, and, where it lost points, the check's explanation
    (the first failed case in full, one line for each other); then the grader's notes."""
    title = f"{student_label(entry.get('student', ''))}: {Path(entry['notebook']).name}"
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
           f"</title><style>{STYLE}</style></head><body>", f"<h1>{html.escape(title)}</h1>"]
    if "error" in entry:
        out.append(f"<p class='no'>This notebook could not be graded: "
                   f"{html.escape(entry['error'])}</p></body></html>")
        return "\n".join(out)
    out.append(f"<p><b>Total: {_num(entry['score'])} / {_num(entry['max_score'])} points"
               "</b></p><table><tr><th>exercise</th><th>points</th><th>cases passed</th>"
               "<th>what the check found</th></tr>")
    for ex in entry["exercises"]:
        mark = "<span class='ok'>✓</span>" if ex["passed"] else "<span class='no'>✗</span>"
        cases = (f"{ex['cases_passed']} of {ex['cases_total']}"
                 if ex.get("cases_total") is not None else "–")
        why = f"<pre>{html.escape(ex['message'])}</pre>" if ex["message"] else ""
        out.append(f"<tr><td>{mark} {html.escape(ex['name'])}</td>"
                   f"<td>{_num(ex['points'])} / {_num(ex['max_points'])}</td><td>{cases}</td>"
                   f"<td>{why}</td></tr>")
    out.append("</table>")
    out += [f"<p class='note'>Note: {html.escape(note)}</p>" for note in entry["notes"]]
    out.append("</body></html>")
    return "\n".join(out)


def feedback_path(folder: Path, entry: dict[str, Any]) -> Path:
    """Where `feedback_html` of an entry goes: FOLDER/<student>/<notebook>.html, the notebook
    named as the exercise notebook it is (an LMS download's own name is long)."""
    student = re.sub(r"[^\w.@ -]", "_", student_label(entry.get("student", "")))
    return folder / student / ((entry.get("source") or Path(entry["notebook"]).stem) + ".html")
