"""The exercise notebooks (chapters 01-08) and their generator: the generated notebooks match
their sources, the stubs and the markers, every exercise pairs a stub, a check cell and a
`minicb.course.check` function, each shows its points, and the reference solutions pass every
case of their checks, the hidden ones too. The checks' explanations of planted bugs are in
test_check.py, the grader in test_grade.py."""

from __future__ import annotations

import re
import shutil

import nbformat
import pytest
from helpers import EXPECTED, NAMES, SOLUTION_OBJECTS, SOURCES, code, solution, tagged

from minicb.course import check, exercises
from minicb.course.exercises import ROOT, MarkerError, generate, solution_code, stub_code


def test_every_chapter_01_to_06_has_an_exercise_notebook():
    """The exercise notebooks are exactly the expected ones, one for each of chapters 01 to 06."""
    assert NAMES == EXPECTED


def test_generated_notebooks_match_their_sources():
    """The committed exercise and solution notebooks are what `exercises build` makes from the
    sources, and `check` passes."""
    assert exercises.stale() == [], "run `python -m minicb.course.exercises build` and commit"
    assert exercises.main(["check"]) == 0


def test_links_out_of_the_source_folder_are_rewritten_for_the_generated_notebooks():
    """A link out of exercises/source loses one `../` in the generated notebooks; sibling and web
    links stay as they are."""
    text = "See [ch 01](../../chapters/01_x.ipynb#top), [next](02_y.ipynb), [web](https://a.b/c)."
    assert exercises.relink(text) == ("See [ch 01](../chapters/01_x.ipynb#top), "
                                      "[next](02_y.ipynb), [web](https://a.b/c).")


def test_check_mode_fails_on_a_stale_or_orphan_notebook(tmp_path, capsys):
    """`check` exits 1 naming an edited solution notebook and an exercise notebook with no source;
    `build` rewrites the stale one and leaves the orphan listed."""
    for folder in ("exercises", "solutions"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    assert exercises.main(["check", "--root", str(tmp_path)]) == 0
    path = tmp_path / "solutions" / EXPECTED[0]
    path.write_text(path.read_text().replace("MyPagePool", "YourPagePool"))
    (tmp_path / "exercises" / "99_orphan.ipynb").write_text("{}")
    assert exercises.main(["check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"solutions/{EXPECTED[0]}" in err and "99_orphan.ipynb (no source)" in err
    assert exercises.main(["build", "--root", str(tmp_path)]) == 0
    assert exercises.stale(tmp_path) == ["exercises/99_orphan.ipynb (no source)"]


def test_reset_puts_a_fresh_stub_in_place_and_keeps_the_learners_work(tmp_path, capsys):
    """`make reset NB=...`: a learner starting over gets the generated stub back, and the
    notebook they had is kept under exercises/.backup/ (not graded by `exercises/*.ipynb`)."""
    shutil.copytree(ROOT / "exercises", tmp_path / "exercises")
    name = EXPECTED[1]
    mine = tmp_path / "exercises" / name
    fresh = mine.read_text()
    mine.write_text(fresh.replace("NotImplementedError", "my own attempt"))
    assert exercises.main(["reset", f"exercises/{name}", "--root", str(tmp_path)]) == 0
    assert mine.read_text() == fresh
    backups = list((tmp_path / "exercises" / ".backup").glob("*.ipynb"))
    assert len(backups) == 1 and "my own attempt" in backups[0].read_text()
    assert "yours is kept as exercises/.backup/" in capsys.readouterr().out
    assert exercises.main(["reset", name, "--root", str(tmp_path)]) == 0  # twice in a second
    assert len(list((tmp_path / "exercises" / ".backup").glob("*.ipynb"))) == 2
    assert exercises.main(["reset", "exercises/99_nope.ipynb", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no exercise notebook named '99_nope.ipynb'" in err and EXPECTED[0] in err
    for wrong in (["reset"], ["build", f"exercises/{name}"]):  # which notebook? / none wanted
        with pytest.raises(SystemExit):
            exercises.main(wrong)


def test_generation_is_deterministic_and_keeps_cell_ids():
    """Generating from a source twice gives the same notebooks, and both keep the source's unique
    cell ids."""
    for src in SOURCES:
        nb = nbformat.read(src, as_version=4)
        ex1, sol1 = generate(nb, src.name)
        ex2, sol2 = generate(nbformat.read(src, as_version=4), src.name)
        assert exercises.render(ex1) == exercises.render(ex2)
        assert exercises.render(sol1) == exercises.render(sol2)
        ids = [c["id"] for c in nb.cells]
        assert [c["id"] for c in ex1.cells] == ids == [c["id"] for c in sol1.cells]
        assert len(set(ids)) == len(ids)


def test_stub_replaces_the_solution_with_hint_and_error():
    """The exercise stub drops the solution, keeps its HINT, and raises NotImplementedError naming
    the function and the exercise; the solution keeps the code and hint without the markers."""
    source = "\n".join([
        "class Pool:",
        "    def allocate(self, n):",
        "        ### BEGIN SOLUTION",
        "        # HINT: take n pages",
        "        #       from the free list.",
        "        pages = self.free[:n]",
        "        return pages",
        "        ### END SOLUTION",
        "",
        "def helper():",
        "    ### BEGIN SOLUTION",
        "    return 1",
        "    ### END SOLUTION",
    ])
    stub = stub_code(source, "page_pool")
    assert "pages = self.free" not in stub and "return 1" not in stub
    assert "        # HINT: take n pages\n        #       from the free list.\n" in stub
    assert ('        raise NotImplementedError("write Pool.allocate (exercise page_pool): '
            'see the HINT above")') in stub
    assert ('    raise NotImplementedError("write helper (exercise page_pool): replace this '
            'line with your code")') in stub
    compile(stub, "stub", "exec")
    solution = solution_code(source)
    assert "BEGIN" not in solution and "END SOLUTION" not in solution
    assert "        return pages" in solution and "# HINT: take n pages" in solution


@pytest.mark.parametrize("bad", [
    "### BEGIN SOLUTION\nx = 1",
    "x = 1\n### END SOLUTION",
    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n### END SOLUTION",
])
def test_unbalanced_markers_are_refused(bad):
    """A BEGIN SOLUTION without its END, an END without a BEGIN, or nested markers raise
    MarkerError."""
    with pytest.raises(MarkerError):
        stub_code(bad)


@pytest.mark.parametrize("bad, message", [
    ("### BEGIN SOLUTION\nanswer = 42\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION",
     "line 3: ### BEGIN SOLUTION inside another solution"),
    ("x = 1\n### END SOLUTION", "line 2: ### END SOLUTION without ### BEGIN SOLUTION"),
    ("x = 1\n### BEGIN SOLUTION\nx = 2", "line 2: ### BEGIN SOLUTION is never closed"),
])
def test_marker_errors_name_the_line_and_the_fault(bad, message):
    """A BEGIN left open before another one would otherwise put `answer = 42` in the stub."""
    with pytest.raises(MarkerError, match=re.escape(message)):
        stub_code(bad, where="cell")


def test_a_written_answer_is_stubbed_and_only_tags_survive_generation():
    """No source has a marked markdown cell yet: the exercise shows the prompt, never the
    answer; teacher-only metadata (a hidden source, nbgrader's) and outputs are dropped."""
    src = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell(
            "Why?\n### BEGIN SOLUTION\nBecause the pages are shared.\n### END SOLUTION",
            metadata={"tags": ["answer"], "jupyter": {"source_hidden": True}}),
        nbformat.v4.new_code_cell("x = 1", metadata={"nbgrader": {"grade": True}},
                                  execution_count=3,
                                  outputs=[nbformat.v4.new_output("stream", text="1\n")])])
    ex, sol = generate(src, "t")
    assert ex.cells[0].source == "Why?\n" + exercises.MARKDOWN_STUB
    assert sol.cells[0].source == "Why?\nBecause the pages are shared."
    assert ex.cells[0].metadata == sol.cells[0].metadata == {"tags": ["answer"]}
    assert ex.cells[1].metadata == {} and ex.cells[1].outputs == []
    assert ex.cells[1].execution_count is None


def test_notebook_structure():
    """Every exercise has a stub cell, a check cell after it and a check function; the
    exercise notebooks hold no solution and no output; check cells are the same in all three."""
    for src in SOURCES:
        source = nbformat.read(src, as_version=4)
        ex = nbformat.read(ROOT / "exercises" / src.name, as_version=4)
        sol = nbformat.read(ROOT / "solutions" / src.name, as_version=4)
        stubs, checks = tagged(source, "exercise"), tagged(source, "check")
        assert 2 <= len(checks) <= 5, src.name  # 5: chapter 06 is the longest
        assert list(stubs) == list(checks), f"{src.name}: each exercise needs stub + check"
        for name, index in checks.items():
            assert stubs[name] < index
            assert callable(getattr(check, name, None)), f"minicb.course.check.{name} missing"
            assert f"check.{name}(" in source.cells[index].source
            assert ex.cells[index].source == sol.cells[index].source \
                == source.cells[index].source
            assert "### BEGIN SOLUTION" in source.cells[stubs[name]].source
            assert f"(exercise {name})" in ex.cells[stubs[name]].source
        assert source.cells[0].cell_type == "markdown"
        chapter = re.search(r"\(\.\./\.\./chapters/(\d\d_\w+)\.ipynb\)", source.cells[0].source)
        assert chapter and chapter.group(1)[:2] == src.name[:2], "intro links its chapter"
        assert "Summary" in source.cells[-1].source
        for nb in (ex, sol):
            text = exercises.render(nb)
            assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text
            assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")


def test_every_check_is_covered_here():
    """Every check cell in the exercise sources has a solution object tested in this file."""
    names = {n for src in SOURCES for n in tagged(nbformat.read(src, as_version=4), "check")}
    assert names == set(SOLUTION_OBJECTS)


@pytest.mark.parametrize("exercise", sorted(SOLUTION_OBJECTS))
def test_reference_solution_passes_its_check(exercise, capsys):
    """Each reference solution passes every case of its check, which prints one line: its
    mark (and returns nothing, so a check cell shows nothing more)."""
    notebook, obj = SOLUTION_OBJECTS[exercise]
    assert getattr(check, exercise)(solution(notebook)[obj]) is None
    out = capsys.readouterr().out
    assert out.startswith(f"✓ {exercise}: ") and out.count("\n") == 1
    results = check.RESULTS[exercise]
    assert results.total == len(results.results) > 0
    assert all(r.passed for r in results.results)


def test_exercise_demos_print_what_their_text_says(capsys):
    """The demos of exercises 07 and 08 run on the solutions (stored without outputs, so nbval
    compares nothing there)."""
    for notebook, cell_id in (("07_paged_attention.ipynb", "ex07-demo-code"),
                              ("08_speculative_decoding.ipynb", "ex08-demo-code")):
        namespace = solution(notebook)
        cell = next(c for c in nbformat.read(ROOT / "solutions" / notebook,
                                             as_version=4).cells if c.get("id") == cell_id)
        exec(compile(cell.source, f"{notebook}:{cell_id}", "exec"), namespace)
    out = capsys.readouterr().out
    difference = float(re.search(r"largest difference from dense attention (\S+)", out)[1])
    assert difference < 1e-5
    assert "30 tokens in 8 steps (22 guesses kept); same answer: True" in out


def test_a_stub_keeps_only_the_hint_comment_that_opens_its_region():
    """_hint_lines: a comment after the answer's first code line, or one that merely starts with
    HINT (`# HINTED`), is the answer's and stays out of the stub. Without an exercise the message
    names none."""
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
    shutil.copytree(ROOT / "exercises" / "source", tmp_path / "exercises" / "source")
    first = exercises.build(tmp_path)
    assert len(first) == 2 * len(SOURCES) and \
        exercises.build(tmp_path) == []
