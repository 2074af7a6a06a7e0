"""The course hangs together: every chapter exists in order, the README's course map lists each
one in reading order, and every relative link in the chapters and the README resolves."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
LINK = re.compile(r"\]\(([^)\s#]+)(#[^)]*)?\)")


def test_chapters_are_numbered_00_to_08_without_gaps():
    numbers = [int(p.name[:2]) for p in CHAPTERS]
    assert numbers == list(range(9)), [p.name for p in CHAPTERS]
    for path in CHAPTERS:
        assert (ROOT / "chapters" / "src" / (path.stem + ".py")).exists(), f"no source for {path}"


def test_readme_course_map_lists_every_chapter_in_order():
    readme = (ROOT / "README.md").read_text()
    course_map = readme.split("## The course map", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"\(chapters/(\d\d_[a-z_]+)\.ipynb\)", course_map)
    assert listed == [p.stem for p in CHAPTERS]


def markdown_of(notebook: Path) -> str:
    cells = json.loads(notebook.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def test_every_relative_link_resolves():
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
    for path in CHAPTERS:
        cells = json.loads(path.read_text())["cells"]
        first = "".join(cells[0]["source"]).lower()
        last_md = next("".join(c["source"]).lower() for c in reversed(cells)
                       if c["cell_type"] == "markdown")
        assert "you will" in first or "able to" in first, f"{path.name}: no goals up front"
        assert "recap" in last_md or "summary" in last_md, f"{path.name}: no recap at the end"
