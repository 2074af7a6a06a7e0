"""The engine loop (chapter 03): `Engine.step()` runs one iteration as named phases, each one
call: housekeeping, schedule, forward and sample (the runner), account, reclaim, record.
A request goes `add_request` -> `pending` -> `waiting` -> (the policy admits it) `running`
-> `_finish`, which gives everything back."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import math
import time
import weakref
from collections import Counter, deque

from minicb.config import EngineConfig, is_finite_number, is_int, is_positive_int
from minicb.kv_cache import prompt_page_hashes
from minicb.request import Request, RequestOutput, SamplingParams, Status
from minicb.runner import ModelRunner
from minicb.sampler import make_generator
from minicb.scheduler import (
    Admission,
    ScheduledBatch,
    Scheduler,
    SchedulerContext,
    SchedulerError,
    check_batch,
    make_scheduler,
    reorder,
)
from minicb.speculative import Speculator
from minicb.trace import Member, StepRecord, record_step

# steps in a row in which no request gains a new token while work waits: a stalled policy, or
# preemptions that throw away all they compute (docs/reliability.md)
STALL_STEPS = 100_000
MAX_ARRIVAL_DELAY = 86_400.0  # seconds: on the real clock, arrivals at most a day ahead

__all__ = ["Engine", "InvariantError", "SchedulerError", "STALL_STEPS"]


class InvariantError(AssertionError):
    """An engine invariant broke: the message names the step, the request and the rule."""


# scheduler instances engines were built with, by id (a learner's class need not be hashable)
_BOUND_SCHEDULERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _bind(scheduler: Scheduler) -> None:
    """Refuse a scheduler instance another engine holds: a policy may keep state."""
    if _BOUND_SCHEDULERS.get(id(scheduler)) is scheduler:
        cls = type(scheduler).__name__
        raise ValueError(f"this {cls} instance already belongs to another Engine and may hold "
                         f"its state; give each engine a fresh one: policy={cls}()")
    with contextlib.suppress(TypeError):  # an object without weak references goes unguarded
        _BOUND_SCHEDULERS[id(scheduler)] = scheduler


class Engine:
    """The scheduler, the runner (model and page pool), the queues and the trace (chapter 03)."""

    def __init__(self, model="smollm2-135m", config: EngineConfig | None = None,
                 clock=None, **options) -> None:
        """`model`: a bundled name, a checkpoint directory or a loaded `(model, info)` pair."""
        if config is not None and set(options) - {"policy"}:
            raise ValueError("pass either an EngineConfig or keyword options, not both")
        config = dataclasses.replace(config, **options) if config \
            else EngineConfig.from_kwargs(**options)
        self.scheduler = make_scheduler(config.policy)
        _bind(self.scheduler)
        self._now = clock or time.perf_counter
        self._sleep = getattr(clock, "sleep", time.sleep)  # a simulated clock jumps instead
        self.runner = ModelRunner(model, config, self._now)
        self.config, self.pool, self.info = self.runner.config, self.runner.pool, self.runner.info
        self.model, self.tokenizer = self.runner.model, self.info.tokenizer
        self.attention_backend = self.runner.attention_backend
        self.max_model_len = self.info.config.max_position_embeddings
        self.requests: dict[str, Request] = {}
        self.pending: list[Request] = []  # added, arrival step/time not reached yet
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(self.config.max_num_seqs))
        self.trace: list[StepRecord] = []
        self.step_count = 0
        self.t0 = self._now()
        self.tenant_service: Counter[str | None] = Counter()  # new tokens computed per tenant
        self.admission = Admission(self.pool, self.config, self.waiting)
        self.speculator = Speculator(self.config, self.pool)
        self._finished_between_steps: list[str] = []  # cancelled, expired, rejected
        self._arrived_since_last_step: list[str] = []  # added between steps, arriving at once
        self._ids = itertools.count()
        self._seq = itertools.count()  # arrival order (Request.seq_index), even after `forget`
        self._num_with_deadline = 0  # none: no step scans the queues for expiry
        self._steps_without_progress = 0
        self._failure_hook = None  # tests inject faults here: callable(items) raising

    @property
    def waits_on_clock(self) -> bool:
        """Dynamic batching by seconds: empty steps are its timeout running (chapter 02)."""
        return self.config.batch_timeout_in_seconds and self.scheduler.waits_for_batch_timeout

    @property
    def stall_limit(self) -> int:
        """Steps in a row without progress that make a stall (plus dynamic batching's wait)."""
        waits = self.scheduler.waits_for_batch_timeout and not self.config.batch_timeout_in_seconds
        return STALL_STEPS + (int(self.config.batch_timeout) if waits else 0)

    def clock(self) -> float:  # seconds since the engine started
        return self._now() - self.t0

    # ------------------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids: a list as given, a text through the tokenizer."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass token ids, not a string")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: no tokenizer can take it
                raise ValueError(f"prompt is not valid text ({exc.reason} at character "
                                 f"{exc.start}): {prompt!r:.80}") from None
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)) \
                if prompt else []
        if not isinstance(prompt, (list, tuple)) or any(not is_int(t) for t in prompt):
            raise ValueError(f"prompt must be a string or a list of token ids, got {prompt!r:.80}")
        return list(prompt)

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids if this engine can ever run it, else ValueError naming why."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.info.config.vocab_size
        for name, ids in (("prompt token ids", token_ids),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} must be in [0, {vocab}), got {bad[:5]}")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens})"
                             f" = {total} exceeds the model's context of {self.max_model_len}")
        capacity = self.pool.num_pages * self.pool.page_size
        if total > capacity:
            raise ValueError(f"prompt + max_tokens = {total} tokens can never fit in the page "
                             f"pool ({self.pool.num_pages} pages x {self.pool.page_size} = "
                             f"{capacity} tokens); raise num_pages or lower max_tokens")
        return token_ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_step: int | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    deadline: float | None = None, tenant: str | None = None) -> str:
        """Queue a request to arrive now, at `arrival_step` or at `arrival_time`; returns its id."""
        # arrival_time: engine-clock seconds; deadline: seconds after arrival to finish in;
        # tenant: who sent it (chapter 06). Bad input: ValueError, nothing changed
        params = params or SamplingParams()
        token_ids = self.check_request(prompt, params)
        if request_id is None:  # the next free one: a caller may have taken "req-3" by hand
            request_id = next(r for r in (f"req-{i}" for i in self._ids) if r not in self.requests)
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # the real clock sleeps until an arrival; a simulated one jumps
        latest = self.clock() + MAX_ARRIVAL_DELAY if self._sleep is time.sleep else math.inf
        for name, value, ok, what in (
                ("arrival_step", arrival_step, is_positive_int, "an integer >= 1"),
                ("arrival_time", arrival_time, lambda t: is_finite_number(t) and 0 <= t <= latest,
                 f"a finite number >= 0 seconds, at most {MAX_ARRIVAL_DELAY:.0f} past the "
                 f"engine's clock (now {self.clock():.1f})"),
                ("deadline", deadline, lambda d: is_finite_number(d) and d > 0,
                 "a finite number of seconds > 0 or None"),
                ("tenant", tenant, lambda t: isinstance(t, str), "a string or None")):
            if value is not None and not ok(value):
                raise ValueError(f"{name} must be {what}, got {value!r}")
        if not is_int(priority):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        req = Request(request_id, token_ids, params, priority=priority,
                      arrives_at_step=arrival_step, arrives_at_time=arrival_time,
                      eos_token_ids=tuple(self.info.eos_token_ids), deadline=deadline,
                      tenant=tenant, generator=make_generator(params.seed))
        if self.pool.prefix is not None:  # hashed once; admission and reclaim reuse them
            req.page_hashes = prompt_page_hashes(token_ids, self.pool.page_size)
        self.requests[request_id] = req
        self.pending.append(req)
        self._num_with_deadline += deadline is not None
        if arrival_step is None and arrival_time is None:
            self._arrive(req, self.step_count + 1)  # between steps: the next one
            self._arrived_since_last_step.append(request_id)
        return request_id

    def _arrive(self, req: Request, step: int) -> None:
        """From `pending` into the waiting queue (or rejected, chapter 06) at `step`."""
        self.pending.remove(req)
        req.seq_index = next(self._seq)  # "newest" and first-come ties go by arrival, not by add
        req.metrics.arrival_step = max(req.arrives_at_step or step, step)
        req.metrics.arrival_time = self.clock() if req.arrives_at_time is None \
            else req.arrives_at_time
        if not self.admission.arrive(req):
            # its step's record lists it as finished
            self._finished_between_steps.append(self._finish(req, "rejected"))

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Finish an unfinished request now, its pages back; "stop": a caller's stop string."""
        if reason not in ("cancelled", "stop"):
            raise ValueError(f"reason must be 'cancelled' or 'stop', got {reason!r}")
        req = self._known(request_id, "cancel")
        if not req.is_finished:  # the next record lists it
            self._finished_between_steps.append(self._finish(req, reason))

    def stop_at(self, request_id: str, num_output_tokens: int) -> None:
        """A caller's stop string ended the request after `num_output_tokens` tokens."""
        req = self._known(request_id, "stop")
        n = len(req.output_token_ids)
        if not is_int(num_output_tokens) or not 0 < num_output_tokens <= n:
            raise ValueError(f"num_output_tokens must be 1..{n}, got {num_output_tokens}")
        # later tokens of the same step (kept guesses, chapter 08) go too
        for kept in (req.output_token_ids, req.output_logprobs, req.metrics.token_times,
                     req.metrics.token_steps):
            del kept[num_output_tokens:]
        if not req.is_finished:
            self.cancel(request_id, reason="stop")
        elif req.finish_reason == "length":  # its last token: say what the caller got
            req.finish_reason = "stop"

    def _known(self, request_id: str, verb: str) -> Request:
        req = self.requests.get(str(request_id))
        if req is None:
            raise ValueError(f"cannot {verb} unknown request_id {request_id!r}")
        return req

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record and service, bounding a server's memory."""
        request_id = str(request_id)
        req = self.requests.get(request_id)
        if req is None:
            return
        if not req.is_finished:
            raise ValueError(f"request {request_id!r} is not finished; cancel it first")
        # in place, dropping a tenant at 0: bounded by the tenants still remembered
        self.tenant_service -= Counter({req.tenant: req.num_service_tokens})
        del self.requests[request_id]
        for pending_ids in (self._finished_between_steps, self._arrived_since_last_step):
            pending_ids[:] = [i for i in pending_ids if i != request_id]  # not in the next record

    def has_unfinished(self) -> bool:
        return bool(self.pending or self.waiting or self.running)

    # ------------------------------------------------------------------------------ the step
    def step(self) -> StepRecord:
        """One iteration (chapter 03), phase by phase. Returns its record."""
        arrived, t_start = self._housekeeping()
        evicted = self.pool.num_evicted
        batch, (swapped_out, swapped_in) = self._schedule(t_start)
        drafts = self.speculator.propose(batch)  # guesses ride along decodes (chapter 08)
        items, members = self._members(batch, drafts, t_start)
        finished: list[str] = []
        try:  # a fault (a GPU out of memory) fails this step's members, nobody else
            if self._failure_hook is not None:
                self._failure_hook(items)
            to_sample, logits, t_forward = self.runner.forward(items, drafts)
            tokens = self.runner.sample(to_sample, logits, drafts)
        except Exception as exc:  # noqa: BLE001 - the members carry the error to their users
            finished, items, to_sample, tokens, t_forward = self._fail(items, exc), [], [], [], 0.
        delivered = self._append(to_sample, tokens)
        gained, recomputed = self._account(items, drafts, delivered)
        finished += self._reclaim(items)
        record = record_step(
            self.step_count, members, batch, self.pool, self.waiting, self.running,
            self.config.trace_snapshots, finished=finished + self._finished_between_steps,
            arrived=arrived, sampled=list(delivered), t_start=t_start, t_end=self.clock(),
            t_forward=t_forward, pages_evicted=self.pool.num_evicted - evicted,
            pages_swapped_out=swapped_out, pages_swapped_in=swapped_in,
            speculated=self.speculator.kept(drafts, delivered), tokens_recomputed=recomputed)
        return self._record(record, gained)

    def _housekeeping(self) -> tuple[list[str], float]:
        """Count the step, let arrivals join, expire deadlines, re-sort (chapters 02, 06)."""
        self._skip_idle_time()
        self.step_count += 1
        now = self.clock()
        arrived = [r for r in self.pending
                   if (r.arrives_at_step is None or r.arrives_at_step <= self.step_count)
                   and (r.arrives_at_time is None or r.arrives_at_time <= now)]
        # stable: requests arriving together keep the order they were added in
        arrived.sort(key=lambda r: (r.arrives_at_time or 0.0, r.arrives_at_step or 0))
        for req in arrived:
            self._arrive(req, self.step_count)
        arrived_ids = self._arrived_since_last_step + [r.request_id for r in arrived]
        self._arrived_since_last_step = []
        t_start = self.clock()  # after arrivals: nobody is scheduled before they arrived
        for req in [*self.waiting, *self.running] if self._num_with_deadline else ():
            if req.deadline_time <= t_start:  # its pages come back now
                self._finished_between_steps.append(self._finish(req, "deadline"))
        reorder(self.waiting, self.config, self.step_count, self.tenant_service)
        return arrived_ids, t_start

    def _skip_idle_time(self) -> None:
        """Nothing to run: jump the step counter, or sleep, to the next arrival."""
        if self.running or self.waiting or not self.pending:
            return
        steps = [r.arrives_at_step for r in self.pending if r.arrives_at_step is not None]
        times = [r.arrives_at_time for r in self.pending if r.arrives_at_time is not None]
        if steps and len(steps) == len(self.pending):
            self.step_count = max(self.step_count, min(steps) - 1)
        if times and min(times) > self.clock():
            self._sleep(min(times) - self.clock())

    def _schedule(self, now: float) -> tuple[ScheduledBatch, tuple[int, int]]:
        """The policy picks, the swap copies it planned run (even if it raised), it is checked."""
        ctx = SchedulerContext(self.waiting, self.running, self.pool, self.config,
                               self.step_count, now, self.free_slots, self.tenant_service)
        try:
            batch = self.scheduler.schedule(ctx)
        finally:  # even if the policy raised: else a victim's K/V is lost
            self.admission.unclaimed = None  # queue and pool changed: count again
            copied = self.runner.copy_pages(ctx.batch)
        check_batch(batch, ctx, self.requests, self.scheduler.whole_prompts)
        return batch, copied

    def _members(self, batch: ScheduledBatch, drafts: dict[str, list[int]], now: float
                 ) -> tuple[list[tuple[Request, int]], list[Member]]:
        """The members as the forward takes them (one-token rows first) and what each does."""
        # a decode with guesses is a chunk; one-token rows first, as the attention metadata expects
        items = sorted(((r, n + len(drafts.get(r.request_id, ()))) for r, n in batch.items),
                       key=lambda item: item[1] != 1)
        for req, _ in items:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.metrics.first_scheduled_step = self.step_count
        return items, [Member(r.request_id, "prefill" if r.is_prefill else "decode", n, r.slot,
                              r.num_computed_tokens) for r, n in items]

    def _fail(self, items: list[tuple[Request, int]], exc: Exception) -> list[str]:
        for req, _ in items:
            req.error = f"{type(exc).__name__}: {exc}"
        return [self._finish(req, "error") for req, _ in items]

    def _append(self, reqs: list[Request], tokens: list[list[int]]) -> dict[str, int]:
        """Append new tokens up to the first that ends the request; how many each got."""
        now, delivered = self.clock(), {}
        for req, new_tokens in zip(reqs, tokens):
            before = len(req.output_token_ids)
            for token in new_tokens:
                req.output_token_ids.append(token)
                if req.token_counts is not None:
                    req.token_counts.add(token)
                req.metrics.token_times.append(now)
                req.metrics.token_steps.append(self.step_count)
                if token in req.stop_tokens or \
                        len(req.output_token_ids) >= req.params.max_tokens:
                    break
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time, req.metrics.first_token_step = now, self.step_count
            delivered[req.request_id] = len(req.output_token_ids) - before
        return delivered

    def _account(self, items: list[tuple[Request, int]], drafts: dict[str, list[int]],
                 delivered: dict[str, int]) -> tuple[int, int]:
        """Members' tokens now cached, tenants' service, shareable prompt pages: (new, redone)."""
        gained = recomputed = 0
        for req, n in items:
            start, advanced = req.num_computed_tokens, delivered.get(req.request_id, 1) \
                if req.request_id in drafts else n
            new = req.advance(advanced)
            self.tenant_service[req.tenant] += new  # not recomputed work (docs/reliability.md)
            gained, recomputed = gained + new, recomputed + advanced - new
            if start < req.num_prompt_tokens:  # a chunk of the prompt (or crossing its end)
                self.pool.register_prompt_pages(req.prompt_token_ids, req.page_table,
                                                req.num_computed_tokens, req.page_hashes)
        return gained, recomputed

    def _reclaim(self, items: list[tuple[Request, int]]) -> list[str]:
        ended = [(req, req.stop_reason()) for req, _ in items if not req.is_finished]
        return [self._finish(req, reason) for req, reason in ended if reason]

    def _record(self, record: StepRecord, gained: int) -> StepRecord:
        """Trace the step (not dynamic batching's wait, chapter 02) and run the checks."""
        self._finished_between_steps = []
        if self.waits_on_clock and not (record.members or record.finished or record.arrived
                                        or record.preempted):
            self.step_count -= 1  # no step ran: the next reuses its number
        else:
            self.trace.append(record)
            if self.config.check_invariants:
                self.check_invariants(record)
        self._check_progress(record, gained)
        return record

    def _finish(self, req: Request, reason: str) -> str:
        """Leave the engine from any state, giving back its pages, slot and response; its id."""
        was_running = req.status is Status.RUNNING
        if req.page_table:
            self.pool.register_prompt_pages(req.prompt_token_ids, req.page_table,
                                            req.num_computed_tokens, req.page_hashes)
            self.pool.release(req.page_table)
        self.pool.release_swap(req.swapped_pages)  # cancelled or expired while swapped out
        req.page_table, req.swapped_pages = [], []
        for queue in (self.running, self.waiting, self.pending):
            if req in queue:
                queue.remove(req)
        if req.slot is not None and not (was_running and self.scheduler.holds_finished_slots):
            bisect.insort(self.free_slots, req.slot)
            req.slot = None
        req.status, req.finish_reason = Status.FINISHED, reason
        self._num_with_deadline -= req.deadline is not None
        # a few tuples per token, two vocabulary rows: not kept for every finished request
        req.ngram_index = req.token_counts = None
        req.metrics.finish_time, req.metrics.finish_step = self.clock(), self.step_count
        for done in self.scheduler.release(req):  # E2E latency ends here (chapter 02)
            done.metrics.released_time = req.metrics.finish_time
            done.metrics.released_step = self.step_count
        return req.request_id

    # ------------------------------------------------------------------------------ checks
    def _check_progress(self, record: StepRecord, gained: int) -> None:
        """Raise after `stall_limit` steps in a row that gain no token while work waits."""
        if gained or record.finished or not (self.waiting or self.running):
            self._steps_without_progress = 0
            return
        if self.waits_on_clock and not record.members:
            self._sleep(0.001)
            return
        self._steps_without_progress += 1
        if self._steps_without_progress > self.stall_limit:
            stuck = [r.request_id for r in (*self.waiting, *self.running)][:5]
            self._steps_without_progress = 0
            did = ("computed only tokens it had computed before (each preempted before it "
                   "regained what it lost)" if record.members else "scheduled nothing")
            raise RuntimeError(f"policy {self.scheduler.name!r} {did} for {self.stall_limit} steps"
                               f" in a row while requests wait or run: {stuck}; check its settings")

    def check_invariants(self, record: StepRecord | None = None) -> None:
        """Raise InvariantError naming the step, request and rule if the books do not balance."""
        step = self.step_count
        try:
            self.pool.check([r.page_table for r in self.running],
                            [r.swapped_pages for r in self.waiting])
        except AssertionError as exc:
            raise InvariantError(f"step {step}: page pool: {exc}") from None
        queued = Counter(r.request_id for r in (*self.pending, *self.waiting, *self.running))
        for rid, req in self.requests.items():
            status, n = req.status.value, queued[rid]
            broken = ("is in two queues" if n > 1 else
                      "is finished but still queued" if n and req.is_finished else
                      f"is lost (status {status}, in no queue)" if not n and not req.is_finished
                      else f"holds pages while {status}" if req.page_table and
                      req.status is not Status.RUNNING else
                      f"is {status} with {len(req.swapped_pages)} swap pages"
                      if (req.status is Status.SWAPPED) != bool(req.swapped_pages) else None)
            if broken:
                raise InvariantError(f"step {step}: request {rid!r} {broken}")
        slots = [r.slot for r in self.running]
        if len(set(slots)) != len(slots) or None in slots:
            raise InvariantError(f"step {step}: running requests share or lack slots: {slots}")
        if record is not None and self.scheduler.decodes_every_step:
            scheduled = {m.request_id for m in record.members}
            skipped = [r.request_id for r in self.running if r.request_id not in scheduled
                       and not r.is_prefill and r.metrics.first_token_step is not None
                       and r.metrics.first_token_step < step and r.num_preemptions == 0]
            if skipped:
                raise InvariantError(f"step {step}: policy {self.scheduler.name!r} "
                                     f"(decodes_every_step) left running decodes out: {skipped}")

    # ------------------------------------------------------------------------------ results
    def stats(self) -> dict[str, int]:
        """Page, swap and queue counts now (`num_waiting` includes arrivals still ahead)."""
        out = {"pages_total": self.pool.num_pages, "pages_free": self.pool.num_free,
               "pages_cached": self.pool.num_cached, "pages_used": self.pool.num_used,
               "num_waiting": len(self.waiting) + len(self.pending),
               "num_running": len(self.running)}
        if self.pool.num_swap_pages:
            out.update(swap_pages_total=self.pool.num_swap_pages,
                       swap_pages_free=len(self.pool.swap_free))
        return out

    def output(self, request_id: str) -> RequestOutput:
        req = self.requests[request_id]
        text = None if self.tokenizer is None else \
            self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        return RequestOutput(req.request_id, list(req.prompt_token_ids),
                             list(req.output_token_ids), text, req.finish_reason,
                             req.num_cached_tokens, req.metrics, req.error, req.num_preemptions,
                             None if req.params.logprobs is None else list(req.output_logprobs))

    def run(self, max_steps: int | None = None) -> list[RequestOutput]:
        """Step until all have finished (or `max_steps`); the outputs of those unfinished."""
        todo = [rid for rid, r in self.requests.items() if not r.is_finished]
        steps = 0
        while self.has_unfinished() and (max_steps is None or steps < max_steps):
            self.step()  # raises if the policy makes no progress (_check_progress)
            steps += 1
        return [self.output(rid) for rid in todo]

