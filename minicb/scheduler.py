"""Schedulers (chapters 02-06): each step a policy gets a `SchedulerContext` (queues, limits,
six verbs) and fills its `ScheduledBatch`: who advances by how many tokens. Policies see requests,
token counts and pages, never tensors. Queue order and admission control live here too."""

from __future__ import annotations

import bisect
from collections import Counter, deque
from dataclasses import dataclass, field

from minicb.config import EngineConfig, is_int
from minicb.kv_cache import PagePool
from minicb.request import Request, Status


class SchedulerError(ValueError):
    """A policy misused a verb or returned a batch the engine refuses; names the rule."""


@dataclass
class ScheduledBatch:
    """The plan for one step, and the swap copies to run before its forward (chapter 06)."""

    items: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens to advance)
    idle: list[Request] = field(default_factory=list)  # finished, holding their slot (static)
    preempted: list[Request] = field(default_factory=list)
    swapped: list[Request] = field(default_factory=list)  # of `preempted`, those kept on host
    num_discarded_tokens: int = 0  # computed K/V this step's preemptions threw away
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device page, host page)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host page, device page)
    swap_release: list[int] = field(default_factory=list)  # host pages free once copied

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


# ------------------------------------------------------------------- the queue (chapter 06)
def queue_rank(preemption: str, tenant_service: Counter | None = None):
    """The waiting queue's sort key, and the reverse order of preemption: arrival ("newest"),
    `priority`, earliest deadline, or least-served tenant ("fair"); ties by arrival."""
    first = {"priority": lambda r: r.priority, "deadline": lambda r: r.deadline_time,
             "fair": lambda r: tenant_service[r.tenant]}.get(preemption, lambda r: 0)
    return lambda r: (first(r), r.seq_index)


def enqueue(waiting: deque[Request], req: Request, preemption: str,
            preempted: bool = False) -> None:
    """Queue `req` by rank, or an arrival at the back and a preempted request at the front."""
    if preemption in ("priority", "deadline"):
        rank = queue_rank(preemption)
        index = next((i for i, r in enumerate(waiting) if rank(r) > rank(req)), len(waiting))
        waiting.insert(index, req)
    elif preempted:
        waiting.appendleft(req)
    else:
        waiting.append(req)


def reorder(waiting: deque[Request], config: EngineConfig, step: int,
            tenant_service: Counter) -> None:
    """Re-sort the orders that change as steps pass: aged priorities, tenant service."""
    if aging := config.priority_aging_steps:
        def key(r):
            return r.priority - (step - r.metrics.arrival_step) // aging, r.seq_index
    elif config.preemption == "fair":
        key = queue_rank("fair", tenant_service)
    else:
        return
    ordered = sorted(waiting, key=key)
    waiting.clear()
    waiting.extend(ordered)


def is_protected(req: Request, config: EngineConfig) -> bool:
    """Preempted `max_preemptions` times: given its whole life's pages, never a victim again."""
    return config.max_preemptions is not None and req.num_preemptions >= config.max_preemptions


def prefix_hits(pool: PagePool, req: Request) -> list[int]:
    """The cached pages admitting `req` shares (a swapped one: only those it had computed)."""
    hit = pool.match_prefix(req.all_token_ids, req.page_hashes or None)
    # a page others read must not be written: a swapped request shares only what it computed
    return hit[:req.num_computed_tokens // pool.page_size] if req.status is Status.SWAPPED else hit


class Admission:
    """Admission control (chapter 06): reject_when_full rejects what unclaimed pages can't hold."""
    # unclaimed: the available pages, less those the waiting requests will take

    def __init__(self, pool: PagePool, config: EngineConfig, waiting: deque[Request]) -> None:
        self.pool, self.config, self.waiting = pool, config, waiting
        # (queue and pool state counted in, pages unclaimed, the cached pages the queue's
        # prefix hits claim; None while the count is a lower bound)
        self.unclaimed: tuple[tuple[int, ...], int, set[int] | None] | None = None

    def arrive(self, req: Request) -> bool:
        """Queue an arrival; False, queuing nothing, rejects it."""
        if not self.config.reject_when_full:
            enqueue(self.waiting, req, self.config.preemption)
            return True
        need = self.pages_to_admit(req)
        unclaimed = self.pages_unclaimed(need)
        claimed = self.unclaimed[2]
        if claimed is not None:  # cached pages a waiting request will share: not twice
            claimed = set(claimed)  # a copy: a rejected arrival claims nothing
            need = self.pages_to_admit(req, claimed)
        if need > unclaimed:
            return False
        enqueue(self.waiting, req, self.config.preemption)
        self.unclaimed = (self._state(), unclaimed - need, claimed)
        return True

    def pages_to_admit(self, req: Request, claimed: set[int] | None = None) -> int:
        return self.pool.pages_to_take(prefix_hits(self.pool, req), self.pool.pages_needed(
            self.tokens_to_admit(req)), claimed)

    def tokens_to_admit(self, req: Request) -> int:
        return req.max_total_tokens if is_protected(req, self.config) else req.num_tokens

    def pages_unclaimed(self, need: int) -> int:
        """Available pages the waiting requests leave: a lower bound, exact if short of `need`."""
        state = self._state()  # remembered between arrivals while queue and pool stay as they are
        if self.unclaimed is None or self.unclaimed[0] != state:
            self.unclaimed = (state, self.pool.num_available - sum(
                self.pool.pages_needed(self.tokens_to_admit(r)) for r in self.waiting), None)
        if self.unclaimed[1] < need and self.unclaimed[2] is None:
            claimed: set[int] = set()  # two requests sharing a cached page take it once
            self.unclaimed = (state, self.pool.num_available - sum(
                self.pages_to_admit(r, claimed) for r in self.waiting), claimed)
        return self.unclaimed[1]

    def _state(self) -> tuple[int, ...]:
        return len(self.waiting), self.pool.num_free, self.pool.num_cached


# ------------------------------------------------------------------- what a policy may do
class SchedulerContext:
    """What a policy sees and may do in one step (chapter 03): verbs act at once, swaps after."""

    def __init__(self, waiting: deque[Request], running: list[Request], pool: PagePool,
                 config: EngineConfig, step: int, now: float, free_slots: list[int],
                 tenant_service: Counter | None = None) -> None:
        self.waiting, self.running, self.pool, self.config = waiting, running, pool, config
        # free_slots is kept sorted: a new member takes the lowest
        self.step, self.now, self.free_slots = step, now, free_slots
        self.tenant_service = tenant_service if tenant_service is not None else Counter()
        self.batch = ScheduledBatch()
        self.scheduled_ids: set[str] = set()
        self._swapping_in: dict[str, list[int]] = {}  # id -> host pages of a planned swap-in

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_available

    def pages_to_advance(self, req: Request, num_tokens: int) -> int:
        need = self.pool.pages_needed(req.num_computed_tokens + num_tokens)
        return max(0, need - len(req.page_table))

    def schedule(self, req: Request, num_tokens: int) -> None:
        """Put `req` in this step's batch for `num_tokens` tokens (its pages reserved)."""
        self.batch.items.append((req, num_tokens))
        self.scheduled_ids.add(req.request_id)

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Make sure a running request's pages can hold `num_tokens` more tokens."""
        need = self.pages_to_advance(req, num_tokens)
        if need > self.pool.num_available:
            return False
        req.page_table.extend(self.pool.allocate(need))
        return True

    def admit(self, req: Request, max_tokens: int, min_tokens: int = 1) -> int:
        """Move a waiting request to the running set with a slot, its cached prefix pages and pages
        for a first chunk of at most `max_tokens` (a swapped one's come back from host). Its size,
        or 0, changing nothing, if it does not fit or is under `min_tokens` while more remain."""
        if req not in self.waiting:  # waiting, preempted or swapped
            raise SchedulerError(f"step {self.step}: ctx.admit({req.request_id}): only a request "
                                 f"in the waiting queue can be admitted; it is {req.status.value}")
        if not self.free_slots or max_tokens < 1:
            return 0
        hit = prefix_hits(self.pool, req)
        swapped = req.status is Status.SWAPPED
        start = req.num_computed_tokens if swapped else len(hit) * self.pool.page_size
        num_tokens = min(max_tokens, req.num_tokens - start)
        # a protected request gets its whole life's pages now: it never needs a page again
        whole = req.max_total_tokens if is_protected(req, self.config) else 0
        total_pages = self.pool.pages_needed(max(start + num_tokens, whole))
        if num_tokens < min(min_tokens, req.num_tokens - start) or \
                self.pool.pages_to_take(hit, total_pages) > self.pool.num_available:
            return 0
        self.pool.share(hit)
        req.page_table = hit + self.pool.allocate(total_pages - len(hit))
        if swapped:  # its host pages go back once copied (a swap-out this step must wait)
            self.batch.swap_in.extend(zip(req.swapped_pages[len(hit):], req.page_table[len(hit):]))
            self.batch.swap_release.extend(req.swapped_pages)
            self._swapping_in[req.request_id], req.swapped_pages = req.swapped_pages, []
        else:
            req.num_computed_tokens = start
            if req.status is Status.WAITING and req.num_preemptions == 0:
                req.num_cached_tokens = start
        req.status, req.slot = Status.RUNNING, self.free_slots.pop(0)
        self.waiting.remove(req)
        self.running.append(req)
        return num_tokens

    def preempt(self, req: Request) -> None:
        """Take a running request's pages and requeue it at the front, its K/V swapped to host
        memory (preemption_mode="swap", while there is room) or to be recomputed."""
        if req.status is not Status.RUNNING or req not in self.running:
            raise SchedulerError(f"step {self.step}: ctx.preempt({req.request_id}): only a "
                                 f"running request can be preempted; it is {req.status.value}")
        host_pages = self._swapping_in.pop(req.request_id, None)
        keep = self.pool.pages_needed(req.num_computed_tokens)  # not pages reserved ahead
        # swapped in this step: its host pages stay its own, its fresh pages hold nothing yet
        if host_pages is not None:
            planned = set(host_pages)
            self.batch.swap_in = [(h, p) for h, p in self.batch.swap_in if h not in planned]
            self.batch.swap_release = [h for h in self.batch.swap_release if h not in planned]
            req.swapped_pages = host_pages
        else:
            self.pool.register_prompt_pages(req.prompt_token_ids, req.page_table,
                                            req.num_computed_tokens, req.page_hashes or None)
            if self.config.preemption_mode == "swap" and 0 < keep <= len(self.pool.swap_free):
                req.swapped_pages = self.pool.allocate_swap(keep)
                self.batch.swap_out.extend(zip(req.page_table, req.swapped_pages))
        if req.swapped_pages:
            self.batch.swapped.append(req)
            req.status = Status.SWAPPED
        else:  # its K/V is lost: to be computed again
            req.num_discarded_tokens += req.num_computed_tokens
            self.batch.num_discarded_tokens += req.num_computed_tokens
            req.num_tokens_before_preemption = max(req.num_tokens_before_preemption,
                                                   req.num_computed_tokens)
            req.num_computed_tokens = 0
            req.status = Status.PREEMPTED
        self.pool.release(req.page_table)
        req.page_table = []
        req.num_preemptions += 1
        self.release_slot(req)
        self.running.remove(req)
        enqueue(self.waiting, req, self.config.preemption, preempted=True)
        if req.request_id in self.scheduled_ids:
            self.batch.items = [(r, n) for r, n in self.batch.items if r is not req]
            self.scheduled_ids.discard(req.request_id)
        self.batch.preempted.append(req)

    def release_slot(self, req: Request) -> None:
        """Give back a request's slot (static batching holds finished ones to batch end)."""
        if req.slot is not None:
            bisect.insort(self.free_slots, req.slot)
            req.slot = None

    def pick_victim(self, current: Request) -> Request:
        """Whom to preempt for `current`: the unscheduled, unprotected request ranking last."""
        candidates = [r for r in self.running if not is_protected(r, self.config) and (
            r.request_id not in self.scheduled_ids or r is current)]
        return max(candidates or [current],
                   key=queue_rank(self.config.preemption, self.tenant_service))

    def reserve_or_preempt(self, req: Request, num_tokens: int) -> bool:
        """Reserve pages for `req`, preempting others (possibly `req` itself) until it fits."""
        while not self.reserve(req, num_tokens):
            victim = self.pick_victim(req)
            self.preempt(victim)
            if victim is req:
                return False
        return True


def check_batch(batch: object, ctx: SchedulerContext, requests: dict[str, Request],
                whole_prompts: bool) -> None:
    """SchedulerError naming the step, the request and the rule for an impossible batch."""
    step, cfg = ctx.step, ctx.config
    if batch is not ctx.batch:
        got = "another ScheduledBatch" if isinstance(batch, ScheduledBatch) \
            else type(batch).__name__
        raise SchedulerError(f"step {step}: schedule() must return ctx.batch, the batch that "
                             f"ctx.schedule and ctx.preempt fill; got {got}")
    seen: set[str] = set()
    for item in batch.items:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], Request)):
            raise SchedulerError(f"step {step}: batch item {item!r:.60} is not a (request, "
                                 f"number of tokens) pair: add members with ctx.schedule")
        req, n = item
        rule = _broken_rule(req, n, ctx, requests, seen)
        if rule:
            raise SchedulerError(f"step {step}, request {req.request_id!r}: {rule}")
        seen.add(req.request_id)
    if any(not isinstance(r, Request) or requests.get(r.request_id) is not r for r in batch.idle):
        raise SchedulerError(f"step {step}: an idle member is not a request of this engine")
    members = len(batch.items) + len(batch.idle)
    if members > cfg.max_num_seqs:
        idle = f" ({len(batch.idle)} of them idle)" if batch.idle else ""
        raise SchedulerError(f"step {step}: {members} members{idle} exceed "
                             f"max_num_seqs={cfg.max_num_seqs}")
    if not whole_prompts and batch.num_tokens > cfg.max_num_batched_tokens:
        raise SchedulerError(f"step {step}: {batch.num_tokens} tokens exceed "
                             f"max_num_batched_tokens={cfg.max_num_batched_tokens}")
    for req, n in batch.items:  # after the budget, which a long whole prompt hears of first
        if not whole_prompts and req.is_prefill and n > cfg.chunk_size:
            raise SchedulerError(f"step {step}, request {req.request_id!r}: a prefill chunk of "
                                 f"{n} tokens exceeds chunk_size={cfg.chunk_size}")


def _broken_rule(req: Request, n: object, ctx: SchedulerContext, requests: dict[str, Request],
                 seen: set[str]) -> str | None:
    if requests.get(req.request_id) is not req:
        return "unknown request (not added to this engine)"
    if req.is_finished:
        return f"request already finished ({req.finish_reason})"
    if req.status is not Status.RUNNING:
        return f"request is {req.status.value}, not running (admit it with ctx.admit first)"
    if req.request_id in seen:
        return "scheduled twice in one step"
    if not is_int(n) or not 1 <= n <= req.num_remaining:
        return f"asks to advance {n!r} tokens but has {req.num_remaining} left to compute"
    if ctx.pages_to_advance(req, n):
        return (f"{n} tokens need more pages than its page table holds "
                f"({len(req.page_table)}); reserve them first")
    return None


# the building blocks every policy may use (chapters 03-05), also methods of `Scheduler`
def decoding(ctx: SchedulerContext) -> list[Request]:
    """The running requests whose prompt is in the cache."""
    return [r for r in ctx.running if not r.is_prefill]


def prefilling(ctx: SchedulerContext) -> list[Request]:
    """The running requests still computing (or recomputing) their prompt."""
    return [r for r in ctx.running if r.is_prefill]


def schedule_decodes(ctx: SchedulerContext) -> int:
    """One token for every running decode, preempting when pages run out; how many."""
    count = 0
    for req in Scheduler.decoding(ctx):
        if req.status is Status.RUNNING and ctx.reserve_or_preempt(req, 1):
            ctx.schedule(req, 1)
            count += 1
    return count


def schedule_prefill_chunks(ctx: SchedulerContext, budget: int, min_chunk: int = 1) -> int:
    """Spend `budget` on prefill chunks (chapter 04; pd calls it after its decodes, chapter
    05): first the prompts already being prefilled, then new ones from the front of the queue.
    Returns the budget left."""
    chunk_size = ctx.config.chunk_size
    stuck = []  # running prompts whose next chunk has no pages
    for req in Scheduler.prefilling(ctx):
        if req.request_id in ctx.scheduled_ids or req.status is not Status.RUNNING:
            continue
        num_tokens = min(req.num_remaining, chunk_size, budget)
        if num_tokens < min(min_chunk, req.num_remaining):
            continue
        if not ctx.reserve(req, num_tokens):
            stuck.append((req, num_tokens))
            continue
        ctx.schedule(req, num_tokens)
        budget -= num_tokens
    if stuck and not ctx.batch.items and not Scheduler.decoding(ctx):
        # half-prefilled prompts hold every page and each waits for another's: nothing would
        # ever run again. Free pages by preemption (the victim by the queue's rank, which may
        # be this prompt itself) so that one of them can go on.
        req, num_tokens = stuck[0]
        if ctx.reserve_or_preempt(req, num_tokens):
            ctx.schedule(req, num_tokens)
            budget -= num_tokens
    while ctx.waiting and budget > 0 and not ctx.batch.preempted:
        req = ctx.waiting[0]
        num_tokens = ctx.admit(req, min(chunk_size, budget), min_tokens=min_chunk)
        if not num_tokens:
            break
        ctx.schedule(req, num_tokens)
        budget -= num_tokens
    return budget


# the class attributes of `Scheduler` that the engine reads (a wrapper must pass them on)
POLICY_FLAGS = ("whole_prompts", "holds_finished_slots", "waits_for_batch_timeout",
                "decodes_every_step")


class Scheduler:
    """Base class of every policy, the learner's too (chapter 03): `schedule` fills `ctx.batch`;
    the class flags tell the engine what it does. One instance per engine: it may keep state."""

    name = "base"
    # prompts are prefilled whole (chapters 01-03): one long prompt may exceed the token budget
    whole_prompts = False
    holds_finished_slots = False  # a finished request keeps its slot until ctx.release_slot
    # with batch_timeout in seconds, empty steps while requests wait are not a stall (chapter 02)
    waits_for_batch_timeout = False
    decodes_every_step = False  # every running decode advances every step (the invariant check)

    def schedule(self, ctx: SchedulerContext) -> ScheduledBatch:
        raise NotImplementedError

    def release(self, req: Request) -> list[Request]:
        """`req` has finished: the responses that reach their users now (chapter 02)."""
        return [req]

    decoding = staticmethod(decoding)
    prefilling = staticmethod(prefilling)
    schedule_decodes = staticmethod(schedule_decodes)
    schedule_prefill_chunks = staticmethod(schedule_prefill_chunks)


class SingleScheduler(Scheduler):
    """v1 (chapter 01): one request at a time; the next starts when it finishes."""

    name = "single"
    whole_prompts = True

    def schedule(self, ctx: SchedulerContext) -> ScheduledBatch:
        if not ctx.running and ctx.waiting:
            req = ctx.waiting[0]
            if ctx.admit(req, req.num_tokens):  # whole: what it admits is what remains
                ctx.schedule(req, req.num_remaining)
            return ctx.batch
        for req in list(ctx.running):
            if req.status is Status.RUNNING and ctx.reserve_or_preempt(req, req.num_remaining):
                ctx.schedule(req, req.num_remaining)
        return ctx.batch


class StaticScheduler(Scheduler):
    """Static batching (chapter 02): a batch starts together and ends with its slowest member."""

    name = "static"
    whole_prompts = True
    holds_finished_slots = True

    def __init__(self) -> None:
        self.batch: list[Request] = []
        self.held: list[Request] = []  # members done, their responses held until batch end

    def ready_to_form(self, ctx: SchedulerContext) -> bool:
        return bool(ctx.waiting)

    def batch_done(self) -> bool:
        return all(r.is_finished for r in self.batch)

    def release(self, req: Request) -> list[Request]:
        """A completed member is held until the batch's last member leaves."""
        out = [req]
        if req.finish_reason in ("stop", "length"):
            req.returned_whole = True
            self.held.append(req)
            out = []
        if self.held and self.batch_done():
            out, self.held = out + self.held, []
        return out

    def choose_batch(self, ctx: SchedulerContext) -> list[Request]:
        """The waiting requests a new batch admits in order (exercise 2.1's hook)."""
        return list(ctx.waiting)[:ctx.config.max_num_seqs]

    def schedule(self, ctx: SchedulerContext) -> ScheduledBatch:
        if self.batch and self.batch_done():
            for req in self.batch:
                ctx.release_slot(req)
            self.batch = []
        if not self.batch:
            if not self.ready_to_form(ctx):
                return ctx.batch
            for req in self.choose_batch(ctx):
                if not ctx.admit(req, req.num_tokens):
                    break
                self.batch.append(req)
                ctx.schedule(req, req.num_remaining)
            return ctx.batch
        for req in self.batch:
            if req.is_finished:
                ctx.batch.idle.append(req)
            elif req.status is not Status.RUNNING:  # preempted earlier: rejoin when it fits
                if ctx.admit(req, req.num_tokens):
                    ctx.schedule(req, req.num_remaining)
            elif ctx.reserve_or_preempt(req, req.num_remaining):
                ctx.schedule(req, req.num_remaining)
        return ctx.batch


class DynamicScheduler(StaticScheduler):
    """Dynamic batching (chapter 02): a static batch, formed once full or after `batch_timeout`."""

    name = "dynamic"
    waits_for_batch_timeout = True

    def ready_to_form(self, ctx: SchedulerContext) -> bool:
        if not ctx.waiting or len(ctx.waiting) >= ctx.config.max_num_seqs:
            return bool(ctx.waiting)
        # the oldest waiting request's age, counted from its arrival
        if ctx.config.batch_timeout_in_seconds:
            age = ctx.now - min(r.metrics.arrival_time for r in ctx.waiting)
        else:
            age = ctx.step - min(r.metrics.arrival_step for r in ctx.waiting)
        return age >= ctx.config.batch_timeout


class ContinuousScheduler(Scheduler):
    """Continuous batching (chapter 03): each step every decode advances one token and whole
    prompts join while slots, pages and budget allow (the first always: chapter 04's problem)."""

    name = "continuous"
    whole_prompts = True

    def schedule(self, ctx: SchedulerContext) -> ScheduledBatch:
        self.schedule_decodes(ctx)
        prefill_tokens = 0
        while ctx.waiting and not ctx.batch.preempted:
            req = ctx.waiting[0]
            over_budget = prefill_tokens + req.num_tokens > ctx.config.max_num_batched_tokens
            if prefill_tokens and over_budget:  # the first prompt joins whatever its length
                break
            if not ctx.admit(req, req.num_tokens):
                break
            ctx.schedule(req, req.num_remaining)
            prefill_tokens += req.num_remaining
        return ctx.batch


class ChunkedScheduler(Scheduler):
    """Chunked prefill, prefill-first (chapter 04): decodes wait while prompt chunks can run."""

    name = "chunked"

    def schedule(self, ctx: SchedulerContext) -> ScheduledBatch:
        schedule_prefill_chunks(ctx, ctx.config.max_num_batched_tokens)
        if not ctx.batch.items:  # decodes only in a step with no prefill work: budget unused
            self.schedule_decodes(ctx)
        return ctx.batch


class PDScheduler(Scheduler):
    """PD interleaving (chapter 05), the chapter's pseudo-code: every running decode gets one
    token first; what is left of `max_num_batched_tokens` goes to prefill chunks; a chunk
    smaller than `min_chunk` is deferred to a later step."""

    name = "pd"
    decodes_every_step = True

    def schedule(self, ctx: SchedulerContext) -> ScheduledBatch:
        budget = ctx.config.max_num_batched_tokens
        budget -= self.schedule_decodes(ctx)
        schedule_prefill_chunks(ctx, budget, min_chunk=ctx.config.min_chunk)
        return ctx.batch


POLICY_CLASSES: dict[str, type[Scheduler]] = {cls.name: cls for cls in (
    SingleScheduler, StaticScheduler, DynamicScheduler, ContinuousScheduler, ChunkedScheduler,
    PDScheduler)}


def make_scheduler(policy: str | Scheduler) -> Scheduler:
    """A fresh scheduler for a policy name, or the learner's own `Scheduler` instance."""
    if isinstance(policy, Scheduler):
        return policy
    if isinstance(policy, str):
        return POLICY_CLASSES[policy]()
    lacks = [n for n in ("schedule", "release", *POLICY_FLAGS) if not hasattr(policy, n)]
    raise SchedulerError(f"policy {type(policy).__name__} is not a Scheduler"
                         + (f" (it lacks {', '.join(lacks)})" if lacks else "")
                         + ": subclass minicb.Scheduler and implement schedule(ctx)")
