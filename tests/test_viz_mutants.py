"""Planted-bug tests from a mutation review of minicb/course/viz.py: each test fails on the bug its
docstring names and passes on the real code."""

from __future__ import annotations

import re
import warnings

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from test_viz import boxes, record  # noqa: E402

from minicb.course import viz  # noqa: E402


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
    """M09 (stalled drawn with idle's "///" hatch) and M10 (waiting bars full height): the two
    white states have different hatches and waiting bars are lower than computing bars, so
    every state survives greyscale."""
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
    """M14 (timeline X drawn a step early) and M15 (X coloured prefill orange): b, row 1, is
    preempted at step 2, so the X is at (1.5, 1), in the legend's preemption colour."""
    ax = viz.plot_timeline(stalled_trace()).axes[0]
    (marks,) = [c for c in ax.collections if isinstance(c, PathCollection)
                and c.get_zorder() == 4]
    assert marks.get_offsets().tolist() == [[1.5, 1.0]]
    (handle,) = [h for h, t in zip(ax.get_legend().legend_handles, legend_texts(ax))
                 if t == "preempted"]
    assert to_hex(marks.get_facecolors()[0]) == to_hex(handle.get_markerfacecolor()) \
        == "#d55e00"


def test_thirty_requests_keep_their_marks_and_labels():
    """M11 (arrival marks dropped above 8 rows) and M17 (y labels thinned from 4 rows up): 30
    rows still show every arrival ">" and every request id."""
    trace = [record(1, [(f"r{i}", "prefill", 4, i) for i in range(30)], total=64)]
    ax = viz.plot_timeline(trace).axes[0]
    (arrows,) = [c for c in ax.collections if isinstance(c, PathCollection)]
    assert len(arrows.get_offsets()) == 30
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"r{i}" for i in range(30)]


def test_step_axis_shows_the_last_step_whole(continuous):
    """M16 (timeline), M23 (slots: x limit from each slot's first step), M39 (pages): every
    step picture shows the last step's cell [199, 200] whole."""
    for plot in (viz.plot_timeline, viz.plot_slots, viz.plot_pages, viz.plot_budget):
        assert plot(continuous).axes[0].get_xlim()[1] >= 200, plot.__name__


def test_timeline_legend_lists_only_states_drawn(static, continuous):
    """M18 (every state in the legend): continuous batching has no idle slot, nothing stalled;
    static batching's legend has the idle slot."""
    labels = legend_texts(viz.plot_timeline(continuous).axes[0])
    assert viz.STYLE["idle"][4] not in labels and viz.STYLE["stalled"][4] not in labels
    assert "prefill" in labels and "decode" in labels
    assert viz.STYLE["idle"][4] in legend_texts(viz.plot_timeline(static).axes[0])


def test_every_picture_takes_its_title(continuous):
    """M19 (plot_timeline ignores title=)."""
    for plot in (viz.plot_timeline, viz.plot_slots, viz.plot_pages, viz.plot_budget,
                 viz.plot_page_map):
        assert plot(continuous, title="my run").axes[0].get_title() == "my run", plot.__name__


def test_rows_keep_trace_order_and_last_step_counts_skipped_steps():
    """M05 (requests arriving at one step sorted by id) and M06 (last step = number of
    records, wrong when the engine skipped steps)."""
    trace = [record(1, [("zed", "prefill", 4, 0), ("amy", "prefill", 4, 1)]),
             record(5, [("bob", "prefill", 4, 0)], arrived=["bob"])]
    data = viz.timeline_data(trace)
    assert data.requests == ["zed", "amy", "bob"] and data.last_step == 5


# ---------------------------------------------------------------------------------- slots
def test_slot_colours_match_the_page_map(continuous):
    """M22 (slot colours shifted by one request): request i is request_colour(i) in the slot
    picture, as in the page map."""
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
    """M25 (hatched bars opaque, computing bars faded), M26 (tenancy outline a step short),
    M27 (request label off the tenancy's centre)."""
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
    """M28 (slot X only when the run ends at the preempting step), M29 (slot X at the step's
    end), M30 (slot rows upside down): b, in slot 1 until step 1, is preempted at step 2."""
    ax = viz.plot_slots(stalled_trace()).axes[0]
    (marks,) = [c for c in ax.collections if isinstance(c, PathCollection)]
    assert marks.get_offsets().tolist() == [[1.5, 1.0]]
    assert "preempted" in legend_texts(ax)
    bottom, top = ax.get_ylim()
    assert top < bottom  # slot 0 at the top


def test_slot_legend_names_the_hatches_drawn(static, continuous):
    """M31 (idle-slot legend entry keyed on stalled slots)."""
    idle, stalled = "idle (finished, slot held)", "running, not scheduled"
    labels = legend_texts(viz.plot_slots(static).axes[0])
    assert idle in labels and stalled not in labels
    labels = legend_texts(viz.plot_slots(stalled_trace()).axes[0])
    assert stalled in labels and idle not in labels
    labels = legend_texts(viz.plot_slots(continuous).axes[0])
    assert idle not in labels and stalled not in labels


def test_a_preempted_request_gives_up_its_slot():
    """M21 (last slot kept after preemption): a, preempted at step 2, is back in the page
    tables at step 3 without being scheduled; it holds no slot (it lost slot 0)."""
    trace = [record(1, [("a", "prefill", 4, 0)], page_tables={"a": [0]}),
             record(2, [("b", "prefill", 4, 1)], preempted=["a"], waiting=["a"],
                    page_tables={"b": [1]}, arrived=["b"]),
             record(3, [("b", "decode", 1, 1)], page_tables={"a": [0], "b": [1]})]
    assert viz.slot_data(trace).owners == {0: {1: "a"}, 1: {2: "b", 3: "b"}}


# ---------------------------------------------------------------------------------- pages
def test_page_pool_colours_pool_line_and_scale():
    """M36 (cached pages in the used colour), M37 (pool line at the peak instead of the pool
    size), M38 (y scale ignores the pool size, cutting off the free pages)."""
    trace = [record(1, used=1, cached=1, total=8), record(2, used=2, cached=1, total=8)]
    ax = viz.plot_pages(trace).axes[0]
    used, cached = ax.patches[:2]
    assert to_hex(used.get_facecolor()) == viz.STYLE["decode"][0].lower()
    assert to_hex(cached.get_facecolor()) == viz.CACHED.lower()
    (pool,) = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert list(pool.get_ydata()) == [8, 8]
    assert ax.get_ylim()[1] > 8


def test_page_map_grid_legend_and_colours():
    """M40 (page map drops the highest page id when the pool size is unknown), M43 (a shared
    page coloured by its last owner, not the first table holding it), M44 (legend counts every
    page, not the request's), M45 (columns= ignored), M46 (page 0 at the bottom), M47 (label
    text black on the black request colour)."""
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
    """Requests 0 and 8 of the timeline share a colour everywhere else; on a map that shows only
    those two, each gets its own (and the legend lists both, since two fit)."""
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
    """M49 (decode bars in prefill orange) and M50 (budget line first in the legend)."""
    trace = [record(1, [("a", "prefill", 30, 0)]),
             record(2, [("a", "decode", 1, 0), ("b", "prefill", 24, 1)])]
    ax = viz.plot_budget(trace, 32).axes[0]
    decode, prefill = ax.containers
    assert {to_hex(r.get_facecolor()) for r in decode} == {viz.STYLE["decode"][0].lower()}
    assert {to_hex(r.get_facecolor()) for r in prefill} == {viz.STYLE["prefill"][0].lower()}
    assert legend_texts(ax) == ["decode tokens", "prefill tokens",
                                "max_num_batched_tokens = 32"]


def test_empty_trace_and_single_record_draw():
    """M51 (plot_budget crashes on an empty trace) and M72 (a single StepRecord not taken as
    a one-step trace)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # matplotlib: empty axes, no legend
        for plot in (viz.plot_timeline, viz.plot_slots, viz.plot_pages, viz.plot_budget):
            assert plot([]).axes[0].get_xlim()[1] > 0, plot.__name__
    rec = record(3, [("a", "prefill", 4, 0)], page_tables={"a": [0]})
    assert viz.timeline_data(rec).cells == {"a": {3: "prefill"}}
    assert viz.budget_data(rec).prefill == [4]


# ------------------------------------------------------------------------------- compare
def test_compare_draws_the_picture_asked_for(static, continuous):
    """M52 (kind="pages" draws the budget picture)."""
    kinds = {"timeline": viz.TimelineData, "slots": viz.SlotsData, "pages": viz.PagesData,
             "budget": viz.BudgetData}
    for kind, cls in kinds.items():
        fig = viz.compare({"static": static, "continuous": continuous}, kind=kind)
        assert all(isinstance(d, cls) for d in fig.minicb_data.values()), kind


def test_compare_rows_from_every_panel_and_step_label_at_the_bottom():
    """M53 (rows taken from the first panel only: a request only a later panel has crashes)
    and M54 (the step label kept on the top panel instead of the bottom one)."""
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
    """M57 (rule without its "|" ticks), M60 (a label every 5 steps, not 10), M63 (the last
    step never labelled) and M59 ("1 column = 1 steps" printed uncompressed): at one step a
    column, label v sits in column v and the rule has a "|" under it."""
    text = viz.render_text(static, width=300)
    labels, rule = ruler(text)
    assert labels == [(v, v) for v in range(0, 261, 10)]
    assert rule == [v for v, _ in labels]
    assert "column =" not in text
    labels, rule = ruler(viz.render_text(steps(97), width=300))
    assert [v for v, _ in labels] == list(range(0, 91, 10)) + [97] and rule[-1] == 97


def test_render_text_uses_every_column_before_compressing():
    """M56 (steps a column = span // columns + 1, not the ceiling): 93 steps and the "|"
    column fill the 94 columns of width 100 exactly, at one step a column."""
    text = viz.render_text(steps(93), width=100)
    row = text.splitlines()[2][6:]
    assert row == "▓" + "█" * 92 + "|" and "column =" not in text
    assert max(len(line) for line in text.splitlines()) <= 100


# ---------------------------------------------------------------------------- step-through
def test_step_state_and_its_html(continuous):
    """M64 (prefill and decode token counts swapped), M65 (pages used and cached swapped),
    M67 (the tokens column shows the slot), M68 (the finished event lists the preempted):
    continuous step 31 schedules 2 decode tokens and R4's 20-token prefill in slot 0."""
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
    """M66 (unshared pages underlined instead of shared ones), M68 (preempted shown as
    finished)."""
    trace = [record(1, [("a", "decode", 1, 0), ("b", "decode", 1, 1)],
                    page_tables={"a": [0, 1], "b": [0, 2]}, preempted=["c"])]
    html = viz.step_through(trace, picture=False).info.value
    assert "<u>0</u>" in html and "<u>1</u>" not in html and "<u>2</u>" not in html
    assert "preempted: c" in html and "finished:" not in html


def test_step_through_cursor_line_in_the_middle_of_the_step(continuous):
    """M70 (the dashed cursor line at the step's end, x = k, not its middle k - 0.5)."""
    w = viz.step_through(continuous)
    w.show(30)
    (cursor,) = [line for line in w._figure.axes[0].lines if line.get_linestyle() == "--"]
    assert list(cursor.get_xdata()) == [29.5, 29.5]


# ---------------------------------------------------------------------------------- misc
def test_request_colours_cycle_through_all_eight():
    """M71 (colours repeat after 7)."""
    n = len(viz.REQUEST_COLOURS)
    assert len({viz.request_colour(i) for i in range(n)}) == n
    assert viz.request_colour(n) == viz.request_colour(0)


def test_a_trace_partly_without_snapshots_warns():
    """M73 (warning only when no record has snapshots)."""
    trace = [record(1, [("a", "prefill", 4, 0)], page_tables={"a": [0]}),
             record(2, [("a", "decode", 1, 0)], snapshots=False)]
    with pytest.warns(UserWarning, match="trace_snapshots=False"):
        viz.timeline_data(trace)
