"""The trace (chapters 02-06): a `StepRecord` per engine step, the data every picture reads."""
# plain data: pictures and metrics need no engine; time is both the step index and seconds

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Member(NamedTuple):
    """What one request did in one step."""

    request_id: str
    kind: str  # "prefill", "decode" or "idle" (a static batch's finished member, holding its slot)
    num_tokens: int  # tokens it advanced
    slot: int | None
    start: int | None = None  # its tokens in the cache before the step (None: a trace by hand)


@dataclass
class StepRecord:
    """One engine step, as plain data (chapter 00 draws a first timeline from it)."""

    step: int  # counts from 1
    members: list[Member]
    waiting: list[str]  # ids in the waiting queue after scheduling (arrived, not running)*
    finished: list[str]  # ids that finished at this step (any finish reason, rejected included)
    preempted: list[str]  # ids preempted while scheduling this step
    pages_used: int  # pages referenced by running requests after the step
    pages_cached: int  # unreferenced pages kept by the prefix index after the step
    t_start: float  # wall-clock seconds since the engine started
    t_end: float
    arrived: list[str] = field(default_factory=list)  # ids that entered the queue this step
    sampled: list[str] = field(default_factory=list)  # ids that got a new token this step
    page_tables: dict[str, list[int]] = field(default_factory=dict)  # running ids -> pages*
    t_forward: float = 0.0  # seconds inside the model forward (the rest is host time)
    pages_total: int = 0
    slots: dict[str, int] = field(default_factory=dict)  # running ids -> slot, after the step*
    cached_pages: list[int] = field(default_factory=list)  # unreferenced, kept for reuse*
    num_waiting: int = 0  # len(waiting), kept even without snapshots
    pages_evicted: int = 0  # cached prefix pages evicted to make room during this step
    pages_swapped_out: int = 0  # pages copied to host memory before this step's forward
    pages_swapped_in: int = 0  # pages copied back from host memory (chapter 06)
    swapped: list[str] = field(default_factory=list)  # of `preempted`, those whose K/V was
    # copied to host memory (preemption_mode="swap"); the others will be recomputed
    tokens_discarded: int = 0  # computed K/V this step's preemptions threw away (lost work)
    tokens_recomputed: int = 0  # of the members' tokens, ones computed before a preemption
    # speculative decoding (chapter 08): decode member id -> (tokens guessed, guesses the model
    # kept); the member's num_tokens counts its last token and every guess
    speculated: dict[str, tuple[int, int]] = field(default_factory=dict)
    snapshots: bool = True  # False: the engine ran with trace_snapshots=False, so the fields
    # marked * are empty (the pictures that need them say so)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(m.num_tokens for m in self.members if m.kind == "prefill")

    @property
    def num_decode_tokens(self) -> int:
        return sum(m.num_tokens for m in self.members if m.kind == "decode")

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start


def record_step(step: int, members: list[Member], batch, pool, waiting, running,
                snapshots: bool, **fields) -> StepRecord:
    """The record of one step (chapter 03): members, idle and preempted ones, counts, `fields`."""
    # with `snapshots`, the copies the step pictures draw
    record = StepRecord(
        step=step, members=members + [Member(r.request_id, "idle", 0, r.slot) for r in batch.idle],
        waiting=[r.request_id for r in waiting] if snapshots else [],
        preempted=[r.request_id for r in batch.preempted],
        swapped=[r.request_id for r in batch.swapped], pages_used=pool.num_used,
        pages_cached=pool.num_cached, pages_total=pool.num_pages, num_waiting=len(waiting),
        tokens_discarded=batch.num_discarded_tokens, snapshots=snapshots, **fields)
    if snapshots:
        record.page_tables = {r.request_id: list(r.page_table) for r in running}
        record.slots = {r.request_id: r.slot for r in running}
        record.cached_pages = list(pool.prefix.lru) if pool.prefix is not None else []
    return record
