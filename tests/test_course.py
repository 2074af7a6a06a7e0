"""The course hangs together: every chapter exists in order, the README's course map lists each
one in reading order, and every relative link in the chapters and the README resolves."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
LINK = re.compile(r"\]\(([^)\s#]+)(#[^)]*)?\)")


def test_chapters_are_numbered_00_to_08_without_gaps():
    """The chapter notebooks are numbered 00 to 08 with no gap, and each has its source in
    chapters/src."""
    numbers = [int(p.name[:2]) for p in CHAPTERS]
    assert numbers == list(range(9)), [p.name for p in CHAPTERS]
    for path in CHAPTERS:
        assert (ROOT / "chapters" / "src" / (path.stem + ".py")).exists(), f"no source for {path}"


def test_readme_course_map_lists_every_chapter_in_order():
    """The README's course map links every chapter notebook, in order."""
    readme = (ROOT / "README.md").read_text()
    course_map = readme.split("## The course map", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"\(chapters/(\d\d_[a-z_]+)\.ipynb\)", course_map)
    assert listed == [p.stem for p in CHAPTERS]


GETSOURCE = re.compile(r"inspect\.getsource\(([\w.]+)\)")
IMPORT = re.compile(r"^(?:from minicb[\w.]* import [\w, ]+|import minicb[\w.]*(?: as \w+)?)$", re.M)


def stored_text(cell: dict) -> str:
    """What a stored code cell printed (its stream outputs)."""
    return "".join("".join(o.get("text", "")) for o in cell["outputs"])


def test_every_printed_engine_source_is_the_current_source():
    """A chapter that prints engine code with `inspect.getsource` stores that print as a checked
    output; every such stored print equals the current source, so an engine edit that leaves it
    stale fails here in seconds instead of in the notebook run."""
    import inspect
    stale = []
    for path in CHAPTERS:
        cells = json.loads(path.read_text())["cells"]
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        namespace: dict = {}
        exec("\n".join(IMPORT.findall("\n".join(code))), namespace)
        for cell in cells:
            source = "".join(cell["source"])
            if cell["cell_type"] != "code" or "NBVAL_CHECK_OUTPUT" not in source:
                continue
            stored = stored_text(cell)
            for name in GETSOURCE.findall(source):
                if inspect.getsource(eval(name, namespace)) not in stored:
                    stale.append(f"{path.name}: {name}")
    assert not stale, f"rebuild these cells' outputs: {stale}"


def test_chapter_prose_keeps_the_word_budget():
    """Chapter prose (markdown cells) stays within 16,000 words in all and 3,000 a chapter, and
    no sentence runs over 40 words (`tools/wordcount.py` prints the table)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import wordcount
    counts = {p.stem: wordcount.count(p) for p in wordcount.chapters()}
    assert len(counts) == len(CHAPTERS)
    assert sum(c["words"] for c in counts.values()) <= wordcount.TOTAL
    assert {n: c["words"] for n, c in counts.items() if c["words"] > wordcount.PER_CHAPTER} == {}
    assert {n: c["long"] for n, c in counts.items() if c["long"]} == {}


def markdown_of(notebook: Path) -> str:
    cells = json.loads(notebook.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def test_each_exercise_notebook_says_what_it_needs_and_the_teaching_pages_points_and_time():
    """A teacher reads an exercise notebook's first cell for what it needs, its points, how
    long it takes and how to grade it; its points and study time are docs/teaching.md's
    table's, so the two cannot drift."""
    table = (ROOT / "docs" / "teaching.md").read_text()
    for path in sorted((ROOT / "exercises").glob("*.ipynb")):
        first = "".join(json.loads(path.read_text())["cells"][0]["source"])
        row = re.search(rf"^\| {path.stem} \|.*\| (\d+) \| ([^|]+) \|$", table, re.M)
        assert row, f"{path.stem}: no row in docs/teaching.md's exercise table"
        assert f"**Study time:** about {row.group(2).strip()}." in first, path.name
        assert f"**Points:** {row.group(1)} points in all" in first, path.name
        assert "**Needs:** a CPU" in first and f"minicb grade exercises/{path.name}" in first


def test_every_relative_link_resolves():
    """Every relative link in the chapters, the exercise notebooks and their sources, the README and
    bench/README points at a file that exists."""
    documents = [(p, markdown_of(p)) for p in CHAPTERS]
    documents += [(p, markdown_of(p)) for p in sorted((ROOT / "exercises").glob("*.ipynb"))]
    documents += [(p, markdown_of(p))  # where a teacher edits them
                  for p in sorted((ROOT / "exercises" / "source").glob("*.ipynb"))]
    documents += [(ROOT / "README.md", (ROOT / "README.md").read_text()),
                  (ROOT / "bench" / "README.md", (ROOT / "bench" / "README.md").read_text())]
    broken = []
    for path, text in documents:
        for target, _ in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_every_chapter_opens_with_goals_and_ends_with_a_recap():
    """Every chapter's first cell states its goals and its last markdown cell is a recap or
    summary."""
    for path in CHAPTERS:
        cells = json.loads(path.read_text())["cells"]
        first = "".join(cells[0]["source"]).lower()
        last_md = next("".join(c["source"]).lower() for c in reversed(cells)
                       if c["cell_type"] == "markdown")
        assert "you will" in first or "able to" in first, f"{path.name}: no goals up front"
        assert "recap" in last_md or "summary" in last_md, f"{path.name}: no recap at the end"


def student_copy(tmp_path: Path) -> Path:
    """`make student-release` into tmp_path (skips where git or make is missing)."""
    if shutil.which("git") is None or shutil.which("make") is None or \
            not (ROOT / ".git").exists():
        pytest.skip("needs git, make and a git checkout")
    copy = tmp_path / "minicb-student"
    subprocess.run(["make", "-s", "student-release", f"STUDENT={copy}",
                    f"BIN={Path(sys.executable).parent}"], cwd=ROOT, check=True,
                   capture_output=True)
    return copy


def release_plan(student: str) -> subprocess.CompletedProcess:
    """`make -n student-release STUDENT=student`: the commands it would run, none run."""
    if shutil.which("make") is None:
        pytest.skip("needs make")
    return subprocess.run(["make", "-n", "student-release", f"STUDENT={student}"], cwd=ROOT,
                          capture_output=True, text=True)


def test_student_release_takes_a_trailing_slash_and_refuses_the_repository(tmp_path):
    """STUDENT=dir/ made no tarball (`tar -C dir/ ''`); STUDENT=. or a folder above the
    repository would have been rm -rf'd. And the exercises are checked before anything ships."""
    plan = release_plan(f"{tmp_path}/stu/")
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    assert f"tar -czf {tmp_path}/stu.tar.gz -C {tmp_path}/ stu" in lines
    check = next(i for i, line in enumerate(lines) if "-m minicb.course.exercises check" in line)
    assert check < next(i for i, line in enumerate(lines) if line.startswith("rm -rf"))
    for unsafe in (".", "..", str(ROOT) + "/", "/", ""):
        plan = release_plan(unsafe)
        assert plan.returncode != 0 and "rm -rf" not in plan.stdout
        assert "is this repository or a folder above it" in plan.stderr


def code_of(path: Path) -> str:
    return "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])


def solution_blocks() -> list[str]:
    """The text between every pair of solution markers in the exercise sources."""
    blocks = []
    for source in sorted((ROOT / "exercises" / "source").glob("*.ipynb")):
        for cell in json.loads(source.read_text())["cells"]:
            text = "".join(cell["source"])
            blocks += [body.strip() for body in
                       re.findall(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", text, re.S)]
    return blocks


def test_the_student_copy_holds_no_answer(tmp_path):
    """`make student-release`: the committed course without solutions/, the exercise sources
    (the stubs stand in for them) and the exercises' tests; no notebook in it holds the text of
    any solution, and the course tests still pass in the copy (no link into what was removed)."""
    copy = student_copy(tmp_path)
    assert (tmp_path / "minicb-student.tar.gz").stat().st_size > 0
    assert not (copy / "solutions").exists()
    assert not (copy / "tests" / "test_exercises.py").exists()
    stubs = sorted(p.name for p in (ROOT / "exercises").glob("*.ipynb"))
    assert sorted(p.name for p in (copy / "exercises").glob("*.ipynb")) == stubs
    assert sorted(p.name for p in (copy / "exercises" / "source").glob("*.ipynb")) == stubs
    assert (copy / "chapters" / "00_setup_and_tour.ipynb").exists()
    blocks = solution_blocks()
    assert len(blocks) >= 16 and all(blocks)
    solved = "\n".join(code_of(p) for p in (ROOT / "solutions").glob("*.ipynb"))
    assert all(b in solved for b in blocks)  # the search finds an answer where there is one
    leaks = [(p.relative_to(copy), b[:60]) for p in copy.rglob("*.ipynb") for text in [code_of(p)]
             for b in blocks if b in text]
    assert not leaks, leaks
    texts = {p: p.read_text(errors="replace") for p in copy.rglob("*")
             if p.is_file() and p.suffix in (".py", ".md", ".txt", ".cfg", ".toml")}
    leaks = [(p.relative_to(copy), b[:60]) for p, text in texts.items() for b in blocks
             if b in text]
    assert not leaks, leaks
    # a test beside the answers may hold one of them in other words: no long line of an answer
    # may appear in the copy's tests (minicb/ itself is the engine the exercises rebuild)
    answer_lines = {line.strip() for b in blocks for line in b.splitlines()
                    if len(line.strip()) >= 50}
    leaks = [(p.relative_to(copy), line[:60]) for p, text in texts.items()
             if p.parent.name == "tests" for line in answer_lines if line in text]
    assert not leaks, leaks
    assert not any((copy / "tests" / name).exists()
                   for name in ("test_check.py", "test_grade.py"))
    # collection alone does not see an import inside a test function, or a path into the
    # removed folders: a test that needs either would fail in the student's `make test` (this
    # file's own student-copy tests skip there: the copy is no git checkout)
    needs_removed = [p.name for p in (copy / "tests").glob("test_*.py")
                     if p.name != "test_course.py"
                     if re.search(r'^\s*(from|import) test_(exercises|check|grade)\b|"solutions"|'
                                  r'"exercises" / "source"', p.read_text(), re.M)]
    assert not needs_removed, needs_removed
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_course.py", "-k", "not student_copy"], cwd=copy,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:]
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                "--collect-only", "tests"], cwd=copy, capture_output=True,
                               text=True)
    assert collected.returncode == 0, collected.stdout[-2000:]  # no test needs what was removed


def test_a_student_resets_an_exercise_in_the_student_copy(tmp_path):
    """`make reset` works in the copy too, where the stubs stand in for the sources."""
    copy = student_copy(tmp_path)
    notebook = copy / "exercises" / "02_static_batching.ipynb"
    fresh = notebook.read_text()
    notebook.write_text(fresh.replace("NotImplementedError", "half done"))
    done = subprocess.run([sys.executable, "-m", "minicb.course.exercises", "reset",
                           "exercises/02_static_batching.ipynb"], cwd=copy,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert notebook.read_text() == fresh
    assert "half done" in next((copy / "exercises" / ".backup").glob("*.ipynb")).read_text()


@pytest.mark.slow
def test_a_student_grades_an_exercise_in_the_student_copy(tmp_path):
    """Every exercise notebook tells the learner to run the grader: in the copy it restores the
    check cells from the stubs standing in for the sources."""
    copy = student_copy(tmp_path)
    done = subprocess.run([sys.executable, "-m", "minicb", "grade",
                           "exercises/02_static_batching.ipynb", "--json"], cwd=copy,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["source"] == "02_static_batching" and report["max_score"] == 2
    assert all(e["message"].startswith("NotImplementedError") for e in report["exercises"])


def test_the_code_is_ruff_clean():
    """The style rule every module and test keeps (`make lint` runs it too): `ruff check`
    over the engine, the tests and the benchmark scripts finds nothing."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "minicb", "tests", "bench"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def fake_venv(tmp_path: Path, cuda: bool | None = None, pip_fails: bool = False) -> Path:
    """A .venv stand-in for testing the Makefile: its python runs `-c` snippets with the real
    interpreter over a fake `torch` (CUDA or not) and ignores everything else; its pip logs its
    arguments and the requirements it is given."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = tmp_path / "fake-torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"class version:\n    cuda = {'12.4' if cuda else None!r}\n")
    log = tmp_path / "pip.log"
    (venv / "bin" / "python").write_text(
        f'#!/bin/sh\nif [ "$1" = "-c" ]; then PYTHONPATH={fake.parent} exec {sys.executable} "$@"; '
        'fi\nexit 0\n')
    (venv / "bin" / "pip").write_text(
        f'#!/bin/sh\necho "pip $*" >> {log}\n'
        f'if [ "$3" = "-r" ]; then cat "$4" >> {log}; fi\n'
        f'if [ "$5" = "-r" ]; then cat "$6" >> {log}; fi\nexit {1 if pip_fails else 0}\n')
    for tool in ("python", "pip"):
        (venv / "bin" / tool).chmod(0o755)
    return venv


def make(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("make") is None:
        pytest.skip("no make")
    return subprocess.run(["make", "-s", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("cuda", [True, False])
def test_make_keeps_a_cuda_torch_and_pins_the_rest(tmp_path, cuda):
    """`make`'s install step on a .venv that already holds a CUDA build of torch (the GPU
    install) installs every pin of both requirement files but torch's and triton's; on a CPU
    torch, all of them."""
    venv = fake_venv(tmp_path, cuda)
    done = make("setup", f"VENV={venv}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (venv / ".installed").exists()
    installed = (tmp_path / "pip.log").read_text()
    pins = (ROOT / "requirements.txt").read_text() + (ROOT / "requirements-dev.txt").read_text()
    assert "transformers==" in installed and "nbval==" in installed
    assert ("torch==" in installed) is not cuda and ("triton==" in installed) is not cuda
    assert ("keeping .venv's CUDA build" in done.stdout) is cuda
    assert installed.count("==") >= pins.count("==") - (2 if cuda else 0)


def test_a_failed_install_stops_make(tmp_path):
    """When pip fails, `make setup` fails and does not mark the environment installed."""
    venv = fake_venv(tmp_path, cuda=True, pip_fails=True)
    assert make("setup", f"VENV={venv}").returncode != 0
    assert not (venv / ".installed").exists()


def test_make_reset_asks_for_the_notebook_before_installing(tmp_path):
    """`make reset` without NB fails with the usage line before installing anything, and `make lab`
    opens chapter 00 with LAB_ARGS passed on."""
    venv = fake_venv(tmp_path)
    done = make("reset", f"VENV={venv}")
    assert done.returncode != 0 and "make reset NB=exercises/NN_name.ipynb" in done.stderr
    assert not (tmp_path / "pip.log").exists()  # nothing was installed first
    done = make("-n", "lab", f"VENV={venv}", "LAB_ARGS=--no-browser --ip=0.0.0.0")
    assert "jupyter lab --no-browser --ip=0.0.0.0 chapters/00_setup_and_tour.ipynb" in done.stdout
