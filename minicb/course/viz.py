"""Pictures of a run (chapters 02-05): who is in the batch at each step, which slot each request
holds, how full the KV page pool is, how each step spends its token budget, and a step-through
widget that replays a run one step at a time.

Everything here reads a trace, a plain `list[StepRecord]` (or anything with a `.trace`, such as
an `Engine`), so the pictures need no engine and no model: `seed_example()` builds the chapter's
R1..R4 example by hand.

Convention: each `plot_*` function (and `compare`) draws on `ax` when given, else on a new
`matplotlib.figure.Figure`; it never calls `plt.show()` and returns the Figure. The numbers it
drew are attached as a small dataclass at `ax.minicb_data` and at `fig.minicb_data` (the last plot
drawn on that figure; `compare` puts a dict {name: data} there). The same dataclasses come from
`timeline_data`, `slot_data`, `page_data`, `page_map_data` and `budget_data` without drawing.

    step k is drawn as the cell [k-1, k] on the x axis, so a request that finishes at step 30
    shows its bar "|" at x = 30, as in the chapter's block diagram (the axis label says so).

Colours are Okabe-Ito (safe for colour-blind viewers; states also differ by hatch or height, so
they survive greyscale), request colours avoid the state colours, fonts are sized for a
projector (`use_course_style()` applies the same sizes to a chapter's own plots), and a picture
of a run on the simulated executor says "(simulated)" in its title.
"""

from __future__ import annotations

import contextlib
import html
import io
import math
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.patheffects import withStroke
from matplotlib.ticker import MaxNLocator

from minicb.config import is_finite_number
from minicb.trace import Member, StepRecord

# ---------------------------------------------------------------------------------- style
OKABE_ITO = ["#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7",
             "#000000"]
PREFILL, DECODE, IDLE, STALLED, WAITING = "prefill", "decode", "idle", "stalled", "waiting"
STATES = (PREFILL, DECODE, IDLE, STALLED, WAITING)
STYLE = {  # state -> (face colour, hatch, edge colour, bar height, legend label)
    PREFILL: ("#E69F00", None, "#E69F00", 0.8, "prefill"),
    DECODE: ("#0072B2", None, "#0072B2", 0.8, "decode"),
    IDLE: ("#FFFFFF", "///", "#888888", 0.8, "idle slot (finished, slot still held)"),
    STALLED: ("#FFFFFF", "..", "#0072B2", 0.8, "running, not scheduled this step"),
    WAITING: ("#BBBBBB", None, "#BBBBBB", 0.25, "waiting in queue"),
}
# not the state colours above (decode blue, prefill orange, preemption vermillion) nor the
# cached pages' sky blue: Okabe-Ito's others, then Paul Tol's muted colours, picked so that any
# two differ by a CIE76 distance of 16 or more, and each from a state colour by 13 or more, for
# normal vision and simulated protanopia, deuteranopia and tritanopia (Machado et al. 2009)
REQUEST_COLOURS = ["#CC79A7", "#009E73", "#F0E442", "#000000", "#332288", "#882255", "#117733",
                   "#999933"]
CACHED = "#56B4E9"  # sky blue: lighter than decode's blue in greyscale too
LANE = 0.3  # the budget picture's decode lane, as a share of its upper scale
STEP_AXIS = "step  (step k is the cell from k−1 to k)"
GLYPHS = {PREFILL: "▓", DECODE: "█", IDLE: "░", STALLED: "-", WAITING: "·"}
RC = {"font.size": 14, "axes.titlesize": 16, "axes.labelsize": 15, "xtick.labelsize": 13,
      "ytick.labelsize": 13, "legend.fontsize": 12, "hatch.linewidth": 1.0}


@contextlib.contextmanager
def _style() -> Iterator[None]:
    with matplotlib.rc_context(RC):
        yield


def use_course_style() -> None:
    """Give a chapter's own matplotlib plots the projector-sized fonts of these pictures."""
    matplotlib.rcParams.update(RC)


def _simulated(trace: Any) -> bool:
    """True for a run of the simulated executor (an Engine whose model is
    `minicb.benchmark.sim`'s)."""
    info = getattr(getattr(trace, "engine", trace), "info", None)
    return getattr(info, "name", None) == "simulated"


def _titled(title: str, trace: Any) -> str:
    return f"{title} (simulated)" if _simulated(trace) and "simulat" not in title.lower() \
        else title


def _records(trace: Any) -> list[StepRecord]:
    """A list of StepRecords from a trace, an Engine (or LLM) or a single record."""
    trace = getattr(getattr(trace, "engine", trace), "trace", trace)
    if isinstance(trace, StepRecord):
        return [trace]
    return list(trace)


def _warn_without_snapshots(records: list[StepRecord], missing: str) -> None:
    """A benchmark trace (trace_snapshots=False) has no queue or page-table copies: say what the
    picture lacks instead of drawing it silently incomplete."""
    if any(not r.snapshots for r in records):
        warnings.warn(f"this trace was recorded with trace_snapshots=False: {missing} are not "
                      "shown; run the engine with trace_snapshots=True to draw them",
                      stacklevel=3)


def _axes(ax: Axes | None, size: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    return Figure(figsize=size, layout="constrained").add_subplot()


def _attach(ax: Axes, data: Any) -> Figure:
    try:
        fig = ax.get_figure(root=True)
    except TypeError:  # matplotlib < 3.10
        fig = ax.figure
    ax.minicb_data = data
    fig.minicb_data = data
    return fig


def request_colour(index: int) -> str:
    return REQUEST_COLOURS[index % len(REQUEST_COLOURS)]


def _text_colour(face: str) -> str:
    r, g, b = matplotlib.colors.to_rgb(face)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def _runs(cells: dict[int, Any]) -> list[tuple[int, int, Any]]:
    """Consecutive steps with the same value: [(first step, last step, value)]."""
    out: list[list] = []
    for step in sorted(cells):
        value = cells[step]
        if out and out[-1][1] == step - 1 and out[-1][2] == value:
            out[-1][1] = step
        else:
            out.append([step, step, value])
    return [tuple(r) for r in out]


def _request_ticks(ax: Axes, labels: list[str]) -> None:
    every = max(1, math.ceil(len(labels) / 40))
    ax.set_yticks(range(0, len(labels), every), labels[::every])
    ax.set_ylim(len(labels) - 0.5, -0.5)


# ------------------------------------------------------------------------------ timeline
@dataclass
class TimelineData:
    """What `plot_timeline` and `render_text` draw. `cells[request][step]` is one of prefill,
    decode, idle (static batching's dead slot), stalled (running, holds its pages, but not
    scheduled: prefill-first chunking) or waiting; steps where the request is absent are
    missing. `arrivals`/`finishes` give steps; `preemptions` lists steps per request, and
    `swaps` those of them where its K/V went to host memory (preemption_mode="swap", chapter
    06) instead of being thrown away."""

    requests: list[str]
    last_step: int
    cells: dict[str, dict[int, str]]
    tokens: dict[str, dict[int, int]]
    arrivals: dict[str, int]
    finishes: dict[str, int]
    preemptions: dict[str, list[int]]
    swaps: dict[str, list[int]] = field(default_factory=dict)

    def runs(self, request_id: str) -> list[tuple[int, int, str]]:
        """(first step, last step, state) for each run of equal states of one request."""
        return _runs(self.cells.get(request_id, {}))

    def count(self, state: str) -> int:
        """How many (request, step) cells are in `state`."""
        return sum(1 for row in self.cells.values() for s in row.values() if s == state)


def timeline_data(trace: Any) -> TimelineData:
    """Each request's state at each step. A request arrives at the step that lists it in
    `arrived`, or else where it is first seen (a request added before step 1)."""
    records = _records(trace)
    _warn_without_snapshots(records, "waiting and stalled requests")
    order: dict[str, int] = {}
    arrivals: dict[str, int] = {}
    cells: dict[str, dict[int, str]] = defaultdict(dict)
    tokens: dict[str, dict[int, int]] = defaultdict(dict)
    finishes: dict[str, int] = {}
    preemptions: dict[str, list[int]] = defaultdict(list)
    swaps: dict[str, list[int]] = defaultdict(list)

    def see(rid: str, step: int) -> None:
        order.setdefault(rid, len(order))
        arrivals.setdefault(rid, step)

    for rec in records:
        k = rec.step
        for rid in rec.arrived:
            see(rid, k)
        for m in rec.members:
            see(m.request_id, k)
            cells[m.request_id][k] = m.kind
            tokens[m.request_id][k] = m.num_tokens
        for rid in rec.waiting:
            see(rid, k)
            cells[rid].setdefault(k, WAITING)
        for rid in rec.page_tables:
            see(rid, k)
            cells[rid].setdefault(k, STALLED)
        for rid in rec.preempted:
            see(rid, k)
            preemptions[rid].append(k)
        for rid in rec.swapped:
            swaps[rid].append(k)
        for rid in rec.finished:
            see(rid, k)
            finishes[rid] = k
    requests = sorted(order, key=lambda rid: (arrivals[rid], order[rid]))
    last = max((r.step for r in records), default=0)
    return TimelineData(requests, last, {r: dict(cells[r]) for r in requests},
                        {r: dict(tokens[r]) for r in requests}, arrivals, finishes,
                        {r: preemptions[r] for r in requests if preemptions[r]},
                        {r: swaps[r] for r in requests if swaps[r]})


def _draw_timeline(ax: Axes, data: TimelineData, requests: list[str], legend: bool
                   ) -> list[Any]:
    """Draw the rows; return the legend handles of what was drawn (and draw the legend if
    asked). Markers shrink with the rows, so 200 requests stay legible."""
    row = {rid: i for i, rid in enumerate(requests)}
    fit = min(1.0, 25 / max(1, len(requests)))  # 1 up to 25 rows, then shrinking
    present = set()
    for rid in data.requests:
        y = row[rid]
        by_state: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for first, last, state in data.runs(rid):
            by_state[state].append((first - 1, last - first + 1))
        for state, spans in by_state.items():
            face, hatch, edge, height, _ = STYLE.get(state, STYLE[DECODE])
            ax.broken_barh(spans, (y - height / 2, height), facecolors=face, edgecolors=edge,
                           hatch=hatch, linewidth=0.8 if hatch else 0)
            present.add(state)
    marks = []
    arrivals = [(data.arrivals[r] - 0.5, row[r]) for r in data.requests]  # in its cell
    if arrivals and len(requests) <= 80:  # beyond, the marks would hide the rows
        ax.scatter(*zip(*arrivals), marker=">", s=70 * fit ** 2, color="black", zorder=3,
                   clip_on=False)
        marks.append(Line2D([], [], marker=">", ls="", color="black", ms=9, label="arrives"))
    for rid, step in data.finishes.items():
        ax.plot([step, step], [row[rid] - 0.45, row[rid] + 0.45], color="black",
                lw=max(1.0, 3 * fit), solid_capstyle="butt", zorder=3)
    if data.finishes:
        marks.append(Line2D([], [], marker="|", ls="", color="black", ms=16, mew=3,
                            label="finishes"))
    recomputed = [(s - 0.5, row[r]) for r, steps in data.preemptions.items() for s in steps
                  if s not in data.swaps.get(r, ())]
    swapped = [(s - 0.5, row[r]) for r, steps in data.swaps.items() for s in steps]
    # a down arrow for a swap: its K/V went down to host memory, nothing thrown away
    for points, marker, color, label in (
            (recomputed, "X", "#D55E00",
             "preempted (recomputed later)" if data.swaps else "preempted"),
            (swapped, "v", "#009E73", "preempted (swapped to host)")):
        if points:
            ax.scatter(*zip(*points), marker=marker, s=110 * max(fit, 0.3) ** 2, color=color,
                       edgecolor="black", zorder=4)
            marks.append(Line2D([], [], marker=marker, ls="", color=color, mec="black", ms=10,
                                label=label))
    _request_ticks(ax, requests)
    ax.set_xlim(0, max(data.last_step, 1) + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(STEP_AXIS)
    ax.set_ylabel("request")
    ax.grid(axis="x", color="#DDDDDD", lw=0.8)
    ax.set_axisbelow(True)
    handles = [Patch(facecolor=STYLE[s][0], hatch=STYLE[s][1], edgecolor=STYLE[s][2],
                     label=STYLE[s][4]) for s in STATES if s in present] + marks
    if legend:
        _legend(ax, handles)
    return handles


def _legend(ax: Axes, handles: list[Any] | None = None, labels: list[str] | None = None
            ) -> None:
    """The legend beside the axes, top right, where every picture puts it (the axes' own
    handles when none are given)."""
    placement = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
                     borderaxespad=0)
    if handles is None:
        ax.legend(**placement)
    elif labels is None:
        ax.legend(handles=handles, **placement)
    else:
        ax.legend(handles, labels, **placement)


def plot_timeline(trace: Any, ax: Axes | None = None, *, title: str | None = None,
                  legend: bool = True) -> Figure:
    """Gantt chart (chapter 02): one row a request (ids on the y axis), one column a step;
    prefill, decode, idle slot, stalled and waiting cells, a ">" where a request arrives and a
    bar "|" where it finishes. Data: `TimelineData` at `fig.minicb_data`."""
    data = timeline_data(trace)
    with _style():
        ax = _axes(ax, (13, min(10.0, 1.8 + 0.5 * len(data.requests))))
        _draw_timeline(ax, data, data.requests, legend)
        ax.set_title(_titled(title or "batch membership per step", trace))
    return _attach(ax, data)


# ---------------------------------------------------------------------------------- slots
@dataclass
class SlotsData:
    """What `plot_slots` draws: `owners[slot][step]` is the request holding the slot,
    `kinds[slot][step]` what it did (prefill, decode, idle or stalled); `runs` lists
    (slot, request, first step, last step) for each unbroken tenancy; `requests` is every
    request in timeline order (it sets the colours)."""

    slots: list[int]
    owners: dict[int, dict[int, str]]
    kinds: dict[int, dict[int, str]]
    runs: list[tuple[int, str, int, int]]
    requests: list[str]


def slot_data(trace: Any) -> SlotsData:
    """Slot owners per step. A running request that is not scheduled at a step keeps the slot
    it last had (the trace records slots for batch members only)."""
    records = _records(trace)
    _warn_without_snapshots(records, "slots held by stalled requests")
    owners: dict[int, dict[int, str]] = defaultdict(dict)
    kinds: dict[int, dict[int, str]] = defaultdict(dict)
    last_slot: dict[str, int] = {}
    for rec in records:
        members = {m.request_id for m in rec.members}
        for m in rec.members:
            if m.slot is not None:
                owners[m.slot][rec.step] = m.request_id
                kinds[m.slot][rec.step] = m.kind
                last_slot[m.request_id] = m.slot
        for rid in rec.page_tables:
            slot = last_slot.get(rid)
            if rid not in members and slot is not None and rec.step not in owners[slot]:
                owners[slot][rec.step] = rid
                kinds[slot][rec.step] = STALLED
        for rid in list(rec.preempted) + list(rec.finished):
            if rid not in rec.page_tables:
                last_slot.pop(rid, None)
    slots = sorted(owners)
    runs = [(s, rid, a, b) for s in slots for a, b, rid in _runs(owners[s])]
    order = timeline_data(records).requests
    return SlotsData(slots, {s: owners[s] for s in slots}, {s: kinds[s] for s in slots}, runs,
                     order)


def plot_slots(trace: Any, ax: Axes | None = None, *, title: str | None = None,
               legend: bool = True) -> Figure:
    """Slot reuse (chapters 02-03): one row a batch slot, coloured and labelled by the request
    holding it, so R4 taking R1's slot at step 31 is visible at a glance. Hatched: an idle slot
    (static batching) or a running request not scheduled. Data: `SlotsData`."""
    data = slot_data(trace)
    colour = {rid: request_colour(i) for i, rid in enumerate(data.requests)}
    last = max((max(o) for o in data.owners.values()), default=1)
    with _style():
        ax = _axes(ax, (13, min(8.0, 1.8 + 0.6 * len(data.slots))))
        for y, slot in enumerate(data.slots):
            for _, rid, a, b in (r for r in data.runs if r[0] == slot):
                face = colour[rid]
                for c, d, kind in _runs({k: data.kinds[slot][k] for k in range(a, b + 1)}):
                    hatch = {IDLE: "///", STALLED: ".."}.get(kind)
                    ax.broken_barh([(c - 1, d - c + 1)], (y - 0.4, 0.8), facecolors=face,
                                   alpha=0.35 if hatch else 1.0, hatch=hatch, edgecolors="black",
                                   linewidth=0.6)
                ax.add_patch(Rectangle((a - 1, y - 0.4), b - a + 1, 0.8, fill=False, lw=1.2,
                                       edgecolor="black"))
                if (b - a + 1) >= max(0.03, 0.012 * len(rid)) * last:  # wide enough for it
                    ax.text((a - 1 + b) / 2, y, rid, ha="center", va="center", fontsize=13,
                            color="black", fontweight="bold", clip_on=True,
                            path_effects=[withStroke(linewidth=3, foreground="white")])
        row = {slot: y for y, slot in enumerate(data.slots)}
        preempted = [(step - 0.5, row[slot]) for rid, steps in
                     timeline_data(trace).preemptions.items() for step in steps
                     for slot, owner, _, end in data.runs if owner == rid and end in
                     (step - 1, step)]
        if preempted:
            ax.scatter(*zip(*preempted), marker="X", s=110, color="#D55E00",
                       edgecolor="black", zorder=4)
        ax.set_yticks(range(len(data.slots)), [f"slot {s}" for s in data.slots])
        ax.set_ylim(len(data.slots) - 0.5, -0.5)
        ax.set_xlim(0, last + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(STEP_AXIS)
        ax.set_ylabel("batch slot")
        ax.set_title(_titled(title or "who holds each batch slot", trace))
        if legend:
            shown = [rid for rid in data.requests if any(r[1] == rid for r in data.runs)]
            handles = [Patch(facecolor=colour[r], edgecolor="black", label=r)
                       for r in shown] if len(shown) <= len(REQUEST_COLOURS) else [
                Patch(facecolor="white", edgecolor="none",
                      label=f"{len(shown)} requests: colours\nrepeat, labels name them")]
            if preempted:
                handles.append(Line2D([], [], marker="X", ls="", color="#D55E00", mec="black",
                                      ms=10, label="preempted"))
            kinds = {k for row in data.kinds.values() for k in row.values()}
            if IDLE in kinds:
                handles.append(Patch(facecolor="white", hatch="///", edgecolor="black",
                                     label="idle (finished, slot held)"))
            if STALLED in kinds:
                handles.append(Patch(facecolor="white", hatch="..", edgecolor="black",
                                     label="running, not scheduled"))
            _legend(ax, handles)
    return _attach(ax, data)


# ---------------------------------------------------------------------------------- pages
@dataclass
class PagesData:
    """What `plot_pages` draws, one entry per step 1..last (a step the trace skipped, when the
    engine had nothing to run, holds no used pages and keeps the cached count)."""

    steps: list[int]
    used: list[int]
    cached: list[int]
    free: list[int]
    total: int
    preempted_steps: list[int]


def page_data(trace: Any) -> PagesData:
    records = {r.step: r for r in _records(trace)}
    last = max(records, default=0)
    total = max((r.pages_total for r in records.values()), default=0)
    steps, used, cached = list(range(1, last + 1)), [], []
    for k in steps:
        rec = records.get(k)
        used.append(rec.pages_used if rec else 0)
        cached.append(rec.pages_cached if rec else (cached[-1] if cached else 0))
    free = [max(0, total - u - c) for u, c in zip(used, cached)]
    pre = sorted(k for k, r in records.items() if r.preempted)
    return PagesData(steps, used, cached, free, total, pre)


def plot_pages(trace: Any, ax: Axes | None = None, *, title: str | None = None,
               legend: bool = True) -> Figure:
    """KV page pool over the run (chapters 03-05): pages used by running requests, pages kept
    by the prefix index for reuse, and free pages, stacked; an "x" where a step preempted.
    Data: `PagesData`."""
    data = page_data(trace)
    edges = list(range(0, len(data.steps) + 1))
    with _style():
        ax = _axes(ax, (13, 4.5))
        if data.steps:
            top_used = data.used
            top_cached = [u + c for u, c in zip(data.used, data.cached)]
            ax.stairs(top_used, edges, baseline=0, fill=True, color="#0072B2",
                      label="used by running requests")
            ax.stairs(top_cached, edges, baseline=top_used, fill=True, facecolor=CACHED,
                      edgecolor="white", hatch="//", lw=0,
                      label="cached (prefix index, reusable)")
            if data.total:
                ax.stairs([data.total] * len(data.steps), edges, baseline=top_cached, fill=True,
                          color="#E8E8E8", label="free")
                ax.axhline(data.total, color="black", lw=1.5, ls="--",
                           label=f"pool size = {data.total} pages")
            if data.preempted_steps:
                top = data.total or max(top_cached)
                ax.scatter([k - 0.5 for k in data.preempted_steps],
                           [top] * len(data.preempted_steps), marker="X", s=90, clip_on=False,
                           color="#D55E00", edgecolor="black", zorder=4, label="preemption")
        ax.set_xlim(0, max(len(data.steps), 1) + 0.5)
        ax.set_ylim(0, max([data.total] + [u + c for u, c in zip(data.used, data.cached)]
                           + [1]) * 1.08)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(STEP_AXIS)
        ax.set_ylabel("KV pages")
        ax.set_title(_titled(title or "KV page pool", trace))
        if legend:
            _legend(ax)
    return _attach(ax, data)


@dataclass
class PageMapData:
    """What `plot_page_map` draws at one step: `owners[page]` lists the running requests
    whose page table holds the page; `shared` are pages in more than one table (a reused
    prefix). Cached and free pages are not told apart by page id in the trace."""

    step: int
    pages_total: int
    num_shown: int
    owners: dict[int, list[str]]
    shared: list[int]
    pages_cached: int
    page_tables: dict[str, list[int]]


def _record_at(records: list[StepRecord], step: int | None) -> StepRecord:
    if not records:
        raise ValueError("the trace is empty: run some steps first")
    if step is None:
        return records[-1]
    for rec in records:
        if rec.step == step:
            return rec
    steps = [r.step for r in records]
    raise ValueError(f"step {step} is not in the trace (steps {steps[0]}..{steps[-1]})")


def page_map_data(engine_or_trace: Any, step: int | None = None) -> PageMapData:
    rec = _record_at(_records(engine_or_trace), step)
    if not rec.snapshots:
        raise ValueError("this trace was recorded with trace_snapshots=False: it has no page "
                         "tables to draw; run the engine with trace_snapshots=True")
    owners: dict[int, list[str]] = defaultdict(list)
    for rid, pages in rec.page_tables.items():
        for p in pages:
            owners[p].append(rid)
    biggest = max(owners, default=-1) + 1
    shown = rec.pages_total if 0 < rec.pages_total <= 512 else max(biggest, 1)
    shown = max(shown, biggest)
    shared = sorted(p for p, o in owners.items() if len(o) > 1)
    return PageMapData(rec.step, rec.pages_total, shown, dict(owners), shared, rec.pages_cached,
                       {k: list(v) for k, v in rec.page_tables.items()})


def plot_page_map(engine_or_trace: Any, step: int | None = None, ax: Axes | None = None, *,
                  columns: int | None = None, title: str | None = None,
                  legend: bool = True) -> Figure:
    """Which request owns each KV page after `step` (default: the last step) (chapter 03):
    a grid of pages coloured by owner; a page in more than one page table (a shared prefix) is
    cross-hatched with a thick border. Data: `PageMapData`."""
    records = _records(engine_or_trace)
    data = page_map_data(records, step)
    order = list(data.page_tables)
    colour = {rid: request_colour(i) for i, rid in enumerate(timeline_data(records).requests)}
    if len({colour[rid] for rid in order}) < min(len(order), len(REQUEST_COLOURS)):
        # the other pictures' colours would give two requests on this map one colour (requests
        # 8 apart in the timeline): number them by their place on the map instead
        colour = {rid: request_colour(i) for i, rid in enumerate(order)}
    # 16 columns up to 128 pages, then about twice as many columns as rows (landscape)
    ncols = columns or (min(64, max(16, math.ceil(math.sqrt(2 * data.num_shown))))
                        if data.num_shown > 16 else data.num_shown)
    nrows = math.ceil(data.num_shown / ncols)
    cell = min(0.75, 10.0 / ncols, 8.0 / nrows)  # inches a page
    with _style():
        ax = _axes(ax, (max(8.0, cell * ncols + 3.5), max(2.5, cell * nrows + 1.6)))
        label = data.num_shown <= 128
        for p in range(data.num_shown):
            x, y = p % ncols, p // ncols
            owners = data.owners.get(p, [])
            face = colour[owners[0]] if owners else "#F2F2F2"
            shared = len(owners) > 1
            ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=face,
                                   hatch="xx" if shared else None,
                                   edgecolor="black" if owners else "#BBBBBB",
                                   linewidth=3 if shared else 0.8))
            if label:
                ax.text(x + 0.5, y + 0.5, f"{p}×{len(owners)}" if shared else str(p),
                        ha="center", va="center", fontsize=11 if shared else 12,
                        color=_text_colour(face) if owners and not shared else "black",
                        fontweight="bold" if shared else "normal",
                        bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none")
                        if shared else None)
        ax.set_xlim(0, ncols)
        ax.set_ylim(nrows, 0)
        ax.set_aspect("equal")
        every_col = max(1, math.ceil(ncols / 16))
        every_row = max(1, math.ceil(nrows / 16))
        ax.set_xticks([i + 0.5 for i in range(0, ncols, every_col)],
                      [str(i) for i in range(0, ncols, every_col)])
        ax.set_yticks([i + 0.5 for i in range(0, nrows, every_row)],
                      [str(i * ncols) for i in range(0, nrows, every_row)])
        ax.tick_params(length=0)
        ax.set_xlabel("page id = row start + column")
        ax.set_ylabel("row start")
        for side in ax.spines.values():
            side.set_visible(False)
        used = len(data.owners)
        ax.set_title(_titled(title or f"KV pages after step {data.step}: {used} in page "
                             f"tables ({len(data.shared)} shared), {data.pages_cached} cached",
                             engine_or_trace), fontsize=15)
        if legend:
            pages = {r: len(data.page_tables[r]) for r in order}
            handles = [Patch(facecolor=colour[r], edgecolor="black",
                             label=f"{r} ({pages[r]} page{'s' * (pages[r] != 1)})")
                       for r in order] if len(order) <= len(REQUEST_COLOURS) else [
                Patch(facecolor="white", edgecolor="none",
                      label=f"{len(order)} requests: colours repeat")]
            if data.shared:
                handles.append(Patch(facecolor="white", hatch="xx", edgecolor="black", lw=2.5,
                                     label="shared prefix page"))
            handles.append(Patch(facecolor="#F2F2F2", edgecolor="#BBBBBB",
                                 label="free or cached"))
            _legend(ax, handles)
    return _attach(ax, data)


# --------------------------------------------------------------------------------- budget
@dataclass
class BudgetData:
    """What `plot_budget` draws: decode and prefill tokens per recorded step, and the budget."""

    steps: list[int]
    decode: list[int]
    prefill: list[int]
    budget: int | None

    @property
    def total(self) -> list[int]:
        return [d + p for d, p in zip(self.decode, self.prefill)]


def budget_data(trace: Any, max_num_batched_tokens: int | None = None) -> BudgetData:
    records = _records(trace)
    if max_num_batched_tokens is None:
        config = getattr(getattr(trace, "engine", trace), "config", None)
        max_num_batched_tokens = getattr(config, "max_num_batched_tokens", None)
    return BudgetData([r.step for r in records], [r.num_decode_tokens for r in records],
                      [r.num_prefill_tokens for r in records], max_num_batched_tokens)


def plot_budget(trace: Any, max_num_batched_tokens: int | None = None, ax: Axes | None = None,
                *, title: str | None = None, legend: bool = True, ymax: float | None = None,
                decode_max: int | None = None) -> Figure:
    """Tokens per step (chapters 04-05): decode tokens stacked under prefill tokens, against
    the `max_num_batched_tokens` line, and below them a lane of the decode tokens alone at
    their own scale (0 to `decode_max`), so three decodes beside an 800-token prefill still
    show. `ymax` cuts the upper scale. The budget is taken from the engine's config when an
    Engine is passed. Data: `BudgetData`."""
    data = budget_data(trace, max_num_batched_tokens)
    top = ymax if ymax is not None else max(data.total + [data.budget or 0, 1]) * 1.1
    lane_top = decode_max if decode_max is not None else max(data.decode + [1])
    x = [k - 0.5 for k in data.steps]
    edges = {"edgecolor": "white", "linewidth": 0.6} if len(data.steps) <= 150 else \
        {"linewidth": 0}  # separate bars can be counted; hundreds would turn white
    with _style():
        ax = _axes(ax, (13, 5.0))
        ax.bar(x, data.decode, width=1.0, color=STYLE[DECODE][0], label="decode tokens",
               **edges)
        ax.bar(x, data.prefill, width=1.0, bottom=data.decode, color=STYLE[PREFILL][0],
               label="prefill tokens", **edges)
        if data.budget:
            ax.axhline(data.budget, color="black", ls="--", lw=2, zorder=0,
                       label=f"max_num_batched_tokens = {data.budget}")
        # the decode lane, below the axis: the decode tokens alone, scaled to the lane
        lane, gap = LANE * top, 0.1 * top
        base = -(gap + lane)
        ax.bar(x, [d / lane_top * lane for d in data.decode], width=1.0, bottom=base,
               color=STYLE[DECODE][0], **edges)
        ax.axhspan(base, -gap, color="#F2F2F2", zorder=0, lw=0)
        ax.axhline(0, color="black", lw=0.8)
        ax.text(1.01, base + lane / 2, f"decode tokens\nalone (0 to {lane_top})",
                transform=ax.get_yaxis_transform(), va="center", ha="left", fontsize=12,
                color=STYLE[DECODE][0], clip_on=False)
        ticks = [t for t in MaxNLocator(nbins=5, integer=True).tick_values(0, top) if t <= top]
        ax.set_yticks([base, -gap] + ticks, ["0", str(lane_top)] + [f"{t:g}" for t in ticks])
        ax.set_xlim(0, max(data.steps, default=1) + 0.5)
        ax.set_ylim(base, top)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(STEP_AXIS)
        ax.set_ylabel("tokens in the step")
        ax.set_title(_titled(title or "token budget per step", trace))
        if legend:
            handles, labels = ax.get_legend_handles_labels()
            order = sorted(range(len(labels)), key=lambda i: labels[i].startswith("max_"))
            _legend(ax, [handles[i] for i in order], [labels[i] for i in order])
    return _attach(ax, data)


# ------------------------------------------------------------------------ attention mask
@dataclass
class MaskBlock:
    """One member of the step's flat batch: its query rows [row_start, row_end) of the batch,
    its key columns [col_start, col_end) (its context after the step, positions 0 to
    `start + num_tokens - 1`), and its page table (empty when the trace has none for it)."""

    request_id: str
    kind: str
    start: int
    num_tokens: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    pages: list[int]


@dataclass
class AttentionMaskData:
    """What `plot_attention_mask` draws for one step. `mask[i][j]`: 0 where query row i does
    not attend to key column j (another request's key, or a later position), 1 where it reads
    a key cached by an earlier step, 2 where it reads a key written by this step."""

    step: int
    page_size: int
    blocks: list[MaskBlock]
    mask: Any  # numpy array [query rows, key columns] of 0, 1, 2

    @property
    def query_start_loc(self) -> list[int]:
        return [0] + [b.row_end for b in self.blocks]

    @property
    def context_lens(self) -> list[int]:
        return [b.col_end - b.col_start for b in self.blocks]

    def page_edges(self, block: MaskBlock) -> list[int]:
        """Key columns where one of the block's pages ends and the next begins."""
        return list(range(block.col_start + self.page_size, block.col_end, self.page_size))


def attention_mask_data(trace: Any, step: int | None = None, page_size: int | None = None
                        ) -> AttentionMaskData:
    """The mask one step's attention computes (chapter 05), from the trace alone: members in
    batch order (the engine's flat batch), each attending causally over its own context."""
    import numpy as np

    rec = _record_at(_records(trace), step)
    if page_size is None:
        config = getattr(getattr(trace, "engine", trace), "config", None)
        page_size = getattr(config, "page_size", None)
    if page_size is None:
        from minicb.config import EngineConfig
        page_size = EngineConfig().page_size
    members = [m for m in rec.members if m.num_tokens > 0]
    if any(m.start is None for m in members):
        raise ValueError("this trace has no `start` per member (a trace made by hand): the "
                         "mask needs each member's cached tokens; record it with the engine")
    blocks, row, col = [], 0, 0
    for m in members:
        context = m.start + m.num_tokens
        blocks.append(MaskBlock(m.request_id, m.kind, m.start, m.num_tokens, row,
                                row + m.num_tokens, col, col + context,
                                list(rec.page_tables.get(m.request_id, []))))
        row, col = row + m.num_tokens, col + context
    mask = np.zeros((row, col), dtype=np.int8)
    for b in blocks:
        for i in range(b.num_tokens):
            position = b.start + i  # the query's position in its own sequence
            mask[b.row_start + i, b.col_start:b.col_start + b.start] = 1
            mask[b.row_start + i, b.col_start + b.start:b.col_start + position + 1] = 2
    return AttentionMaskData(rec.step, page_size, blocks, mask)


def plot_attention_mask(trace: Any, step: int | None = None, ax: Axes | None = None, *,
                        page_size: int | None = None, title: str | None = None,
                        legend: bool = True) -> Figure:
    """One step's flat batch as the mask its attention computes (chapter 05): query tokens
    down, key positions across, one block per request. A decode row reads its whole cached
    context; a prefill chunk reads its cached prefix and, causally, itself. Dotted lines mark
    page boundaries, and each page's id is written above it when the trace has the page
    table. Data: `AttentionMaskData`."""
    import numpy as np

    data = attention_mask_data(trace, step, page_size)
    colours = {kind: matplotlib.colors.to_rgb(STYLE[kind][0]) for kind in (DECODE, PREFILL)}
    image = np.ones(data.mask.shape + (3,))
    for b in data.blocks:
        rgb = np.array(colours.get(b.kind, colours[DECODE]))
        rows = slice(b.row_start, b.row_end)
        block = data.mask[rows]
        tint = 1 - 0.45 * (1 - rgb)  # a lighter shade: keys read from earlier steps' pages
        image[rows][block == 1] = tint
        image[rows][block == 2] = rgb
    rows, cols = data.mask.shape
    with _style():
        ax = _axes(ax, (13, min(9.0, 2.5 + 0.06 * rows + 0.3 * len(data.blocks))))
        ax.imshow(image, aspect="auto", interpolation="nearest",
                  extent=(0, max(cols, 1), max(rows, 1), 0))
        for b in data.blocks:
            ax.add_patch(Rectangle((b.col_start, b.row_start), b.col_end - b.col_start,
                                   b.row_end - b.row_start, fill=False, lw=1.2,
                                   edgecolor="black"))
            for edge in data.page_edges(b):
                ax.plot([edge, edge], [b.row_start, b.row_end], color="black", lw=0.8, ls=":")
            if b.pages and (b.col_end - b.col_start) / max(cols, 1) > 0.06:
                for i, page in enumerate(b.pages[:math.ceil((b.col_end - b.col_start)
                                                            / data.page_size)]):
                    left = b.col_start + i * data.page_size
                    ax.text((left + min(left + data.page_size, b.col_end)) / 2, -0.01 * rows,
                            str(page), ha="center", va="bottom", fontsize=10, clip_on=False)
        ax.set_yticks([(b.row_start + b.row_end) / 2 for b in data.blocks],
                      [f"{b.request_id}: {b.kind}, {b.num_tokens} "
                       f"quer{'y' if b.num_tokens == 1 else 'ies'}" for b in data.blocks])
        ax.set_xticks([(b.col_start + b.col_end) / 2 for b in data.blocks],
                      [f"{b.request_id}\n{b.col_end - b.col_start} keys" for b in data.blocks])
        ax.set_xlim(0, max(cols, 1))
        ax.set_ylim(max(rows, 1), 0)
        ax.set_xlabel("key positions, grouped by request (dotted: page boundaries)")
        ax.set_ylabel("query tokens of the flat batch")
        ax.set_title(_titled(title or f"step {data.step}: {rows} query tokens, one forward",
                             trace), pad=22)
        if legend:
            handles = [Patch(facecolor=colours[DECODE], label="decode row: its key this step"),
                       Patch(facecolor=1 - 0.45 * (1 - np.array(colours[DECODE])),
                             label="decode row: cached context"),
                       Patch(facecolor=colours[PREFILL], label="chunk: causal over itself"),
                       Patch(facecolor=1 - 0.45 * (1 - np.array(colours[PREFILL])),
                             label="chunk: cached prefix"),
                       Patch(facecolor="white", edgecolor="black", label="masked")]
            kinds = {b.kind for b in data.blocks}
            _legend(ax, [h for h in handles if h.get_label() == "masked"
                         or h.get_label().startswith("decode") and DECODE in kinds
                         or h.get_label().startswith("chunk") and PREFILL in kinds])
    return _attach(ax, data)


# -------------------------------------------------------------------------------- compare
def compare(traces: dict[str, Any], kind: str = "timeline", *, ymax: float | None = None,
            **options: Any) -> Figure:
    """The same workload under several policies, one panel each, stacked on one shared step
    axis (chapter 03: static vs continuous). `kind`: timeline, slots, pages or budget;
    `options` go to that plot (e.g. `max_num_batched_tokens`). Request rows line up across
    timeline panels. `ymax` cuts a pages or budget picture's y axis there, to show what a tall
    bar dwarfs (chapters 04-05: the decode tokens beside a prefill). Data: {name: data} at
    `fig.minicb_data`."""
    if ymax is not None and (kind not in ("pages", "budget") or not is_finite_number(ymax)
                             or ymax <= 0):
        raise ValueError(f"ymax cuts a pages or budget picture's y axis: a number > 0 with "
                         f"kind='pages' or 'budget', got ymax={ymax!r} with kind={kind!r}")
    plots = {"timeline": plot_timeline, "slots": plot_slots, "pages": plot_pages,
             "budget": plot_budget}
    if kind not in plots:
        raise ValueError(f"kind must be one of {sorted(plots)}, got {kind!r}")
    if not traces:
        raise ValueError("compare needs at least one trace")
    datas = {name: timeline_data(t) for name, t in traces.items()}
    rows = list(dict.fromkeys(r for d in datas.values() for r in d.requests))
    if kind == "timeline":
        heights = [max(1.5, 0.45 * len(rows) + 0.8)] * len(traces)
    elif kind == "slots":
        heights = [max(1.5, 0.5 * len(slot_data(t).slots) + 0.8) for t in traces.values()]
    else:
        heights = [3.0] * len(traces)
    out: dict[str, Any] = {}
    handles: dict[str, Any] = {}  # one legend for every panel: a state only a lower panel has
    if kind == "budget":  # one upper scale and one decode lane scale for every panel
        budgets = [budget_data(t, options.get("max_num_batched_tokens")) for t in traces.values()]
        options = {**options, "decode_max": max(max(b.decode + [1]) for b in budgets),
                   "ymax": ymax if ymax is not None else max(
                       max(b.total + [b.budget or 0, 1]) for b in budgets) * 1.1}
    with _style():
        fig = Figure(figsize=(13, min(16.0, sum(heights) + 0.6)), layout="constrained")
        axes = fig.subplots(len(traces), 1, sharex=True, height_ratios=heights, squeeze=False)
        for i, (ax, (name, trace)) in enumerate(zip(axes[:, 0], traces.items())):
            data = datas[name]
            ends = max(data.finishes.values(), default=data.last_step)
            label = _titled(f"{name}: last request finishes at step {ends}", trace)
            if kind == "timeline":
                for handle in _draw_timeline(ax, data, rows, legend=False):
                    handles.setdefault(handle.get_label(), handle)
                ax.set_title(label, loc="left")
                out[name] = ax.minicb_data = data
            else:
                plots[kind](trace, ax=ax, legend=True, **options)
                drawn = ax.get_legend()
                for handle, text in zip(drawn.legend_handles, drawn.get_texts()):
                    handles.setdefault(text.get_text(), handle)
                drawn.remove()
                ax.set_title("")
                ax.set_title(label, loc="left")
                out[name] = ax.minicb_data
            if i < len(traces) - 1:
                ax.set_xlabel("")
        last = max(d.last_step for d in datas.values())
        axes[0, 0].set_xlim(0, max(last, 1) + 0.5)
        if kind == "pages":  # one y scale, so a spike is as tall in every panel
            top = ymax if ymax is not None else max(ax.get_ylim()[1] for ax in axes[:, 0])
            for ax in axes[:, 0]:
                ax.set_ylim(0, top)
        if ymax is not None:
            unit = "tokens" if kind == "budget" else "pages"
            fig.suptitle(f"y axis cut at {ymax:g} {unit}: what the tall bars dwarf", fontsize=16)
        lines = [text for text in handles if text.startswith("max_num_batched_tokens")]
        if len(lines) > 1:  # runs with their own budgets: one legend entry, each in its title
            handles["max_num_batched_tokens (each panel's title gives it)"] = handles[lines[0]]
            for text in lines:
                del handles[text]
            for ax in axes[:, 0]:
                if ax.minicb_data.budget:  # a bare trace may not know its budget
                    ax.set_title(f"{ax.get_title(loc='left')}; max_num_batched_tokens "
                                 f"{ax.minicb_data.budget}", loc="left")
        _legend(axes[0, 0], list(handles.values()), list(handles))
    fig.minicb_data = out
    return fig


# ----------------------------------------------------------------------------------- text
def _nice_tick(span_steps: int, steps_per_col: int, min_chars: int) -> int:
    for base in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10000):
        if base / steps_per_col >= min_chars:
            return base
    return max(1, span_steps)


def render_text(trace: Any, width: int = 100, legend: bool = True) -> str:
    """The timeline as text (chapter 02's block diagram; `python -m minicb demo` prints it):
    █ decode, ▓ prefill, ░ idle slot, - running but not scheduled, · waiting, | finished,
    x preempted (v when swapped to host memory). Wider than `width` characters, each column
    covers several steps (compute shows over idling, prefill over decode, and a finish "|"
    goes in the column after the last one computed) and the header says how many. The header
    is a ruler of elapsed steps, like a time axis: label v sits where step v ends and step
    v + 1 begins, so it starts at 0, and a request that finishes at step v shows its "|" under
    v (within a column when compressed)."""
    data = timeline_data(trace)
    if not data.requests:
        return "(empty trace)"
    label_w = max(6, max(len(r) for r in data.requests) + 2)
    cols_avail = max(10, width - label_w)
    span = data.last_step + 1  # one more column for a "|" after the last step
    per_col = math.ceil(span / cols_avail)
    ncols = math.ceil(span / per_col)
    rank = {PREFILL: 0, DECODE: 1, STALLED: 2, IDLE: 3, WAITING: 4}
    lines = []
    every = _nice_tick(data.last_step, per_col, 8)
    ticks = list(range(0, data.last_step + 1, every))
    if data.last_step - ticks[-1] >= every / 2:
        ticks.append(data.last_step)
    header, rule = [" "] * (cols_avail + 1), ["-"] * ncols
    for v in ticks:
        c = min(v // per_col, ncols - 1)
        text = str(v)
        if c + len(text) <= cols_avail and all(ch == " " for ch in header[c:c + len(text) + 1]):
            header[c:c + len(text)] = text
            rule[c] = "|"
    lines.append("step".ljust(label_w) + "".join(header).rstrip())
    lines.append(" " * label_w + "".join(rule))
    for rid in data.requests:
        chars = [" "] * ncols
        best = [9] * ncols
        for step, state in data.cells[rid].items():
            c = (step - 1) // per_col
            if rank.get(state, 1) < best[c]:
                best[c] = rank.get(state, 1)
                chars[c] = GLYPHS.get(state, "█")
        for step in data.preemptions.get(rid, []):
            chars[(step - 1) // per_col] = "v" if step in data.swaps.get(rid, ()) else "x"
        if rid in data.finishes:
            c = min(data.finishes[rid] // per_col, ncols - 1)
            if chars[c] in (GLYPHS[PREFILL], GLYPHS[DECODE]) and c + 1 < ncols:
                # a column of several steps holds the last ones computed: the mark goes after
                # it, so a request whose whole life fits one column still shows its work
                c += 1
            chars[c] = "|"
        lines.append(rid.ljust(label_w) + "".join(chars).rstrip())
    if legend:
        lines.append("")
        items = ["█ decode", "▓ prefill", "░ idle slot", "- running, not scheduled",
                 "· waiting", "| finished", "x preempted"] + \
            (["v swapped to host"] if data.swaps else [])
        line = ""
        for item in items:
            if line and len(line) + 2 + len(item) > width:
                lines.append(line)
                line = ""
            line = f"{line}  {item}" if line else item
        lines.append(line)
        if per_col > 1:
            lines.append(f"(1 column = {per_col} steps)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- step-through
@dataclass
class StepState:
    """What the step-through widget shows at one step (plain data, read by tests). `running`:
    requests running after the step; `scheduled`: the batch, as `Member`s."""

    step: int
    scheduled: list[Member] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    running: list[str] = field(default_factory=list)
    page_tables: dict[str, list[int]] = field(default_factory=dict)
    arrived: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    pages_used: int = 0
    pages_cached: int = 0
    pages_total: int = 0
    recorded: bool = True


def step_state(trace: Any, step: int) -> StepState:
    """The state at `step`; a step missing from the trace (the engine skipped ahead while
    nothing was queued) is an empty step."""
    rec = next((r for r in _records(trace) if r.step == step), None)
    if rec is None:
        return StepState(step, recorded=False)
    _warn_without_snapshots([rec], "the waiting queue and page tables")
    running = list(rec.page_tables)
    for m in rec.members:
        if m.kind != IDLE and m.request_id not in rec.finished and m.request_id not in running:
            running.append(m.request_id)
    return StepState(step, [Member(*m) for m in rec.members], list(rec.waiting), running,
                     {k: list(v) for k, v in rec.page_tables.items()}, list(rec.arrived),
                     list(rec.finished), list(rec.preempted), rec.num_prefill_tokens,
                     rec.num_decode_tokens, rec.pages_used, rec.pages_cached, rec.pages_total)


def _html_state(s: StepState) -> str:
    e = html.escape
    cell = 'style="padding:2px 10px;text-align:left"'
    if s.scheduled:
        rows = "".join(
            f"<tr><td {cell}><b>{e(m.request_id)}</b></td><td {cell}>{e(m.kind)}</td>"
            f"<td {cell}>{m.num_tokens}</td><td {cell}>{'' if m.slot is None else m.slot}</td>"
            f"</tr>" for m in s.scheduled)
        batch = (f"<table><tr><th {cell}>request</th><th {cell}>kind</th><th {cell}>tokens"
                 f"</th><th {cell}>slot</th></tr>{rows}</table>")
    else:
        batch = "<i>nothing scheduled</i>"
    shared = {p for p, n in _count_pages(s.page_tables).items() if n > 1}
    tables = "".join(
        f"<div><b>{e(rid)}</b>: [" + ", ".join(f"<u>{p}</u>" if p in shared else str(p)
                                               for p in pages) + "]</div>"
        for rid, pages in s.page_tables.items()) or "<i>none</i>"

    def ids(xs: list[str]) -> str:
        return ", ".join(e(x) for x in xs) or "<i>empty</i>"

    events = [f"{name}: {ids(xs)}" for name, xs in
              (("arrived", s.arrived), ("finished", s.finished), ("preempted", s.preempted)) if xs]
    total = f" of {s.pages_total}" if s.pages_total else ""
    return (
        '<div style="font-size:15px;line-height:1.4;display:flex;gap:40px">'
        f"<div><h4 style='margin:4px 0'>step {s.step}: scheduled "
        f"{s.num_decode_tokens} decode + {s.num_prefill_tokens} prefill tokens</h4>{batch}"
        f"<div>{'<br>'.join(events)}</div></div>"
        f"<div><div><b>waiting</b>: {ids(s.waiting)}</div>"
        f"<div><b>running</b>: {ids(s.running)}</div>"
        f"<div><b>KV pages</b>: {s.pages_used} used, {s.pages_cached} cached{total}</div>"
        f"<div style='margin-top:6px'><b>page tables</b> (shared pages underlined):</div>"
        f"{tables}</div></div>")


def _count_pages(tables: dict[str, list[int]]) -> dict[int, int]:
    counts: dict[int, int] = defaultdict(int)
    for pages in tables.values():
        for p in pages:
            counts[p] += 1
    return counts


def _widgets():
    try:
        import ipywidgets
    except ImportError as exc:  # pragma: no cover - ipywidgets is a dependency
        raise ImportError("step_through needs ipywidgets: pip install ipywidgets") from exc
    return ipywidgets


class StepThrough:
    """Built by `step_through`; see there. `widget` is the ipywidgets VBox displayed."""

    def __init__(self, trace: Any, *, picture: bool = True, interval: int = 600) -> None:
        w = _widgets()
        self.records = _records(trace)
        if not self.records:
            raise ValueError("the trace is empty: run some steps first")
        first, last = self.records[0].step, self.records[-1].step
        # a picture takes 0.2-0.6 s to draw: redraw when the slider is let go, not while dragged
        self.slider = w.IntSlider(value=first, min=first, max=last, description="step",
                                  continuous_update=False, layout=w.Layout(width="60%"))
        self.play = w.Play(value=first, min=first, max=last, step=1, interval=interval,
                           description="play")
        self.link = w.jslink((self.play, "value"), (self.slider, "value"))
        self.image = w.Image(format="png", layout=w.Layout(width="100%", max_width="1200px")) \
            if picture else None
        self.info = w.HTML()
        self._figure, self._cursor = None, []
        if picture:
            with _style():
                fig = Figure(figsize=(12, min(7.0, 1.6 + 0.4 * len(
                    timeline_data(self.records).requests))), layout="constrained", dpi=100)
                plot_timeline(self.records, ax=fig.add_subplot())
            self._figure = fig
        parts = [w.HBox([self.play, self.slider])] + ([self.image] if picture else [])
        self.widget = w.VBox(parts + [self.info])
        self.state = step_state(self.records, first)
        self.slider.observe(lambda change: self._show(change["new"]), names="value")
        self._show(first)

    def _show(self, step: int) -> None:
        self.state = step_state(self.records, step)
        self.info.value = _html_state(self.state)
        if self._figure is not None:
            ax = self._figure.axes[0]
            for artist in self._cursor:
                artist.remove()
            # black and dashed: apart from every state colour and from the preemption mark
            self._cursor = [
                ax.axvspan(step - 1, step, color="#666666", alpha=0.2, lw=0, zorder=2.5),
                ax.axvline(step - 0.5, color="black", ls="--", lw=2.5, zorder=5,
                           path_effects=[withStroke(linewidth=5, foreground="white")])]
            ax.set_title(f"step {step} (cursor) of {self.records[-1].step}", fontsize=16)
            buf = io.BytesIO()
            self._figure.savefig(buf, format="png")
            self.image.value = buf.getvalue()

    def show(self, step: int) -> StepState:
        """Move to `step` (as the slider does) and return its state."""
        self.slider.value = step
        return self.state

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)


def step_through(trace: Any, *, picture: bool = True, interval: int = 600) -> StepThrough:
    """Replay a run one step at a time (chapters 03-05): a play button and a step slider
    (linked in the browser with `jslink`), the timeline with a cursor at the step, the waiting
    and running queues, each running request's page table, and what the step scheduled.
    The kernel drives it: `w.slider.value = k` (or `w.show(k)`) updates `w.state`, a
    `StepState`. Display `w` (or `w.widget`, the VBox) in a notebook."""
    return StepThrough(trace, picture=picture, interval=interval)


# ------------------------------------------------------------------------------- examples
@dataclass
class _Sim:
    rid: str
    prompt: int
    output: int
    arrival: int
    computed: int = 0
    generated: int = 0
    slot: int | None = None
    pages: list[int] = field(default_factory=list)


def seed_example(policy: str = "continuous", outputs: Iterable[int] = (30, 200, 80, 60),
                 arrivals: Iterable[int] = (1, 1, 1, 31), prompt_len: int = 20,
                 page_size: int = 16, num_pages: int = 64, max_num_seqs: int = 3
                 ) -> list[StepRecord]:
    """The chapter's example as a hand-made trace (chapters 02-03): R1, R2, R3 generate 30,
    200 and 80 tokens, R4 arrives at step 31. `policy` "static" (the batch lives until its
    slowest member ends; R4 waits) or "continuous" (R4 takes R1's freed slot at step 31). Each
    request's prefill step yields its first token; pages follow `page_size`, and a finished
    request's full prompt pages stay cached. No model and no engine needed."""
    if policy not in ("static", "continuous"):
        raise ValueError(f"policy must be 'static' or 'continuous', got {policy!r}")
    reqs = [_Sim(f"R{i + 1}", prompt_len, n, a)
            for i, (n, a) in enumerate(zip(outputs, arrivals))]
    free_pages, free_slots = list(range(num_pages)), list(range(max_num_seqs))
    pending, waiting, running, batch = list(reqs), [], [], []
    cached, records, step, t = 0, [], 0, 0.0
    while pending or waiting or running:
        step += 1
        arrived = [r for r in pending if r.arrival <= step]
        for r in arrived:
            pending.remove(r)
            waiting.append(r)
        admit: list[_Sim] = []
        if policy == "continuous" or not batch:
            batch = [] if policy == "static" else batch
            while waiting and free_slots:
                r = waiting.pop(0)
                r.slot = free_slots.pop(0)
                admit.append(r)
                batch.append(r)
        members, finished, sampled = [], [], []
        for r in batch:
            if r in running or r in admit:
                n = r.prompt if r in admit else 1
                kind = PREFILL if r in admit else DECODE
                members.append(Member(r.rid, kind, n, r.slot, r.computed))
                r.computed += n
                r.generated += 1
                need = math.ceil(r.computed / page_size) - len(r.pages)
                r.pages += [free_pages.pop(0) for _ in range(need)]
                sampled.append(r.rid)
            elif policy == "static":
                members.append(Member(r.rid, IDLE, 0, r.slot))
        running += admit
        for r in list(running):
            if r.generated >= r.output:
                finished.append(r.rid)
                running.remove(r)
                keep = r.prompt // page_size
                cached += keep
                free_pages = sorted(free_pages + r.pages[keep:])
                if policy == "continuous":
                    free_slots = sorted(free_slots + [r.slot])
                    batch.remove(r)
        if policy == "static" and batch and not running:
            free_slots, batch = sorted(free_slots + [r.slot for r in batch]), []
        members.sort(key=lambda m: m.kind != DECODE)
        used = sum(len(r.pages) for r in running)
        dt = 0.02 + 0.0005 * sum(m.num_tokens for m in members)
        records.append(StepRecord(
            step, members, [r.rid for r in waiting], finished, [], used, cached, t, t + dt,
            arrived=[r.rid for r in arrived if r.arrival > 1], sampled=sampled,
            page_tables={r.rid: list(r.pages) for r in running}, t_forward=dt * 0.9,
            pages_total=num_pages))
        t += dt
    return records
