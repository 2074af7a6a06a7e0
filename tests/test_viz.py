"""minicb.course.viz (chapters 02-05): the data behind every picture matches the trace, the text
timeline has the right characters, and the step-through widget follows its slider."""

from __future__ import annotations

import re
import warnings

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import PathCollection, PolyCollection  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from minicb.course import viz  # noqa: E402
from minicb.trace import Member, StepRecord  # noqa: E402


def record(step, members=(), waiting=(), finished=(), preempted=(), page_tables=None, used=0,
           cached=0, total=16, arrived=(), snapshots=True):
    return StepRecord(step, [Member(*m) for m in members], list(waiting), list(finished),
                      list(preempted), used, cached, 0.0, 0.0, arrived=list(arrived),
                      page_tables=dict(page_tables or {}), pages_total=total,
                      snapshots=snapshots)


def boxes(ax):
    """(collection, face colour, x0, y0, x1, y1) of every bar drawn with broken_barh / bar."""
    out = []
    for coll in ax.collections:
        if not isinstance(coll, PolyCollection):
            continue
        faces = coll.get_facecolors()
        for i, path in enumerate(coll.get_paths()):
            (x0, y0), (x1, y1) = path.vertices.min(0), path.vertices.max(0)
            out.append((coll, to_hex(faces[i % len(faces)]), x0, y0, x1, y1))
    return out


def bars(ax):
    """(face colour, row, x0, width) of every bar drawn with broken_barh / bar."""
    return [(face, round((y0 + y1) / 2), x0, x1 - x0) for _, face, x0, y0, x1, y1 in boxes(ax)]


# ------------------------------------------------------------------------------ timeline
def test_timeline_data_matches_every_record(static, continuous):
    """The timeline holds one cell per member and per waiting request of every record, with its
    kind, and its runs, arrivals and finishes follow the static and continuous traces step by
    step."""
    for trace in (static, continuous):
        data = viz.timeline_data(trace)
        cells = 0
        for rec in trace:
            for m in rec.members:
                assert data.cells[m.request_id][rec.step] == m.kind
            for rid in rec.waiting:
                assert data.cells[rid][rec.step] == viz.WAITING
            cells += len(rec.members) + len(rec.waiting)
        assert sum(len(row) for row in data.cells.values()) == cells
    data = viz.timeline_data(static)
    assert data.requests == ["R1", "R2", "R3", "R4"]
    assert data.finishes == {"R1": 30, "R2": 200, "R3": 80, "R4": 260}
    assert data.arrivals == {"R1": 1, "R2": 1, "R3": 1, "R4": 31}
    assert data.runs("R1") == [(1, 1, "prefill"), (2, 30, "decode"), (31, 200, "idle")]
    assert data.runs("R4") == [(31, 200, "waiting"), (201, 201, "prefill"),
                               (202, 260, "decode")]
    assert viz.timeline_data(continuous).runs("R4") == [(31, 31, "prefill"), (32, 90, "decode")]


def test_plot_timeline_bars_match_trace(static):
    """The timeline figure (not kept by pyplot) draws, for each request and state colour, bars as
    wide as that request's steps in that state, labels the axes and legend, and uses only
    Okabe-Ito colours, white and grey."""
    before = plt.get_fignums()
    fig = viz.plot_timeline(static)
    assert isinstance(fig, Figure) and plt.get_fignums() == before  # not managed by pyplot
    data, ax = fig.minicb_data, fig.axes[0]
    assert ax.minicb_data is data
    drawn = bars(ax)
    for row, rid in enumerate(data.requests):
        for colour in {viz.STYLE[s][0].lower() for s in viz.STATES}:  # idle, stalled: white
            width = sum(w for c, y, _, w in drawn if y == row and c == colour)
            expected = sum(1 for s in data.cells[rid].values()
                           if viz.STYLE[s][0].lower() == colour)
            assert width == pytest.approx(expected), (rid, colour)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["R1", "R2", "R3", "R4"]
    assert ax.get_xlabel() == viz.STEP_AXIS and ax.get_ylabel() == "request"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"prefill", "decode", "waiting in queue", "arrives", "finishes"} <= set(labels)
    okabe = {c.lower() for c in viz.OKABE_ITO} | {"#ffffff", "#bbbbbb"}
    assert {c for c, *_ in drawn} <= okabe


def test_timeline_stalled_and_preempted():
    """A running request left out of a step shows as stalled, a preempted one as waiting with its
    preemption step marked, and the slot view and the text rendering agree."""
    trace = [record(1, [("a", "prefill", 8, 0), ("b", "prefill", 8, 1)], page_tables={
                 "a": [0], "b": [1]}),
             record(2, [("c", "prefill", 8, 1)], waiting=["b"], preempted=["b"],
                    page_tables={"a": [0], "c": [1]}, arrived=["c"]),
             record(3, [("a", "decode", 1, 0)], waiting=["b"], finished=["a"],
                    page_tables={"c": [1]})]
    data = viz.timeline_data(trace)
    assert data.cells["a"] == {1: "prefill", 2: "stalled", 3: "decode"}
    assert data.cells["b"] == {1: "prefill", 2: "waiting", 3: "waiting"}
    assert data.cells["c"] == {2: "prefill", 3: "stalled"}
    assert data.preemptions == {"b": [2]}
    assert data.arrivals["c"] == 2
    slots = viz.slot_data(trace)
    assert slots.owners == {0: {1: "a", 2: "a", 3: "a"}, 1: {1: "b", 2: "c", 3: "c"}}
    assert slots.kinds[1][3] == "stalled"
    text = viz.render_text(trace, legend=False).splitlines()
    assert text[2:] == ["a     ▓-█|", "b     ▓x·", "c      ▓-"]


# --------------------------------------------------------------------------------- slots
def test_slots_show_reuse(static, continuous):
    """Under continuous batching a finished request's slot goes to the next one at the following
    step; under static batching the slot stays idle until the whole batch finishes."""
    fig = viz.plot_slots(continuous)
    data = fig.minicb_data
    assert data.slots == [0, 1, 2]
    assert data.owners[0][30] == "R1" and data.owners[0][31] == "R4"
    assert (0, "R1", 1, 30) in data.runs and (0, "R4", 31, 90) in data.runs
    for rec in continuous:
        for m in rec.members:
            assert data.owners[m.slot][rec.step] == m.request_id
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert {"R1", "R2", "R3", "R4"} <= texts
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["slot 0", "slot 1",
                                                                      "slot 2"]
    data = viz.slot_data(static)
    assert (0, "R1", 1, 200) in data.runs and (0, "R4", 201, 260) in data.runs
    assert all(data.kinds[0][k] == "idle" for k in range(31, 201))


# --------------------------------------------------------------------------------- pages
def test_pages_match_trace(continuous):
    """The page picture shows each step's used, cached and free pages from its record, and a step
    missing from the trace repeats the cached pages with none used."""
    fig = viz.plot_pages(continuous)
    data = fig.minicb_data
    assert data.total == 64 and data.steps == [r.step for r in continuous]
    for rec, used, cached, free in zip(continuous, data.used, data.cached, data.free):
        assert (used, cached, free) == (rec.pages_used, rec.pages_cached,
                                        64 - rec.pages_used - rec.pages_cached)
    used_patch = fig.axes[0].patches[0]  # the first stairs: used pages
    assert used_patch.get_label() == "used by running requests"
    assert list(used_patch.get_data().values) == data.used
    gap = viz.page_data([record(1, used=3, cached=1), record(4, used=2, cached=2)])
    assert gap.steps == [1, 2, 3, 4] and gap.used == [3, 0, 0, 2] and gap.cached == [1, 1, 1, 2]


def test_page_map_marks_shared_pages():
    """The page map at a step lists each page's owners and hatches the pages two requests share;
    given an engine it shows the last step, and a step not in the trace is refused."""
    rec = record(7, [("a", "decode", 1, 0), ("b", "decode", 1, 1)],
                 page_tables={"a": [0, 1, 2], "b": [0, 1, 5]}, used=4, cached=2, total=8)
    fig = viz.plot_page_map([record(6), rec], step=7)
    data = fig.minicb_data
    assert data.step == 7 and data.num_shown == 8 and data.shared == [0, 1]
    assert data.owners == {0: ["a", "b"], 1: ["a", "b"], 2: ["a"], 5: ["b"]}
    hatched = [p for p in fig.axes[0].patches if p.get_hatch() == "xx"]
    assert len(hatched) == 2
    assert "2 shared" in fig.axes[0].get_title()

    class FakeEngine:
        trace = [rec]

    assert viz.page_map_data(FakeEngine()).shared == [0, 1]  # an engine: its last step
    with pytest.raises(ValueError, match="step 3 is not in the trace"):
        viz.page_map_data([rec], 3)


# -------------------------------------------------------------------------------- budget
def test_budget_stacks_tokens():
    """The budget chart stacks each step's prefill tokens on its decode tokens and draws the token
    budget as a line."""
    trace = [record(1, [("a", "prefill", 30, 0)]),
             record(2, [("a", "decode", 1, 0), ("b", "prefill", 24, 1)]),
             record(3, [("a", "decode", 1, 0), ("b", "decode", 1, 1)])]
    fig = viz.plot_budget(trace, 32)
    data = fig.minicb_data
    assert (data.decode, data.prefill, data.total, data.budget) == (
        [0, 1, 2], [30, 24, 0], [30, 25, 2], 32)
    ax = fig.axes[0]
    decode, prefill, lane = ax.containers
    assert [r.get_height() for r in decode] == [0, 1, 2]
    assert [(r.get_y(), r.get_height()) for r in prefill] == [(0, 30), (1, 24), (2, 0)]
    assert any(line.get_ydata()[0] == 32 for line in ax.lines)
    assert ax.get_ylabel() == "tokens in the step"


# ------------------------------------------------------------------------------- compare
def test_compare_shares_the_step_axis(static, continuous):
    """compare draws one panel per run on a shared step axis long enough for the longer run, for
    every kind of picture, and refuses an unknown kind."""
    fig = viz.compare({"static": static, "continuous": continuous})
    top, bottom = fig.axes
    assert top.get_shared_x_axes().joined(top, bottom)
    assert top.get_xlim() == bottom.get_xlim() and top.get_xlim()[1] >= 260
    assert set(fig.minicb_data) == {"static", "continuous"}
    assert fig.minicb_data["continuous"].finishes["R4"] == 90
    assert "static: last request finishes at step 260" in top.get_title(loc="left")
    for kind in ("slots", "pages", "budget"):
        fig = viz.compare({"static": static, "continuous": continuous}, kind=kind)
        assert len(fig.axes) == 2 and set(fig.minicb_data) == {"static", "continuous"}
    with pytest.raises(ValueError, match="kind must be one of"):
        viz.compare({"a": static}, kind="pie")


def test_compare_draws_one_legend_for_every_panel(static, continuous):
    """A state only a lower panel has (static's idle slots under continuous on top) is in the
    one legend; budget and pages panels share one y scale."""
    fig = viz.compare({"continuous": continuous, "static": static})
    top, bottom = fig.axes
    assert bottom.get_legend() is None
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert viz.STYLE["idle"][4] in labels and labels.count("decode") == 1
    big = [record(1, [("a", "prefill", 800, 0)]), record(2, [("a", "decode", 1, 0)])]
    small = [record(1, [("a", "prefill", 100, 0)]), record(2, [("a", "decode", 1, 0)])]
    fig = viz.compare({"big": big, "small": small}, kind="budget", max_num_batched_tokens=128)
    assert fig.axes[0].get_ylim() == fig.axes[1].get_ylim()
    assert fig.axes[0].get_ylim()[1] >= 800


def test_compared_runs_with_their_own_budgets_each_name_theirs():
    """Chapter 04 compares a continuous run (budget 256) with a chunked one (128): one legend
    entry for the dashed lines, and each panel's title says its budget (two identical dashed
    lines in the legend could not say which budget is whose)."""
    from minicb.benchmark.sim import make_sim_engine
    from minicb.request import SamplingParams
    runs = {}
    for name, budget in (("wide", 256), ("narrow", 128)):
        engine = make_sim_engine(policy="pd", max_num_batched_tokens=budget, chunk_size=budget)
        engine.add_request([5] * 300, SamplingParams(max_tokens=3, ignore_eos=True))
        engine.run()
        runs[name] = engine
    fig = viz.compare(runs, kind="budget")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert [x for x in labels if x.startswith("max_num")] == [
        "max_num_batched_tokens (each panel's title gives it)"]
    assert [ax.get_title(loc="left").rsplit("; ", 1)[1] for ax in fig.axes] == [
        "max_num_batched_tokens 256", "max_num_batched_tokens 128"]
    unknown = viz.compare({"wide": runs["wide"], "narrow": runs["narrow"],
                           "bare": list(runs["wide"].trace)}, kind="budget")
    assert "None" not in unknown.axes[2].get_title(loc="left")  # a bare trace: budget unknown
    same = viz.compare({"a": runs["wide"], "b": runs["wide"]}, kind="budget")
    assert "max_num_batched_tokens = 256" in [t.get_text() for t in
                                              same.axes[0].get_legend().get_texts()]


def test_compare_cuts_the_y_axis_to_show_what_a_tall_bar_dwarfs():
    """Chapters 04-05 zoom the budget picture to see three decode tokens beside an 800-token
    prefill: `ymax` cuts every panel there and says so; only pages and budget have a y scale
    to cut."""
    big = [record(1, [("a", "prefill", 800, 0)]), record(2, [("a", "decode", 1, 0)])]
    fig = viz.compare({"big": big, "also": big}, kind="budget", ymax=8)
    assert [ax.get_ylim()[1] for ax in fig.axes] == [8.0, 8.0]
    assert fig._suptitle.get_text().startswith("y axis cut at 8 tokens")
    for bad, kind in ((8, "timeline"), (0, "budget"), (float("nan"), "pages"), ("8", "budget")):
        with pytest.raises(ValueError, match="ymax cuts a pages or budget picture's y axis"):
            viz.compare({"big": big}, kind=kind, ymax=bad)


def test_request_colours_are_not_state_colours_and_legible_at_scale():
    """Request colours never reuse a state colour; with 100 requests the timeline drops arrival
    marks, the slot legend is one line, and a map of 1,024 pages fits in 16 by 10 inches."""
    states = {viz.STYLE[s][0].lower() for s in viz.STATES} | {"#d55e00"}
    assert not states & {c.lower() for c in viz.REQUEST_COLOURS}
    many = [record(1, [(f"r{i}", "prefill", 8, i) for i in range(100)],
                   page_tables={f"r{i}": [i] for i in range(100)}, total=1024)]
    fig = viz.plot_timeline(many)
    assert not [c for c in fig.axes[0].collections  # no arrival marks over 80 rows
                if isinstance(c, PathCollection)]
    fig = viz.plot_slots(many)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert len(labels) == 1 and "colours" in labels[0]  # not 100 swatches that repeat
    width, height = viz.plot_page_map(many).get_size_inches()
    assert width <= 16 and height <= 10  # 1,024 pages: landscape, not 46 inches tall


def test_pictures_of_a_simulated_run_say_so():
    """Every picture of a simulated engine's run ends its title with "(simulated)"; a picture of a
    bare trace does not."""
    from minicb.benchmark.sim import make_sim_engine
    engine = make_sim_engine(policy="pd", max_num_seqs=2)
    engine.add_request([1] * 20, max_tokens_params())
    engine.run()
    for plot in (viz.plot_timeline, viz.plot_slots, viz.plot_pages, viz.plot_budget):
        assert plot(engine).axes[0].get_title().endswith("(simulated)"), plot.__name__
    assert not viz.plot_timeline(engine.trace).axes[0].get_title().endswith("(simulated)")


def max_tokens_params():
    from minicb.request import SamplingParams
    return SamplingParams(max_tokens=4, ignore_eos=True)


# ---------------------------------------------------------------------------------- text
def test_render_text_rows(static, continuous):
    """The text rendering draws each request's row step by step: prefill, decode, finish, idle slot
    and waiting, for static and continuous traces, with a step ruler and a legend."""
    lines = viz.render_text(static, width=300, legend=False).splitlines()
    rows = {line[:6].strip(): line[6:] for line in lines[2:]}
    assert rows["R1"] == "▓" + "█" * 29 + "|" + "░" * 169
    assert rows["R2"] == "▓" + "█" * 199 + "|"
    assert rows["R4"] == " " * 30 + "·" * 170 + "▓" + "█" * 59 + "|"
    assert lines[0].startswith("step  0") and "200" in lines[0]
    cont = viz.render_text(continuous, width=300)
    rows = {line[:6].strip(): line[6:] for line in cont.splitlines()[2:6]}
    assert rows["R1"] == "▓" + "█" * 29 + "|"
    assert rows["R4"] == " " * 30 + "▓" + "█" * 59 + "|"
    assert "█ decode" in cont and "░ idle slot" in cont


def test_render_text_compresses_to_width(static):
    """A rendering wider than `width` packs several steps into a column, says how many, and keeps
    every line within the width; an empty trace renders as "(empty trace)"."""
    text = viz.render_text(static, width=80)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert "(1 column = 4 steps)" in text
    r1 = lines[2][6:]  # steps 1-30 computed: 8 columns of 4 steps, the finish after them
    assert r1.startswith("▓" + "█" * 7) and r1[8] == "|" and set(r1[9:]) == {"░"}
    assert viz.render_text([]) == "(empty trace)"


def test_a_life_shorter_than_a_column_still_shows_its_work():
    """Six steps a column: a request prefilled at step 50 and finished at step 51 shows its prefill,
    then its finish; the finish mark does not hide the only column it computed in."""
    from minicb.benchmark.sim import make_sim_engine
    from minicb.request import SamplingParams
    e = make_sim_engine(policy="continuous", max_num_seqs=2)
    greedy = dict(temperature=0.0, ignore_eos=True)
    e.add_request([1] * 8, SamplingParams(max_tokens=300, **greedy), request_id="long")
    e.add_request([2] * 8, SamplingParams(max_tokens=2, **greedy), request_id="short",
                  arrival_step=50)
    e.run()
    lines = viz.render_text(e.trace, width=60, legend=False).splitlines()
    rows = {line[:7].strip(): line[7:] for line in lines[2:]}
    assert rows["short"] == " " * 8 + "▓|"
    assert rows["long"] == "▓" + "█" * 49 + "|"
    assert all(len(line) <= 60 for line in lines)
    # a request computing in the last column: its mark stays within the width
    e = make_sim_engine(policy="continuous")
    e.add_request([1] * 8, SamplingParams(max_tokens=107, **greedy), request_id="r")
    e.run()
    assert all(len(line) <= 60 for line in viz.render_text(e.trace, width=60).splitlines())


# -------------------------------------------------------------------------------- widget
def test_step_through_follows_the_slider(static, continuous):
    """Moving the step-through slider shows that step's scheduled, running, waiting, arrived
    requests and page tables, with a new picture and a line naming them."""
    w = viz.step_through(continuous)
    assert w.state.step == 1 and {m.request_id for m in w.state.scheduled} == {"R1", "R2", "R3"}
    png = bytes(w.image.value)
    assert png.startswith(b"\x89PNG")
    w.slider.value = 31
    s = w.state
    assert s.step == 31 and s.waiting == [] and s.running == ["R2", "R3", "R4"]
    assert [(m.request_id, m.kind, m.num_tokens, m.slot) for m in s.scheduled] == [
        ("R2", "decode", 1, 1), ("R3", "decode", 1, 2), ("R4", "prefill", 20, 0)]
    assert s.arrived == ["R4"] and set(s.page_tables) == {"R2", "R3", "R4"}
    assert s.page_tables == continuous[30].page_tables
    assert "R4" in w.info.value and "prefill" in w.info.value and bytes(w.image.value) != png
    s = viz.step_through(static, picture=False).show(100)
    assert s.waiting == ["R4"] and s.running == ["R2"]
    assert {(m.request_id, m.kind) for m in s.scheduled} == {("R1", "idle"), ("R2", "decode"),
                                                              ("R3", "idle")}
    assert w.widget.children[0].children[0] is w.play
    assert "application/vnd.jupyter.widget-view+json" in w._repr_mimebundle_()


def test_missing_step_is_empty():
    """Stepping through to a step with no record shows it as not recorded, with nothing
    scheduled."""
    trace = [record(1, [("a", "prefill", 4, 0)], finished=["a"]),
             record(5, [("b", "prefill", 4, 0)], arrived=["b"], finished=["b"])]
    w = viz.step_through(trace, picture=False)
    assert w.show(3).recorded is False and w.state.scheduled == []
    assert w.show(5).scheduled[0].request_id == "b"


# ---------------------------------------------------------------------- a real engine run
def test_real_engine_trace(make_engine):
    """A real engine's trace draws true finishes, waits, slot reuse, the prompt pages a later
    request shares, and the pool's size and token budget."""
    from minicb import SamplingParams

    engine = make_engine("continuous", max_num_seqs=2, page_size=4, num_pages=32)
    prefix = list(range(3, 11))
    for i, (n, step) in enumerate([(8, None), (3, None), (4, 3)]):
        engine.add_request(prefix + [20 + i] * 3, SamplingParams(max_tokens=n, ignore_eos=True),
                           request_id=f"R{i + 1}", arrival_step=step)
    engine.run()
    data = viz.plot_timeline(engine).minicb_data
    assert data.finishes == {"R1": 8, "R2": 3, "R3": 7}
    assert data.runs("R3")[0] == (3, 3, "waiting") and data.runs("R3")[1][2] == "prefill"
    assert viz.slot_data(engine).owners[1][4] == "R3"  # R3 takes R2's slot
    page_map = viz.plot_page_map(engine, 5).minicb_data
    r1_prompt_pages = engine.trace[4].page_tables["R1"][:2]
    assert page_map.shared == sorted(r1_prompt_pages)  # R3 reuses R1's two prompt pages
    assert {rid for p in page_map.shared for rid in page_map.owners[p]} == {"R1", "R3"}
    assert viz.page_data(engine).total == 32
    assert viz.budget_data(engine).budget == engine.config.max_num_batched_tokens
    assert viz.step_through(engine, picture=False).show(4).running == ["R1", "R3"]


def test_a_trace_without_snapshots_says_what_it_cannot_draw(make_engine):
    """A trace recorded without snapshots still draws its members but warns that waiting and stalled
    requests are missing, refuses a page map, and draws the budget without a warning."""
    from minicb import SamplingParams

    engine = make_engine("continuous", max_num_seqs=1, page_size=4, num_pages=32,
                         trace_snapshots=False)
    for i in range(2):  # one slot: the second request waits
        engine.add_request([3, 4, 5, 6 + i], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.run()
    assert any(r.num_waiting for r in engine.trace) and not any(r.waiting for r in engine.trace)
    with pytest.warns(UserWarning, match="trace_snapshots=False: waiting and stalled"):
        data = viz.timeline_data(engine)
    assert len(data.requests) == 2  # members are still drawn
    with pytest.raises(ValueError, match="no page tables to draw"):
        viz.page_map_data(engine, 2)
    with pytest.warns(UserWarning, match="the waiting queue and page tables"):
        viz.step_state(engine, 2)
    assert viz.budget_data(engine).budget == engine.config.max_num_batched_tokens  # no warning


# ------------------------------------------------------------------- where things are drawn
def test_timeline_bars_and_marks_sit_on_their_steps(static):
    """Step k is the cell [k-1, k]: each run's bar starts at its first step - 1, the ">" sits
    inside its arrival step's cell (x = arrival - 0.5: R4's reads 31, clear of R1's finish at
    30), the finish bar "|" at x = the finish step, and the first request is the top row."""
    fig = viz.plot_timeline(static)
    data, ax = fig.minicb_data, fig.axes[0]
    drawn = bars(ax)
    for row, rid in enumerate(data.requests):
        starts = sorted(x0 for _, y, x0, _ in drawn if y == row)
        assert starts == [first - 1 for first, _, _ in data.runs(rid)], rid
    (arrows,) = [c for c in ax.collections if isinstance(c, PathCollection)]
    assert sorted(map(tuple, arrows.get_offsets().tolist())) == sorted(
        (data.arrivals[r] - 0.5, row) for row, r in enumerate(data.requests))
    finishes = sorted((line.get_xdata()[0], round(sum(line.get_ydata()) / 2))
                      for line in ax.lines)
    assert finishes == sorted((data.finishes[r], row) for row, r in enumerate(data.requests))
    bottom, top = ax.get_ylim()
    assert top < bottom  # row 0 (R1) at the top, as the chapter's diagram reads


def test_runs_break_where_a_request_is_absent():
    """A request decoding at steps 1 and 3 but absent at 2 (a stalled request in a trace
    without snapshots) is two runs, not one bar across step 2."""
    trace = [record(1, [("a", "decode", 1, 0)]), record(2, [("b", "prefill", 4, 1)]),
             record(3, [("a", "decode", 1, 0)])]
    assert viz.timeline_data(trace).runs("a") == [(1, 1, "decode"), (3, 3, "decode")]


def test_slot_bars_sit_on_their_steps_and_idle_slots_are_hatched(static):
    """Static batching, slot 0: R1 computes steps 1-30, holds the slot idle (hatched) for
    31-200, then R4 computes 201-260; each bar covers [first - 1, last]."""
    ax = viz.plot_slots(static).axes[0]
    row0 = sorted((round(x0), round(w), c.get_hatch())
                  for c in ax.collections if isinstance(c, PolyCollection)
                  for path in c.get_paths()
                  for (x0, y0), (x1, y1) in [(path.vertices.min(0), path.vertices.max(0))]
                  for w in [x1 - x0] if round((y0 + y1) / 2) == 0)
    assert row0 == [(0, 1, None), (1, 29, None), (30, 170, "///"), (200, 1, None),
                    (201, 59, None)]


def test_page_pool_picture_stacks_used_cached_free_and_marks_preemptions():
    """The page-pool picture stacks used, cached and free pages on each step's cell and marks each
    preemption with an X over its step."""
    trace = [record(1, used=3, cached=1, total=8),
             record(2, used=5, cached=1, total=8, preempted=["b"]),
             record(3, used=2, cached=2, total=8, finished=["a"])]
    fig = viz.plot_pages(trace)
    data, ax = fig.minicb_data, fig.axes[0]
    assert data.preempted_steps == [2]
    used, cached, free = ax.patches[:3]
    for patch, base, top in ((used, [0, 0, 0], [3, 5, 2]), (cached, [3, 5, 2], [4, 6, 4]),
                             (free, [4, 6, 4], [8, 8, 8])):
        values, edges, baseline = patch.get_data()
        assert list(edges) == [0, 1, 2, 3], patch.get_label()  # step k: the cell [k-1, k]
        assert list(values) == top and list(baseline + 0 * values) == base, patch.get_label()
    (marks,) = [c for c in ax.collections if isinstance(c, PathCollection)]
    assert marks.get_offsets().tolist() == [[1.5, 8.0]]  # the X over step 2


def test_page_map_puts_page_p_at_row_start_plus_column():
    """16 columns: page 40 sits at row start 32, column 8; the title counts distinct pages."""
    rec = record(1, [("a", "decode", 1, 0)], page_tables={"a": [0, 1, 18], "b": [18, 40]},
                 cached=3, total=64)
    ax = viz.plot_page_map([rec], columns=16).axes[0]
    at = {t.get_text(): tuple(t.get_position()) for t in ax.texts}
    assert at["1"] == (1.5, 0.5) and at["40"] == (8.5, 2.5) and at["18×2"] == (2.5, 1.5)
    assert "4 in page tables (1 shared), 3 cached" in ax.get_title()


def test_budget_bars_sit_on_their_steps_and_the_budget_line_is_in_view():
    """Step k's budget bar covers the cell [k-1, k], and the y axis reaches above the budget
    line."""
    trace = [record(1, [("a", "prefill", 4, 0)]), record(2, [("a", "decode", 1, 0)])]
    ax = viz.plot_budget(trace, 32).axes[0]
    decode, prefill, lane = ax.containers
    assert [(r.get_x(), r.get_width()) for r in prefill] == [(0.0, 1.0), (1.0, 1.0)]
    assert ax.get_ylim()[1] > 32  # the max_num_batched_tokens line is not cut off


def test_compare_lines_up_rows_and_shares_the_page_scale():
    """Request y is row 1 in both panels (x, absent below, keeps row 0 there); pages panels
    of an 8-page and a 64-page pool share one y scale."""
    a = [record(1, [("x", "prefill", 4, 0)], finished=["x"]),
         record(2, [("y", "prefill", 4, 0)], arrived=["y"], finished=["y"])]
    b = [record(1, [("y", "prefill", 4, 0)], finished=["y"])]
    top, bottom = viz.compare({"a": a, "b": b}).axes
    assert [t.get_text() for t in bottom.get_yticklabels()] == ["x", "y"]
    assert {y for _, y, _, _ in bars(bottom)} == {1}
    small = [record(1, used=2, total=8)]
    big = [record(1, used=2, total=64)]
    top, bottom = viz.compare({"small": small, "big": big}, kind="pages").axes
    assert top.get_ylim() == bottom.get_ylim()


def test_step_through_cursor_and_running_list(continuous):
    """The cursor shades step k's cell [k-1, k]; a request that finished at the step is not
    listed as running."""
    from matplotlib.patches import Rectangle

    w = viz.step_through(continuous)
    w.show(30)
    assert "R1" in w.state.finished and "R1" not in w.state.running
    ax = w._figure.axes[0]
    (span,) = [p for p in ax.patches if p.get_alpha() == 0.2]  # the shaded cursor cell
    if isinstance(span, Rectangle):  # matplotlib >= 3.9
        xs = [span.get_x(), span.get_x() + span.get_width()]
    else:
        xs = [x for x, _ in span.get_xy()]
    assert (min(xs), max(xs)) == (29, 30)


def test_seed_example_caches_only_full_prompt_pages():
    """A 20-token prompt in 16-token pages: one full page per finished request stays cached."""
    trace = viz.seed_example("continuous")
    finished = 0
    for rec in trace:
        finished += len(rec.finished)
        assert rec.pages_cached == finished, rec.step


# Machado, Oliveira & Fernandes (2009), severity 1, on linear RGB
CVD = {"normal": np.eye(3),
       "protanopia": np.array([[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216],
                               [-0.003882, -0.048116, 1.051998]]),
       "deuteranopia": np.array([[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413],
                                 [-0.011820, 0.042940, 0.968881]]),
       "tritanopia": np.array([[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602],
                               [0.004733, 0.691367, 0.303900]])}


def _lab(colour: str, vision: np.ndarray) -> np.ndarray:
    srgb = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    linear = np.where(srgb <= 0.04045, srgb / 12.92, ((srgb + 0.055) / 1.055) ** 2.4)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722],
                    [0.0193, 0.1192, 0.9505]]) @ np.clip(vision @ linear, 0, 1)
    t = xyz / np.array([0.95047, 1.0, 1.08883])  # D65 white
    f = np.where(t > 0.008856, np.cbrt(t), 7.787 * t + 16 / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def test_request_colours_stay_apart_for_colour_blind_viewers():
    """Every pair of request colours, and each against the state and cached colours, is at
    least 12 apart (CIE76) for normal vision and simulated protanopia, deuteranopia and
    tritanopia: two colours 4 apart look like one on a projector."""
    states = [style[0] for style in viz.STYLE.values()] + [viz.CACHED, "#D55E00"]

    def distance(a, b):
        return min(np.linalg.norm(_lab(a, m) - _lab(b, m)) for m in CVD.values())

    colours = viz.REQUEST_COLOURS
    assert min(distance(a, b) for i, a in enumerate(colours) for b in colours[i + 1:]) >= 12
    assert min(distance(a, s) for a in colours for s in states) >= 12


# ------------------------------------------------------------- every picture, in detail
def stalled_trace():
    """a stalled at step 2, b preempted at step 2 (then waits), c takes b's slot 1."""
    return [record(1, [("a", "prefill", 8, 0), ("b", "prefill", 8, 1)],
                   page_tables={"a": [0], "b": [1]}),
            record(2, [("c", "prefill", 8, 1)], waiting=["b"], preempted=["b"],
                   page_tables={"a": [0], "c": [1]}, arrived=["c"]),
            record(3, [("a", "decode", 1, 0)], waiting=["b"], finished=["a"],
                   page_tables={"c": [1]})]


def polys(ax):
    """(face, hatch, alpha, row, x0, x1, height) of every broken_barh bar."""
    return [(face, coll.get_hatch(), coll.get_alpha(), round((y0 + y1) / 2), round(x0, 6),
             round(x1, 6), y1 - y0) for coll, face, x0, y0, x1, y1 in boxes(ax)]


def legend_texts(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def state_bars(ax, data):
    """{state: [(hatch, height)]} of the timeline's bars, matched to the runs they draw."""
    drawn = polys(ax)
    out: dict[str, list] = {}
    for row, rid in enumerate(data.requests):
        for first, _, state in data.runs(rid):
            (bar,) = [b for b in drawn if b[3] == row and b[4] == first - 1]
            out.setdefault(state, []).append((bar[1], bar[6]))
    return out


# ------------------------------------------------------------------------------ timeline
def test_timeline_states_differ_by_hatch_or_height(static):
    """The two white states (idle, stalled) have different hatches and waiting bars are lower than
    computing bars, so every state survives greyscale."""
    fig = viz.plot_timeline(static)
    idle = state_bars(fig.axes[0], fig.minicb_data)
    fig = viz.plot_timeline(stalled_trace())
    stalled = state_bars(fig.axes[0], fig.minicb_data)
    assert {h for h, _ in idle["idle"]} and {h for h, _ in stalled["stalled"]}
    assert not {h for h, _ in idle["idle"]} & {h for h, _ in stalled["stalled"]}
    assert None not in {h for h, _ in idle["idle"] + stalled["stalled"]}
    computing = [height for h, height in stalled["prefill"] + idle["decode"]]
    assert max(height for _, height in stalled["waiting"] + idle["waiting"]) < min(computing)


def test_timeline_preemption_mark_sits_in_its_step_in_vermillion():
    """A preemption's X sits in the middle of its step (b, row 1, preempted at step 2: (1.5, 1)),
    in the legend's vermillion."""
    ax = viz.plot_timeline(stalled_trace()).axes[0]
    (marks,) = [c for c in ax.collections if isinstance(c, PathCollection)
                and c.get_zorder() == 4]
    assert marks.get_offsets().tolist() == [[1.5, 1.0]]
    (handle,) = [h for h, t in zip(ax.get_legend().legend_handles, legend_texts(ax))
                 if t == "preempted"]
    assert to_hex(marks.get_facecolors()[0]) == to_hex(handle.get_markerfacecolor()) \
        == "#d55e00"


def test_thirty_requests_keep_their_marks_and_labels():
    """Thirty rows still show every arrival ">" and every request id."""
    trace = [record(1, [(f"r{i}", "prefill", 4, i) for i in range(30)], total=64)]
    ax = viz.plot_timeline(trace).axes[0]
    (arrows,) = [c for c in ax.collections if isinstance(c, PathCollection)]
    assert len(arrows.get_offsets()) == 30
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"r{i}" for i in range(30)]


def test_step_axis_shows_the_last_step_whole(continuous):
    """Every step picture shows the last step's cell [199, 200] whole."""
    for plot in (viz.plot_timeline, viz.plot_slots, viz.plot_pages, viz.plot_budget):
        assert plot(continuous).axes[0].get_xlim()[1] >= 200, plot.__name__


def test_timeline_legend_lists_only_states_drawn(static, continuous):
    """The legend lists only the states drawn: continuous batching has no idle slot and nothing
    stalled; static batching's legend has the idle slot."""
    labels = legend_texts(viz.plot_timeline(continuous).axes[0])
    assert viz.STYLE["idle"][4] not in labels and viz.STYLE["stalled"][4] not in labels
    assert "prefill" in labels and "decode" in labels
    assert viz.STYLE["idle"][4] in legend_texts(viz.plot_timeline(static).axes[0])


def test_every_picture_takes_its_title(continuous):
    """Every picture takes `title=`."""
    for plot in (viz.plot_timeline, viz.plot_slots, viz.plot_pages, viz.plot_budget,
                 viz.plot_page_map):
        assert plot(continuous, title="my run").axes[0].get_title() == "my run", plot.__name__


def test_rows_keep_trace_order_and_last_step_counts_skipped_steps():
    """Requests arriving at one step keep the trace's order (not sorted by id), and the last step
    is the last record's step, counting the steps the engine skipped."""
    trace = [record(1, [("zed", "prefill", 4, 0), ("amy", "prefill", 4, 1)]),
             record(5, [("bob", "prefill", 4, 0)], arrived=["bob"])]
    data = viz.timeline_data(trace)
    assert data.requests == ["zed", "amy", "bob"] and data.last_step == 5


# ---------------------------------------------------------------------------------- slots
def test_slot_colours_match_the_page_map(continuous):
    """Request i is `request_colour(i)` in the slot picture, as in the page map."""
    fig = viz.plot_slots(continuous)
    data, drawn = fig.minicb_data, polys(fig.axes[0])
    for slot, rid, a, _ in data.runs:
        faces = {f for f, _, _, row, x0, _, _ in drawn if row == data.slots.index(slot)
                 and x0 == a - 1}
        assert faces == {viz.request_colour(data.requests.index(rid)).lower()}, rid
    page_map = viz.plot_page_map(continuous, 31)
    faces = {to_hex(p.get_facecolor()) for p in page_map.axes[0].patches
             if isinstance(p, Rectangle) and p.get_hatch() is None}
    assert viz.request_colour(data.requests.index("R4")).lower() in faces


def test_slot_tenancies_outlined_labelled_and_faded_when_idle(static):
    """Hatched slot bars are fainter than computing ones; each tenancy is outlined over its whole
    span and labelled at its centre."""
    fig = viz.plot_slots(static)
    data, ax = fig.minicb_data, fig.axes[0]
    drawn = polys(ax)
    hatched = {alpha for _, hatch, alpha, *_ in drawn if hatch}
    plain = {alpha for _, hatch, alpha, *_ in drawn if not hatch}
    assert hatched and plain and max(hatched) < min(plain)
    outlines = sorted((round(p.get_x()), round(p.get_y() + p.get_height() / 2),
                       round(p.get_width())) for p in ax.patches
                      if isinstance(p, Rectangle) and not p.get_fill())
    row = {s: i for i, s in enumerate(data.slots)}
    assert outlines == sorted((a - 1, row[s], b - a + 1) for s, _, a, b in data.runs)
    label_x = {t.get_text(): t.get_position() for t in ax.texts}
    for s, rid, a, b in data.runs:
        assert label_x[rid] == pytest.approx(((a - 1 + b) / 2, row[s])), rid


def test_slot_picture_marks_preemption_and_puts_slot_0_on_top():
    """A preempted request's X sits in its slot's row, in the middle of the preempting step (b, slot
    1 until step 1, preempted at step 2), and slot 0 is the top row."""
    ax = viz.plot_slots(stalled_trace()).axes[0]
    (marks,) = [c for c in ax.collections if isinstance(c, PathCollection)]
    assert marks.get_offsets().tolist() == [[1.5, 1.0]]
    assert "preempted" in legend_texts(ax)
    bottom, top = ax.get_ylim()
    assert top < bottom  # slot 0 at the top


def test_slot_legend_names_the_hatches_drawn(static, continuous):
    """The slot legend names exactly the hatches drawn (idle, stalled)."""
    idle, stalled = "idle (finished, slot held)", "running, not scheduled"
    labels = legend_texts(viz.plot_slots(static).axes[0])
    assert idle in labels and stalled not in labels
    labels = legend_texts(viz.plot_slots(stalled_trace()).axes[0])
    assert stalled in labels and idle not in labels
    labels = legend_texts(viz.plot_slots(continuous).axes[0])
    assert idle not in labels and stalled not in labels


def test_a_preempted_request_gives_up_its_slot():
    """A preempted request gives up its slot: a, preempted at step 2 and back in the page tables
    at step 3 without being scheduled, holds no slot."""
    trace = [record(1, [("a", "prefill", 4, 0)], page_tables={"a": [0]}),
             record(2, [("b", "prefill", 4, 1)], preempted=["a"], waiting=["a"],
                    page_tables={"b": [1]}, arrived=["b"]),
             record(3, [("b", "decode", 1, 1)], page_tables={"a": [0], "b": [1]})]
    assert viz.slot_data(trace).owners == {0: {1: "a"}, 1: {2: "b", 3: "b"}}


# ---------------------------------------------------------------------------------- pages
def test_page_pool_colours_pool_line_and_scale():
    """Cached pages have their own colour, the dashed pool line sits at the pool size, and the y
    scale shows the whole pool."""
    trace = [record(1, used=1, cached=1, total=8), record(2, used=2, cached=1, total=8)]
    ax = viz.plot_pages(trace).axes[0]
    used, cached = ax.patches[:2]
    assert to_hex(used.get_facecolor()) == viz.STYLE["decode"][0].lower()
    assert to_hex(cached.get_facecolor()) == viz.CACHED.lower()
    (pool,) = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert list(pool.get_ydata()) == [8, 8]
    assert ax.get_ylim()[1] > 8


def test_page_map_grid_legend_and_colours():
    """The page map shows the highest page id when the pool size is unknown, colours a shared page
    by the first table holding it, counts each request's pages in the legend, honours
    `columns=`, puts page 0 at the top, and writes labels legibly on black and yellow."""
    ax = viz.plot_page_map([record(1, page_tables={"a": [0, 5]}, total=0)]).axes[0]
    assert {"0", "5"} <= {t.get_text() for t in ax.texts}
    assert ax.minicb_data.num_shown == 6
    rec = record(7, [("a", "decode", 1, 0), ("b", "decode", 1, 1)],
                 page_tables={"a": [0, 1, 2], "b": [0, 1, 5]}, total=8)
    ax = viz.plot_page_map([rec], columns=4).axes[0]
    assert {"a (3 pages)", "b (3 pages)"} <= set(legend_texts(ax))
    assert ax.get_xlim() == (0, 4)
    bottom, top = ax.get_ylim()
    assert (bottom, top) == (2, 0)  # two rows, page 0's at the top
    (page0,) = [p for p in ax.patches if isinstance(p, Rectangle)
                and p.get_x() == pytest.approx(0.05) and p.get_y() == pytest.approx(0.05)]
    assert to_hex(page0.get_facecolor()) == viz.request_colour(0).lower()  # a's colour
    four = record(1, [(f"r{i}", "prefill", 4, i) for i in range(4)],
                  page_tables={f"r{i}": [i] for i in range(4)}, total=4)
    colours = {t.get_text(): t.get_color() for t in viz.plot_page_map([four]).axes[0].texts}
    assert viz.request_colour(3) == "#000000" and colours["3"] == "white"
    assert viz.request_colour(2) == "#F0E442" and colours["2"] == "black"


def test_page_map_gives_every_request_on_it_its_own_colour():
    """Requests 0 and 8 share a colour everywhere else; on a map that shows only those two, each
    gets its own (and the legend lists both, since two fit)."""
    first = record(1, [(f"r{i}", "prefill", 4, i) for i in range(9)],
                   page_tables={f"r{i}": [i] for i in range(9)}, total=9)
    last = record(2, [("r0", "decode", 1, 0), ("r8", "decode", 1, 8)],
                  page_tables={"r0": [0], "r8": [8]}, total=9)
    assert viz.request_colour(0) == viz.request_colour(8)
    ax = viz.plot_page_map([first, last]).axes[0]
    faces = [to_hex(p.get_facecolor()) for p in ax.patches if isinstance(p, Rectangle)]
    assert faces[0] != faces[8] and faces[0] in {viz.request_colour(i).lower() for i in (0, 1)}
    assert {"r0 (1 page)", "r8 (1 page)"} <= set(legend_texts(ax))
    ax = viz.plot_page_map([first, record(2, page_tables={"r3": [3]}, total=9)]).axes[0]
    (r3,) = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_x() == pytest.approx(3.05)]
    assert to_hex(r3.get_facecolor()) == viz.request_colour(3).lower()  # the timeline's colour


# --------------------------------------------------------------------------------- budget
def test_budget_colours_and_legend_order():
    """Decode bars are decode blue, prefill bars prefill orange, and the budget line comes last in
    the legend."""
    trace = [record(1, [("a", "prefill", 30, 0)]),
             record(2, [("a", "decode", 1, 0), ("b", "prefill", 24, 1)])]
    ax = viz.plot_budget(trace, 32).axes[0]
    decode, prefill, lane = ax.containers
    assert {to_hex(r.get_facecolor()) for r in decode + lane} == {viz.STYLE["decode"][0].lower()}
    assert {to_hex(r.get_facecolor()) for r in prefill} == {viz.STYLE["prefill"][0].lower()}
    assert legend_texts(ax) == ["decode tokens", "prefill tokens",
                                "max_num_batched_tokens = 32"]


def test_empty_trace_and_single_record_draw():
    """An empty trace draws an empty picture, and a single StepRecord is a one-step trace."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # matplotlib: empty axes, no legend
        for plot in (viz.plot_timeline, viz.plot_slots, viz.plot_pages, viz.plot_budget):
            assert plot([]).axes[0].get_xlim()[1] > 0, plot.__name__
    rec = record(3, [("a", "prefill", 4, 0)], page_tables={"a": [0]})
    assert viz.timeline_data(rec).cells == {"a": {3: "prefill"}}
    assert viz.budget_data(rec).prefill == [4]


# ------------------------------------------------------------------------------- compare
def test_compare_draws_the_picture_asked_for(static, continuous):
    """`compare(kind=...)` draws the picture of that kind in every panel."""
    kinds = {"timeline": viz.TimelineData, "slots": viz.SlotsData, "pages": viz.PagesData,
             "budget": viz.BudgetData}
    for kind, cls in kinds.items():
        fig = viz.compare({"static": static, "continuous": continuous}, kind=kind)
        assert all(isinstance(d, cls) for d in fig.minicb_data.values()), kind


def test_compare_rows_from_every_panel_and_step_label_at_the_bottom():
    """Compared timelines take their rows from every panel (a request only a later panel has is
    a row), and only the bottom panel carries the step label."""
    a = [record(1, [("y", "prefill", 4, 0)], finished=["y"])]
    b = [record(1, [("x", "prefill", 4, 0)], finished=["x"]),
         record(2, [("y", "prefill", 4, 0)], arrived=["y"], finished=["y"])]
    top, bottom = viz.compare({"a": a, "b": b}).axes
    assert [t.get_text() for t in top.get_yticklabels()] == ["y", "x"]
    assert top.get_xlabel() == "" and bottom.get_xlabel() == viz.STEP_AXIS


# ---------------------------------------------------------------------------------- text
def ruler(text):
    """(value, column) of the header's step labels and the rule's "|" columns."""
    lines = text.splitlines()
    labels = [(int(m.group()), m.start()) for m in re.finditer(r"\d+", lines[0][6:])]
    return labels, [i for i, ch in enumerate(lines[1][6:]) if ch == "|"]


def steps(n):
    return [record(k, [("a", "prefill" if k == 1 else "decode", 1, 0)],
                   finished=["a"] if k == n else ()) for k in range(1, n + 1)]


def test_render_text_ruler(static):
    """At one step a column, label v sits in column v with a "|" under it, every 10 steps, the last
    step labelled, and no "1 column = 1 steps" note."""
    text = viz.render_text(static, width=300)
    labels, rule = ruler(text)
    assert labels == [(v, v) for v in range(0, 261, 10)]
    assert rule == [v for v, _ in labels]
    assert "column =" not in text
    labels, rule = ruler(viz.render_text(steps(97), width=300))
    assert [v for v, _ in labels] == list(range(0, 91, 10)) + [97] and rule[-1] == 97


def test_render_text_uses_every_column_before_compressing():
    """93 steps and the "|" column fill the 94 columns of width 100 exactly, one step a
    column."""
    text = viz.render_text(steps(93), width=100)
    row = text.splitlines()[2][6:]
    assert row == "▓" + "█" * 92 + "|" and "column =" not in text
    assert max(len(line) for line in text.splitlines()) <= 100


# ---------------------------------------------------------------------------- step-through
def test_step_state_and_its_html(continuous):
    """The step state counts decode and prefill tokens and used and cached pages apart, the table's
    tokens column shows tokens, and `finished:` lists only the finished (continuous step 31:
    2 decode tokens and R4's 20-token prefill in slot 0)."""
    rec = continuous[30]
    assert rec.pages_used != rec.pages_cached
    w = viz.step_through(continuous, picture=False)
    s = w.show(31)
    assert (s.num_decode_tokens, s.num_prefill_tokens) == (2, 20)
    assert (s.pages_used, s.pages_cached) == (rec.pages_used, rec.pages_cached)
    html = w.info.value
    assert "scheduled 2 decode + 20 prefill tokens" in html
    assert f"{rec.pages_used} used, {rec.pages_cached} cached of 64" in html
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", tr) for tr in re.findall(r"<tr>(.*?)</tr>", html)]
    assert ["<b>R4</b>", "prefill", "20", "0"] in rows
    w.show(30)
    assert "finished: R1" in w.info.value and "preempted:" not in w.info.value


def test_html_underlines_only_shared_pages_and_lists_preemptions():
    """The step's HTML underlines only shared pages and lists preemptions as preemptions."""
    trace = [record(1, [("a", "decode", 1, 0), ("b", "decode", 1, 1)],
                    page_tables={"a": [0, 1], "b": [0, 2]}, preempted=["c"])]
    html = viz.step_through(trace, picture=False).info.value
    assert "<u>0</u>" in html and "<u>1</u>" not in html and "<u>2</u>" not in html
    assert "preempted: c" in html and "finished:" not in html


def test_step_through_cursor_line_in_the_middle_of_the_step(continuous):
    """The step-through cursor line sits in the middle of its step (x = k - 0.5)."""
    w = viz.step_through(continuous)
    w.show(30)
    (cursor,) = [line for line in w._figure.axes[0].lines if line.get_linestyle() == "--"]
    assert list(cursor.get_xdata()) == [29.5, 29.5]


# ---------------------------------------------------------------------------------- misc
def test_request_colours_cycle_through_all_eight():
    """Request colours use all eight before repeating."""
    n = len(viz.REQUEST_COLOURS)
    assert len({viz.request_colour(i) for i in range(n)}) == n
    assert viz.request_colour(n) == viz.request_colour(0)


def test_a_trace_partly_without_snapshots_warns():
    """A trace with any record lacking snapshots warns."""
    trace = [record(1, [("a", "prefill", 4, 0)], page_tables={"a": [0]}),
             record(2, [("a", "decode", 1, 0)], snapshots=False)]
    with pytest.warns(UserWarning, match="trace_snapshots=False"):
        viz.timeline_data(trace)


def test_budget_lane_shows_decode_tokens_at_full_scale():
    """Three decode tokens beside an 800-token prefill fill the decode lane, whose scale is
    the most decode tokens of any step; compared runs share one lane scale and one upper
    scale, so chunked's missing decodes and pd's present ones show without a zoom."""
    trace = [record(1, [("a", "decode", 1, 0), ("b", "decode", 1, 1), ("c", "decode", 1, 2),
                        ("long", "prefill", 800, 3)]),
             record(2, [("long", "prefill", 100, 3)])]
    ax = viz.plot_budget(trace, 128).axes[0]
    *_, lane = ax.containers
    bottom = ax.get_ylim()[0]
    heights = [r.get_height() for r in lane]
    assert heights[0] == pytest.approx(-bottom * viz.LANE / (viz.LANE + 0.1)) and heights[1] == 0
    assert all(r.get_y() == pytest.approx(bottom) for r in lane)
    few = [record(1, [("a", "decode", 1, 0)])]
    fig = viz.compare({"three": trace, "one": few}, kind="budget")
    tops = [max(r.get_height() for r in ax.containers[-1]) for ax in fig.axes]
    assert tops[0] == pytest.approx(3 * tops[1])  # one lane scale: 3 decodes against 1
    assert fig.axes[0].get_ylim() == fig.axes[1].get_ylim()


# ------------------------------------------------------------------------ attention mask
@pytest.fixture(scope="module")
def mixed_run():
    """pd on the simulated executor: three chats decode while a 40-token prompt is prefilled
    in 13-token chunks beside them (budget 16, pages of 8)."""
    from minicb.benchmark.sim import make_sim_engine
    from minicb.benchmark.workload import Workload, WorkloadRequest, run_workload
    chats = [WorkloadRequest(prompt_len=8, max_tokens=12, arrival_step=1, request_id=f"chat-{i}")
             for i in range(3)]
    long = WorkloadRequest(prompt_len=40, max_tokens=2, arrival_step=3, request_id="long")
    engine = make_sim_engine(policy="pd", max_num_seqs=4, max_num_batched_tokens=16,
                             chunk_size=16, page_size=8)
    run_workload(engine, Workload("mask", chats + [long]))
    return engine


def test_attention_mask_blocks_are_the_steps_attention_metadata(mixed_run):
    """Step 4 is [3, 1] decode rows and a [1, 13] chunk: the mask's row blocks are the
    metadata's query_start_loc, its column blocks the context lengths, each row reads its own
    request's keys up to its own position (a decode row its whole context, a chunk row its
    cached prefix and itself causally), and page boundaries fall every page_size keys."""
    import numpy as np

    from minicb.attention import build_metadata
    rec = mixed_run.trace[3]
    kinds = [(m.kind, m.num_tokens) for m in rec.members]
    assert kinds == [("decode", 1)] * 3 + [("prefill", 13)]
    data = viz.attention_mask_data(mixed_run, step=4)
    meta = build_metadata([rec.page_tables[m.request_id] for m in rec.members],
                          [m.start for m in rec.members], [m.num_tokens for m in rec.members],
                          page_size=8)
    assert data.page_size == 8
    assert data.query_start_loc == meta.query_start_loc.tolist()
    assert data.context_lens == meta.context_lens_list
    expected = np.zeros_like(data.mask)
    for b, m in zip(data.blocks, rec.members):
        assert (b.request_id, b.pages) == (m.request_id, rec.page_tables[m.request_id])
        for i in range(m.num_tokens):
            position = m.start + i
            expected[b.row_start + i, b.col_start:b.col_start + m.start] = 1
            expected[b.row_start + i, b.col_start + m.start:b.col_start + position + 1] = 2
        assert data.page_edges(b) == list(range(b.col_start + 8, b.col_end, 8))
    assert (data.mask == expected).all()
    assert (data.mask > 0).sum() == sum(m.start + i + 1 for m in rec.members
                                        for i in range(m.num_tokens))


def test_attention_mask_is_what_the_reference_attention_computes(mixed_run):
    """Dense softmax attention over the keys each row's mask allows, gathered from the pages,
    equals the torch reference's paged attention for the same step."""
    import torch

    from minicb.attention import build_metadata, torch_ref
    rec = mixed_run.trace[3]
    data = viz.attention_mask_data(mixed_run, step=4)
    gen = torch.Generator().manual_seed(0)
    num_pages, kv_heads, head_dim = 16, 1, 4
    k_cache = torch.randn(num_pages, 8, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_pages, 8, kv_heads, head_dim, generator=gen)
    meta = build_metadata([b.pages for b in data.blocks], [b.start for b in data.blocks],
                          [b.num_tokens for b in data.blocks], page_size=8)
    q = torch.randn(rec.num_tokens, kv_heads, head_dim, generator=gen)
    paged = torch_ref.attend(q, k_cache, v_cache, meta, 0.5)
    slots = [b.pages[p // 8] * 8 + p % 8 for b in data.blocks
             for p in range(b.col_end - b.col_start)]
    keys = k_cache.view(-1, head_dim)[slots]
    values = v_cache.view(-1, head_dim)[slots]
    scores = (q[:, 0] @ keys.T * 0.5).masked_fill(torch.from_numpy(data.mask == 0), -torch.inf)
    dense = torch.softmax(scores, dim=-1) @ values
    assert torch.allclose(dense, paged[:, 0], atol=1e-5)


def test_attention_mask_picture_labels_each_request_and_its_pages(mixed_run):
    """One y label per member (its id, kind and query count), one x label per member (its
    keys), a dotted line per page boundary, and the page ids above the wide blocks."""
    fig = viz.plot_attention_mask(mixed_run, step=4)
    ax, data = fig.axes[0], fig.minicb_data
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "chat-0: decode, 1 query", "chat-1: decode, 1 query", "chat-2: decode, 1 query",
        "long: prefill, 13 queries"]
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        f"{b.request_id}\n{b.col_end - b.col_start} keys" for b in data.blocks]
    dotted = [line for line in ax.lines if line.get_linestyle() == ":"]
    assert len(dotted) == sum(len(data.page_edges(b)) for b in data.blocks)
    assert {"6", "7", "8", "9"} <= {t.get_text() for t in ax.texts}  # long's pages
    assert "step 4: 16 query tokens" in ax.get_title()
    with pytest.raises(ValueError, match="step 99 is not in the trace"):
        viz.attention_mask_data(mixed_run, step=99)
    with pytest.raises(ValueError, match="no `start` per member"):
        viz.attention_mask_data([record(1, [("a", "decode", 1, 0)])])


def page_faces(ax) -> list[str]:
    """The face colours of a page map's page rectangles, in drawing order."""
    return [to_hex(p.get_facecolor()) for p in ax.patches if isinstance(p, Rectangle)]


def test_page_map_keeps_the_timeline_colours_when_more_requests_than_colours_show():
    """The page map keeps the timeline's colours unless two of its requests share one that the
    palette has room to tell apart: with more requests on the map than colours, some always
    share one, and the map still matches the timeline."""
    first = record(1, [(f"r{i}", "prefill", 4, i) for i in range(10)],
                   page_tables={f"r{i}": [i] for i in range(10)}, total=10)
    last = record(2, page_tables={f"r{i}": [i] for i in range(1, 10)}, total=10)
    faces = page_faces(viz.plot_page_map([first, last]).axes[0])
    assert faces[1] == viz.request_colour(1).lower() and faces[2] == viz.request_colour(2).lower()


def test_page_map_renumbers_in_the_maps_order():
    """When the page map renumbers its colours, it does so in the map's own order (its
    legend's), not by request id."""
    first = record(1, [(f"r{i}", "prefill", 4, i) for i in range(9)],
                   page_tables={f"r{i}": [i] for i in range(9)}, total=9)
    last = record(2, page_tables={"r8": [0], "r0": [1]}, total=9)
    ax = viz.plot_page_map([first, last]).axes[0]
    assert legend_texts(ax)[:2] == ["r8 (1 page)", "r0 (1 page)"]
    assert page_faces(ax)[:2] == [viz.request_colour(0).lower(), viz.request_colour(1).lower()]
