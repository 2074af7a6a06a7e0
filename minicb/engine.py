"""The engine loop (chapter 03): `Engine.step()` runs the four phases of one iteration

    1. schedule   the policy picks who advances and by how many tokens (may preempt, and
                  swapped K/V is copied out and in before the forward)
    2. forward    every member is flattened into one token batch and the model runs once
    3. sample     one token for each member whose prompt is now fully in the cache
    4. reclaim    finished requests leave; their pages and slots go back

after the queue's housekeeping (arrivals join, expired deadlines leave, time-dependent orders
re-sort: chapters 02 and 06), and appends a `StepRecord` to `engine.trace`. Follow one
request's whole life from here."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import time
import warnings
import weakref
from collections import Counter, deque

import torch

from minicb.attention import build_metadata, int_tensor, resolve_backend
from minicb.config import (
    EngineConfig,
    is_finite_number,
    is_int,
    is_positive_int,
    resolve_device,
    torch_dtype,
)
from minicb.kv_cache import PagePool, page_bytes, prompt_page_hashes
from minicb.request import Request, RequestOutput, SamplingParams, Status
from minicb.sampler import TokenCounts, make_generator, sample, top_logprobs
from minicb.scheduler import (
    ScheduledBatch,
    Scheduler,
    SchedulerContext,
    SchedulerError,
    enqueue,
    make_scheduler,
    prefix_hits,
    queue_rank,
)
from minicb.speculative import NgramIndex, verify
from minicb.trace import Member, RequestRecord, StepRecord

STALL_STEPS = 100_000  # steps in a row with nothing scheduled while work waits: a stalled policy


class InvariantError(AssertionError):
    """An engine invariant broke: the message names the step, the request and the rule."""


def default_num_pages(model_config, config: EngineConfig, dtype: torch.dtype) -> int:
    """1024 pages on the CPU; on CUDA, what `gpu_memory_utilization` of the free memory holds
    once the weights are loaded (as vLLM sizes its KV cache), but no more than every slot at
    the model's longest context needs (chapter 07)."""
    if not str(config.device).startswith("cuda"):
        return 1024
    # an earlier engine's pool, dropped, still sits in torch's cache, which the driver counts
    # as used: each engine made in turn in one process would get a tenth of the one before
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(torch.device(config.device))
    per_page = page_bytes(model_config.num_layers, config.page_size, model_config.num_kv_heads,
                          model_config.head_dim, dtype)
    budget = free * config.gpu_memory_utilization - 512 * 2**20  # headroom for activations
    enough = config.max_num_seqs * -(-model_config.max_position_embeddings // config.page_size)
    num_pages = max(16, min(enough, int(budget // per_page)))
    if num_pages * config.page_size < model_config.max_position_embeddings:
        warnings.warn(f"the KV cache gets {num_pages} pages ({num_pages * config.page_size} "
                      f"tokens) of {free / 2**30:.1f} GiB free GPU memory, less than one "
                      f"{model_config.max_position_embeddings}-token context: free GPU memory "
                      f"(another engine still held?) or pass num_pages", stacklevel=3)
    return num_pages


def _auto_device(model, quantization: str | None) -> str:
    """device="auto": where a model passed in loaded lies, else CUDA if torch sees a GPU."""
    embed = getattr(model[0], "embed_tokens", None) if isinstance(model, tuple) else None
    return str(embed.weight.device) if embed is not None else resolve_device("auto",
                                                                             quantization)


def _load(model, device: str, dtype: torch.dtype, quantization: str | None,
          dtype_name: str = "auto"):
    """(model, info, dtype of its activations and KV cache). A model passed in loaded must be on
    the engine's device, and keeps its own dtype under dtype="auto"; an explicit dtype must
    match it."""
    from minicb.model.loader import load_model
    if isinstance(model, torch.nn.Module):  # str(model) would be its repr as a path
        raise ValueError("model is a loaded module without its info: pass the pair "
                         "load_model(...) returned, (model, info), or a name or a path")
    if not isinstance(model, tuple):
        return (*load_model(str(model), device=device, dtype=dtype, quantization=quantization),
                dtype)
    loaded = getattr(model[0], "quantization", None)
    if quantization and loaded != quantization:  # None takes the model as it was loaded
        # quantizing in place would change a model other engines share
        raise ValueError(f"quantization={quantization!r} but the model passed in was loaded "
                         f"with quantization={loaded!r}; load it with "
                         f"load_model(..., quantization={quantization!r})")
    embed = getattr(model[0], "embed_tokens", None)  # the simulated model has no weights
    want = torch.device(device)
    if embed is not None and (embed.weight.device.type != want.type or (
            want.index is not None and embed.weight.device.index != want.index)):
        raise ValueError(f"device={device!r} but the model passed in is on "
                         f"{embed.weight.device}; load it with load_model(..., device={device!r})")
    if embed is not None and embed.weight.dtype != dtype:
        if dtype_name != "auto":  # a KV cache in another dtype than the model fails every step
            raise ValueError(f"dtype={dtype_name!r} but the model passed in was loaded in "
                             f"{embed.weight.dtype}; load it with load_model(..., dtype=...) "
                             f"or leave dtype='auto'")
        dtype = embed.weight.dtype
    return (*model, dtype)


# scheduler instances engines were built with, by id (a learner's class need not be hashable)
_BOUND_SCHEDULERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _check_unbound(scheduler: Scheduler) -> None:
    """Refuse a scheduler instance that another engine was built with: a policy may keep state
    between steps (static batching keeps its batch, with the other engine's requests and
    slots), so each engine needs its own instance, even once the other's run is over."""
    if _BOUND_SCHEDULERS.get(id(scheduler)) is scheduler:
        cls = type(scheduler).__name__
        raise ValueError(f"this {cls} instance already belongs to another Engine and may hold "
                         f"its state; give each engine a fresh one: policy={cls}()")


class Engine:
    """Holds the model, the page pool, the queues and the trace; `step()` advances everything
    (chapter 03; chapter 01 steps a single request through it by hand)."""

    def __init__(self, model="smollm2-135m", config: EngineConfig | None = None,
                 clock=None, **options) -> None:
        """`model`: a bundled name, a checkpoint directory, or a `(model, info)` pair already
        loaded. `clock`: a callable returning seconds (the simulated executor passes its own)."""
        if config is not None and set(options) - {"policy"}:
            raise ValueError("pass either an EngineConfig or keyword options, not both")
        if config is not None and "policy" in options:
            config = EngineConfig.from_kwargs(**{**config.__dict__,
                                                 "policy": options.pop("policy")})
        # policy: a name, or the learner's own Scheduler instance
        self.config = config or EngineConfig.from_kwargs(**options)
        if self.config.device == "auto":  # resolved once: every part below sees one device
            self.config = dataclasses.replace(self.config, device=_auto_device(
                model, self.config.quantization))
        self.scheduler: Scheduler = make_scheduler(self.config.policy)
        _check_unbound(self.scheduler)
        # whole-prompt policies may exceed the token budget with one long prompt (problem one);
        # every other scheduler, a learner's included, must stay within it
        self.enforce_budget = not getattr(self.scheduler, "whole_prompts", False)
        device = self.config.device
        dtype = torch_dtype(self.config.dtype, device)
        self.model, self.info, dtype = _load(model, device, dtype, self.config.quantization,
                                             self.config.dtype)
        self.attention_backend = resolve_backend(self.config.attention_backend, device)
        self.model.set_attention_backend(self.attention_backend)
        self.tokenizer = self.info.tokenizer
        mc = self.info.config
        num_pages = self.config.num_pages or default_num_pages(mc, self.config, dtype)
        num_swap_pages = (self.config.num_swap_pages or num_pages
                          if self.config.preemption_mode == "swap" else 0)
        self.pool = PagePool(num_pages, self.config.page_size, mc.num_layers,
                             mc.num_kv_heads, mc.head_dim, dtype, device,
                             self.config.enable_prefix_caching, num_swap_pages)
        self.max_model_len = mc.max_position_embeddings
        self.requests: dict[str, Request] = {}
        self.pending: list[Request] = []  # added, arrival step/time not reached yet
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(self.config.max_num_seqs))
        self.trace: list[StepRecord] = []
        self.step_count = 0
        self._now = clock or time.perf_counter
        self._sleep = getattr(clock, "sleep", time.sleep)  # a simulated clock jumps instead
        self.t0 = self._now()
        self._finished_between_steps: list[str] = []  # cancelled or stopped by a caller
        self._held: list[Request] = []  # finished in a static batch still running: not returned
        self._empty_steps = 0  # steps in a row that scheduled nothing while work waits
        self._arrived_since_last_step: list[str] = []  # added between steps, arriving at once
        self._ids = itertools.count()
        self._seq = itertools.count()  # arrival order (Request.seq_index), even after `forget`
        self.tenant_service: Counter[str | None] = Counter()  # tokens computed per tenant
        # unfinished requests with a deadline: none, and no step scans the queue for expiry
        # (10,000 waiting requests made that scan most of a simulated run)
        self._num_with_deadline = 0
        # reject_when_full: (state it was computed in, pages unclaimed then, the cached pages
        # the queue's prefix hits claim: None while the count is only a lower bound), so a
        # burst of arrivals does not rescan the whole waiting queue for each of them
        self._unclaimed: tuple[tuple[int, ...], int, set[int] | None] | None = None
        self._generators: dict[str, torch.Generator | None] = {}
        self._failure_hook = None  # tests inject faults here: callable(batch) raising
        self.graph_runner = None  # CUDA graphs for decode-only steps (chapter 07)
        if (str(device).startswith("cuda") and self.config.use_cuda_graphs
                and self.attention_backend == "triton"):
            with self._on_device():
                self.graph_runner = self.make_graph_runner(capture=True)
        with contextlib.suppress(TypeError):  # an object without weak references goes unguarded
            _BOUND_SCHEDULERS[id(self.scheduler)] = self.scheduler  # see _check_unbound

    @property
    def waits_on_clock(self) -> bool:
        """Dynamic batching by seconds: steps that schedule nothing while requests wait are the
        batch timeout running, not a stall (chapter 02). `batch_timeout` means nothing to other
        policies."""
        return bool(self.config.batch_timeout_in_seconds
                    and getattr(self.scheduler, "waits_for_batch_timeout", False))

    @property
    def stall_limit(self) -> int:
        """Steps in a row that may schedule nothing while work waits before a loop over
        `step()` calls it a stall: STALL_STEPS, plus the timeout of dynamic batching counted in
        steps (its empty steps until then are the timeout running), chapter 02."""
        if getattr(self.scheduler, "waits_for_batch_timeout", False) \
                and not self.config.batch_timeout_in_seconds:
            return STALL_STEPS + int(self.config.batch_timeout)
        return STALL_STEPS

    def _on_device(self) -> contextlib.AbstractContextManager:
        """Triton kernels and CUDA graphs use torch's current CUDA device: make it the
        engine's for the duration (an engine on cuda:1 beside one on cuda:0)."""
        device = torch.device(self.config.device)
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    def make_graph_runner(self, capture: bool = True):
        """Static buffers (and, on CUDA, captured graphs) for decode-only steps."""
        from minicb.cuda_graphs import DecodeGraphRunner, graph_buckets
        max_tokens = min(self.max_model_len, self.pool.num_pages * self.pool.page_size)
        return DecodeGraphRunner(self.model, self.pool.kv_caches, self.pool.page_size,
                                 self.pool.pages_needed(max_tokens), self.config.device,
                                 graph_buckets(self.config.max_num_seqs), capture=capture)

    # ------------------------------------------------------------------------------ clock
    def clock(self) -> float:
        """Seconds since the engine started (or since `reset_clock`)."""
        return self._now() - self.t0

    def reset_clock(self) -> None:
        self.t0 = self._now()

    # ------------------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids: a list of ids as given; a text through the model's tokenizer
        with the special tokens it adds (Llama's BOS, as transformers and vLLM encode a text
        prompt), or without them for a chat already rendered by its template, which writes
        them itself (`add_special_tokens=False`)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but this checkpoint has no tokenizer; "
                                 "pass token ids (a list of ints) instead")
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)) \
                if prompt else []
        if not isinstance(prompt, (list, tuple)) or \
                any(not is_int(t) for t in prompt):
            raise ValueError(f"prompt must be a string or a list of token ids, got {prompt!r:.80}")
        return list(prompt)

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids if this engine can ever run it under `params`; ValueError
        naming the problem if not. Changes nothing (`LLM.generate` checks a whole batch before
        queuing any of it)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.info.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {bad[:5]}")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) = {total} exceeds the model's context of "
                             f"{self.max_model_len} tokens")
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
        """Queue a request; it joins the waiting queue at `arrival_step` or `arrival_time`
        (engine-clock seconds), or now. Returns its id. `deadline`: seconds after arrival by
        which it must finish; a request still unfinished then leaves with finish_reason
        "deadline" (chapter 06). `tenant`: who sent it, for `preemption="fair"`. Bad input
        raises ValueError and leaves the engine untouched."""
        params = params or SamplingParams()
        token_ids = self.check_request(prompt, params)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self.requests:
                request_id = f"req-{next(self._ids)}"
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if arrival_step is not None and not is_positive_int(arrival_step):
            raise ValueError(f"arrival_step must be an integer >= 1, got {arrival_step!r}")
        if arrival_time is not None and (not is_finite_number(arrival_time) or arrival_time < 0):
            raise ValueError(f"arrival_time must be a finite number >= 0 seconds, got "
                             f"{arrival_time!r}")
        if not is_int(priority):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if deadline is not None and (not is_finite_number(deadline) or deadline <= 0):
            raise ValueError(f"deadline must be a finite number of seconds > 0 or None, got "
                             f"{deadline!r}")
        if tenant is not None and not isinstance(tenant, str):
            raise ValueError(f"tenant must be a string or None, got {tenant!r}")
        req = Request(request_id, token_ids, params, priority=priority,
                      arrives_at_step=arrival_step, arrives_at_time=arrival_time,
                      eos_token_ids=tuple(self.info.eos_token_ids), deadline=deadline,
                      tenant=tenant)
        if self.pool.prefix is not None:  # hashed once; admission and reclaim reuse them
            req.page_hashes = prompt_page_hashes(token_ids, self.pool.page_size)
        generator = make_generator(params.seed)  # before any state changes: nothing half-added
        self.requests[request_id] = req
        self._generators[request_id] = generator
        self.pending.append(req)
        self._num_with_deadline += deadline is not None
        if arrival_step is None and arrival_time is None:
            self._arrive(req, self.step_count + 1)  # between steps: the next one
            self._arrived_since_last_step.append(request_id)
        return request_id

    def _arrive(self, req: Request, step: int) -> None:  # step: the first that can run it
        self.pending.remove(req)
        req.seq_index = next(self._seq)  # "newest" and first-come ties go by arrival, not by add
        # a step already past when the request was added counts as the step it arrives at:
        # the engine cannot have kept it waiting before it knew of it
        req.metrics.arrival_step = step if req.arrives_at_step is None \
            else max(req.arrives_at_step, step)
        req.metrics.arrival_time = self.clock() if req.arrives_at_time is None \
            else req.arrives_at_time
        if self.config.reject_when_full:
            need = self._pages_to_admit(req)
            unclaimed = self._pages_unclaimed(need)
            claimed = self._unclaimed[2]
            if claimed is not None:  # cached pages a waiting request will share: not twice
                claimed = set(claimed)  # a copy: a rejected arrival claims nothing
                need = self._pages_to_admit(req, claimed)
            if need > unclaimed:
                self._finish(req, "rejected")  # its step's record lists it as finished
                self._finished_between_steps.append(req.request_id)
                return
            enqueue(self.waiting, req, self.config.preemption)
            self._unclaimed = (self._unclaimed_key(), unclaimed - need, claimed)
            return
        enqueue(self.waiting, req, self.config.preemption)

    def _pages_to_admit(self, req: Request, claimed: set[int] | None = None) -> int:
        """Available pages admitting `req` whole would take (chapter 06): those its tokens
        need beyond its prefix hits (its whole life's when it will be admitted with it,
        `max_preemptions`), plus the hits that sit unreferenced (shared, they stop being
        available) and are not in `claimed` (counted for a request ahead of it already)."""
        return self.pool.pages_to_take(prefix_hits(self.pool, req),
                                       self.pool.pages_needed(self._tokens_to_admit(req)),
                                       claimed)

    def _tokens_to_admit(self, req: Request) -> int:
        """The tokens `req`'s admission must hold: its whole life's when `max_preemptions`
        will admit it only with room for all of it (chapter 06)."""
        limit = self.config.max_preemptions
        return req.max_total_tokens if limit is not None and req.num_preemptions >= limit \
            else req.num_tokens

    def _pages_unclaimed(self, need: int) -> int:
        """Available pages less those the waiting requests will take when admitted: what a new
        arrival needing `need` pages can count on (`reject_when_full`, chapter 06). Running
        requests' growth is not counted: preemption answers that. First a lower bound (a
        waiting request takes at most the pages its tokens need, prefix hits aside); only when
        that falls short of `need` the exact count, which looks up every waiting request's
        prefix: a long queue waiting for slots, not pages, would pay that at every arrival.
        Remembered between arrivals (each takes its pages off); recomputed after a step's
        scheduling, or when the queue's length or the pool's counts changed (a cancel)."""
        key = self._unclaimed_key()
        if self._unclaimed is None or self._unclaimed[0] != key:
            self._unclaimed = (key, self.pool.num_available - sum(
                self.pool.pages_needed(self._tokens_to_admit(r)) for r in self.waiting), None)
        if self._unclaimed[1] < need and self._unclaimed[2] is None:
            claimed: set[int] = set()  # two requests sharing a cached page take it once
            self._unclaimed = (key, self.pool.num_available - sum(
                self._pages_to_admit(r, claimed) for r in self.waiting), claimed)
        return self._unclaimed[1]

    def _unclaimed_key(self) -> tuple[int, ...]:
        return (self.step_count, len(self.waiting), self.pool.num_free, self.pool.num_cached)

    def _expire_deadlines(self, now: float) -> None:
        """Finish every waiting or running request whose deadline has passed by `now`, the
        step's start: its pages come back now, and the StepRecord lists it (chapter 06)."""
        if not self._num_with_deadline:
            return
        for req in [*self.waiting, *self.running]:
            if req.deadline_time <= now:
                self._finish(req, "deadline")
                self._finished_between_steps.append(req.request_id)

    def _reorder_waiting_queue(self) -> None:
        """Orders that change as steps pass (chapter 06). With `priority_aging_steps`: by
        effective priority, `priority` minus one for every that many steps waited, oldest first
        among equals, so a request that waits long enough outranks any newcomer (starvation is
        bounded). With preemption="fair": the tenant served the fewest tokens so far first."""
        aging = self.config.priority_aging_steps
        if aging:
            ordered = sorted(self.waiting, key=lambda r: (
                r.priority - (self.step_count - r.metrics.arrival_step) // aging, r.seq_index))
        elif self.config.preemption == "fair":
            ordered = sorted(self.waiting, key=queue_rank("fair", self.tenant_service))
        else:
            return
        self.waiting.clear()
        self.waiting.extend(ordered)

    def _admit_arrivals(self) -> list[str]:
        now = self.clock()
        arrived = [r for r in self.pending
                   if (r.arrives_at_step is None or r.arrives_at_step <= self.step_count)
                   and (r.arrives_at_time is None or r.arrives_at_time <= now)]
        # stable: requests arriving together keep the order they were added in
        arrived.sort(key=lambda r: (r.arrives_at_time or 0.0, r.arrives_at_step or 0))
        for req in arrived:
            self._arrive(req, self.step_count)  # inside step(), after its count went up
        return [r.request_id for r in arrived]

    def _skip_idle_time(self) -> None:
        """Nothing to run: jump the step counter, or sleep, to the next arrival."""
        if self.running or self.waiting or not self.pending:
            return
        steps = [r.arrives_at_step for r in self.pending if r.arrives_at_step is not None]
        times = [r.arrives_at_time for r in self.pending if r.arrives_at_time is not None]
        if steps and all(r.arrives_at_step is not None for r in self.pending):
            self.step_count = max(self.step_count, min(steps) - 1)
        if times:
            delay = min(times) - self.clock()
            if delay > 0:
                self._sleep(delay)

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Cancel a waiting or running request: its pages return at once. Cancelling a
        finished request does nothing; an unknown id raises ValueError. `reason="stop"` is for
        a caller that ended the request itself (a server matching a stop string)."""
        if reason not in ("cancelled", "stop"):
            raise ValueError(f"reason must be 'cancelled' or 'stop', got {reason!r}")
        req = self.requests.get(str(request_id))
        if req is None:
            raise ValueError(f"cannot cancel unknown request_id {request_id!r}")
        if req.is_finished:
            return
        self._finish(req, reason)
        self._finished_between_steps.append(req.request_id)  # the next StepRecord lists it

    def stop_at(self, request_id: str, num_output_tokens: int) -> None:
        """A caller's stop string ended the request at output token `num_output_tokens` (chapter
        00's `LLM`, chapter 06's server): it finishes "stop" now, or is relabelled so if its
        last step ended it by length; tokens after that one, guesses the same step kept
        (chapter 08), are dropped, as if it had stopped there."""
        req = self.requests.get(str(request_id))
        if req is None:
            raise ValueError(f"cannot stop unknown request_id {request_id!r}")
        if isinstance(num_output_tokens, bool) or not isinstance(num_output_tokens, int) or \
                not 0 < num_output_tokens <= len(req.output_token_ids):
            raise ValueError(f"num_output_tokens must be 1..{len(req.output_token_ids)}, got "
                             f"{num_output_tokens}")
        m = req.metrics
        for kept in (req.output_token_ids, req.output_logprobs, m.token_times, m.token_steps):
            del kept[num_output_tokens:]
        if not req.is_finished:
            self.cancel(request_id, reason="stop")
        elif req.finish_reason == "length":  # its last token: say what the caller got
            req.finish_reason = "stop"

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record (a long-running server calls this to bound
        memory), and its share of its tenant's service; its id may then be reused."""
        request_id = str(request_id)
        req = self.requests.get(request_id)
        if req is None:
            return
        if not req.is_finished:
            raise ValueError(f"request {request_id!r} is not finished; cancel it first")
        if req in self._held:  # a static batch member whose batch still runs: gone with it
            self._held.remove(req)
        self.tenant_service[req.tenant] -= req.num_scheduled_tokens
        if self.tenant_service[req.tenant] <= 0:
            del self.tenant_service[req.tenant]  # bounded by the tenants still remembered
        del self.requests[request_id]
        self._generators.pop(request_id, None)
        for pending_ids in (self._finished_between_steps, self._arrived_since_last_step):
            while request_id in pending_ids:  # not reported in the next StepRecord either
                pending_ids.remove(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.pending or self.waiting or self.running)

    # ------------------------------------------------------------------------------ the step
    def step(self) -> StepRecord:
        """One iteration: schedule -> forward -> sample -> reclaim. Returns its record."""
        # 0. the queue: arrivals join, expired deadlines leave, aging or fair order re-sorts
        self._skip_idle_time()
        self.step_count += 1
        arrived = self._arrived_since_last_step + self._admit_arrivals()
        self._arrived_since_last_step = []
        t_start = self.clock()  # after arrivals: nobody is scheduled before they arrived
        self._expire_deadlines(t_start)
        self._reorder_waiting_queue()

        # 1. schedule: the policy's verbs (admit, preempt) act at once; the swap copies they
        # planned run after it, then the batch is checked before anything is computed
        evicted_before = self.pool.num_evicted
        ctx = SchedulerContext(self.waiting, self.running, self.pool, self.config,
                               self.step_count, t_start, self.free_slots, self.tenant_service)
        try:
            batch = self.scheduler.schedule(ctx)
        finally:  # a policy that raises after a preemption or a readmission still gets its
            # copies: without them a victim's K/V would be lost and its host pages leaked
            self._unclaimed = None  # admissions and preemptions changed what the queue takes
            swapped_out, swapped_in = self._move_pages(ctx.batch)
        self._validate(batch, ctx)
        drafts = self._propose_drafts(batch) if self.config.num_speculative_tokens else {}
        # one-token rows (decodes, and a prefill's last single token) first: the attention
        # metadata expects them there; a decode carrying guesses counts as a chunk
        items = sorted(((r, n + len(drafts.get(r.request_id, ()))) for r, n in batch.items),
                       key=lambda item: item[1] != 1)
        for req, _ in items:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = t_start
                req.metrics.first_scheduled_step = self.step_count
        kinds = {r.request_id: ("decode" if not r.is_prefill else "prefill") for r, _ in items}
        slots = {r.request_id: r.slot for r, _ in items}  # before reclaim frees them
        starts = {r.request_id: r.num_computed_tokens for r, _ in items}

        # 2. forward and 3. sample
        t_forward = 0.0
        sampled: list[str] = []
        finished: list[str] = []
        speculated: dict[str, tuple[int, int]] = {}
        recomputed = 0
        if items:
            try:
                t0 = self._now()
                with self._on_device():
                    to_sample, logits = self._forward(items, drafts)
                if logits.is_cuda:  # kernels run asynchronously: time them, not their launch
                    torch.cuda.synchronize(logits.device)
                t_forward = self._now() - t0
                tokens = self._sample(to_sample, logits, drafts)
            except Exception as exc:  # contain the fault: fail this step's requests only
                message = f"{type(exc).__name__}: {exc}"
                for req, _ in items:
                    req.error = message
                    self._finish(req, "error")
                    finished.append(req.request_id)
                items, to_sample, tokens = [], [], []
            # the books: tokens now in the cache, service per tenant, work redone, and the
            # prompt pages this step completed, which the prefix index can now share
            for req, num_tokens in items:
                req.num_scheduled_tokens += num_tokens
                self.tenant_service[req.tenant] += num_tokens
                # of a member with guesses, only its last token is surely in the cache: each
                # guess the model keeps joins it as the next token is appended (_append_tokens)
                start = req.num_computed_tokens
                req.num_computed_tokens += num_tokens - len(drafts.get(req.request_id, ()))
                # K/V a preemption threw away that the prefix index did not give back (ch. 06)
                redone = max(0, min(req.num_computed_tokens,
                                    req.num_tokens_before_preemption) - start)
                req.num_recomputed_tokens += redone
                recomputed += redone
                if start < req.num_prompt_tokens:  # a chunk of the prompt (or crossing its end)
                    self.pool.register_prompt_pages(req.prompt_token_ids, req.page_table,
                                                    req.num_computed_tokens, req.page_hashes)
            now = self.clock()
            for req, new_tokens in zip(to_sample, tokens):
                delivered = self._append_tokens(req, new_tokens, now)
                if req.request_id in drafts:  # a stop token may cut the kept guesses short
                    speculated[req.request_id] = (len(drafts[req.request_id]), delivered - 1)
                sampled.append(req.request_id)

        # 4. reclaim
        for req, _ in items:
            reason = self._stop_reason(req)
            if reason and not req.is_finished:
                self._finish(req, reason)
                finished.append(req.request_id)
        record = StepRecord(
            step=self.step_count,
            members=[Member(r.request_id, kinds[r.request_id], n, slots[r.request_id],
                            starts[r.request_id]) for r, n in items]
            + [Member(r.request_id, "idle", 0, r.slot) for r in batch.idle],
            waiting=[], finished=finished + self._finished_between_steps,
            preempted=[r.request_id for r in batch.preempted],
            swapped=[r.request_id for r in batch.swapped],
            pages_used=self.pool.num_used, pages_cached=self.pool.num_cached,
            t_start=t_start, t_end=self.clock(), arrived=arrived, sampled=sampled,
            t_forward=t_forward, pages_total=self.pool.num_pages,
            num_waiting=len(self.waiting), snapshots=self.config.trace_snapshots,
            pages_evicted=self.pool.num_evicted - evicted_before, speculated=speculated,
            pages_swapped_out=swapped_out, pages_swapped_in=swapped_in,
            tokens_discarded=batch.num_discarded_tokens, tokens_recomputed=recomputed)
        if self.config.trace_snapshots:
            record.waiting = [r.request_id for r in self.waiting]
            record.page_tables = {r.request_id: list(r.page_table) for r in self.running}
            record.slots = {r.request_id: r.slot for r in self.running}
            record.cached_pages = list(self.pool.prefix.lru) if self.pool.prefix else []
        self._finished_between_steps = []
        if self.waits_on_clock and not (record.members or record.finished or arrived
                                        or record.preempted):
            # dynamic batching waiting for its timeout: no step ran, and step latencies count
            # steps that did (chapter 02). The record is returned but not traced, and the next
            # step reuses its number
            self.step_count -= 1
            self._check_progress(record)
            return record
        self.trace.append(record)
        if self.config.check_invariants:
            self.check_invariants(record)
        self._check_progress(record)
        return record

    def _move_pages(self, batch: ScheduledBatch) -> tuple[int, int]:
        """Do the swap copies the policy planned (chapter 06), before the forward writes into
        the pages: out first, since a page a victim gave up may be the one a swap-in takes; then
        the host pages of the requests swapped in go back. The simulated executor charges the
        copies to its clock. Returns (pages copied out, pages copied in)."""
        if not (batch.swap_out or batch.swap_in or batch.swap_release):
            return 0, 0
        with self._on_device():
            self.pool.swap_out(batch.swap_out)
            self.pool.swap_in(batch.swap_in)
        self.pool.release_swap(batch.swap_release)
        charge = getattr(self.model, "copy_pages", None)  # SimModel only: real copies take time
        if charge is not None:
            charge(len(batch.swap_out) + len(batch.swap_in))
        return len(batch.swap_out), len(batch.swap_in)

    def _check_progress(self, record: StepRecord) -> None:
        """Count steps in a row that scheduled nothing while requests wait or run; raise after
        `stall_limit` of them, so that no loop over `step()` (run, generate, stream, a server)
        spins forever on a scheduler that never schedules (e.g. a learner's, or a setting that
        leaves no room for any chunk). Dynamic batching by seconds legitimately waits on the
        clock: those steps sleep a millisecond instead of counting."""
        if record.members or record.finished or not (self.waiting or self.running):
            self._empty_steps = 0
            return
        if self.waits_on_clock:
            self._sleep(0.001)
            return
        self._empty_steps += 1
        if self._empty_steps > self.stall_limit:
            stuck = [r.request_id for r in (*self.waiting, *self.running)][:5]
            self._empty_steps = 0
            raise RuntimeError(
                f"policy {self.scheduler.name!r} scheduled nothing for {self.stall_limit} steps in "
                f"a row while requests wait or run: {stuck}. A scheduler must schedule work "
                f"when it can; check its settings (e.g. min_chunk against the token budget)")

    def _propose_drafts(self, batch: ScheduledBatch) -> dict[str, list[int]]:
        """Speculative decoding (chapter 08): for decode members, up to num_speculative_tokens
        tokens guessed by prompt lookup, within the token budget the policy left and the free
        pages; the step runs each member's last token and its guesses as one causal chunk."""
        cfg = self.config
        room = cfg.max_num_batched_tokens - batch.num_tokens
        drafts: dict[str, list[int]] = {}
        for req, num_tokens in batch.items:
            left = req.params.max_tokens - len(req.output_token_ids) - 1  # after this token
            k = min(cfg.num_speculative_tokens, room, left)
            if k < 1 or num_tokens != 1 or req.is_prefill \
                    or len(req.output_token_ids) < req.params.min_tokens \
                    or req.params.penalised or req.params.logprobs is not None:
                continue  # bans, penalties and logprobs are computed one token at a time
            if req.ngram_index is None:
                req.ngram_index = NgramIndex(cfg.prompt_lookup_max, cfg.prompt_lookup_min)
            draft = req.ngram_index.propose(req.all_token_ids, k)
            need = self.pool.pages_needed(req.num_tokens + len(draft)) - len(req.page_table)
            if not draft or need > self.pool.num_available:
                continue
            if need > 0:
                req.page_table.extend(self.pool.allocate(need))
            drafts[req.request_id] = draft
            room -= len(draft)
        return drafts

    def _sample(self, reqs: list[Request], logits: torch.Tensor,
                drafts: dict[str, list[int]]) -> list[list[int]]:
        """The new tokens of each request: one sampled token, or for a request with guesses,
        the ones the model keeps and one of its own (`speculative.verify`)."""
        generators = [self._generators[r.request_id] for r in reqs]
        for r in reqs:  # the penalties' counts, from here on kept as tokens are appended
            if r.params.penalised and r.token_counts is None:
                r.token_counts = TokenCounts(r.prompt_token_ids, r.output_token_ids,
                                             logits.shape[-1], logits.device)
        if not drafts:  # one logit row each
            out = [[t] for t in sample(logits, [r.params for r in reqs], generators,
                                       [self._banned_tokens(r) for r in reqs],
                                       [r.token_counts for r in reqs])]
            last = list(range(len(reqs)))
        else:
            out, last, row = [], [], 0
            for req, generator in zip(reqs, generators):
                draft = drafts.get(req.request_id, [])
                rows = logits[row:row + len(draft) + 1]
                out.append(verify(rows, draft, req.params, generator) if draft else
                           sample(rows, [req.params], [generator], [self._banned_tokens(req)],
                                  [req.token_counts]))
                row += len(draft) + 1
                last.append(row - 1)
        asked = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if asked:  # nothing to compute when no request asked (never one with guesses)
            for i, pairs in zip(asked, top_logprobs(
                    logits[[last[i] for i in asked]], [out[i][0] for i in asked],
                    [reqs[i].params.logprobs for i in asked])):
                reqs[i].output_logprobs.append(pairs)
        return out

    def _forward(self, items: list[tuple[Request, int]], drafts: dict[str, list[int]]
                 ) -> tuple[list[Request], torch.Tensor]:
        """Flatten the members into one token batch, run the model once, return the requests to
        sample and their logits: one row each (the last position of each finishing member), or,
        for a member with guesses, one per position from its last token on."""
        if self._failure_hook is not None:
            self._failure_hook(items)
        runner = self.graph_runner
        if runner is not None and len(items) <= runner.max_batch and all(
                n == 1 and not r.is_prefill for r, n in items):
            return self._forward_decode_graph(runner, [r for r, _ in items])
        input_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        to_sample: list[Request] = []
        for req, n in items:
            start = req.num_computed_tokens
            draft = drafts.get(req.request_id, [])
            input_ids.extend(req.token_ids_slice(start, start + n - len(draft)) + draft)
            positions.extend(range(start, start + n))
            if start + n - len(draft) == req.num_tokens:
                logit_rows.extend(range(len(input_ids) - len(draft) - 1, len(input_ids)))
                to_sample.append(req)
        if self.model.attention_backend_name != self.attention_backend:
            self.model.set_attention_backend(self.attention_backend)  # engines may share a model
        device = self.config.device
        meta = build_metadata([r.page_table for r, _ in items],
                              [r.num_computed_tokens for r, _ in items],
                              [n for _, n in items], self.pool.page_size, device)
        with torch.inference_mode():
            logits = self.model(int_tensor(input_ids, device=device),
                                int_tensor(positions, device=device), meta,
                                self.pool.kv_caches, int_tensor(logit_rows, device=device))
        return to_sample, logits

    def _forward_decode_graph(self, runner, reqs: list[Request]
                              ) -> tuple[list[Request], torch.Tensor]:
        page_size = self.pool.page_size
        positions = [r.num_computed_tokens for r in reqs]
        slots = [r.page_table[p // page_size] * page_size + p % page_size
                 for r, p in zip(reqs, positions)]
        logits = runner.run([r.token_ids_slice(p, p + 1)[0] for r, p in zip(reqs, positions)],
                            positions,
                            slots, [p + 1 for p in positions], [r.page_table for r in reqs])
        return reqs, logits

    def _append_tokens(self, req: Request, tokens: list[int], now: float) -> int:
        """Append a step's new tokens up to the first that ends the request; how many. Several
        come from one step only with guesses (chapter 08): each after the first was a kept
        guess, whose K/V the step computed, so the cache holds the token before it."""
        for count, token in enumerate(tokens):
            req.num_computed_tokens += count > 0
            self._append_token(req, token, now)
            if self._stop_reason(req):
                return count + 1
        return len(tokens)

    def _append_token(self, req: Request, token: int, now: float) -> None:
        req.output_token_ids.append(token)
        if req.token_counts is not None:
            req.token_counts.add(token)
        req.metrics.token_times.append(now)
        req.metrics.token_steps.append(self.step_count)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
            req.metrics.first_token_step = self.step_count

    def _banned_tokens(self, req: Request) -> list[int]:
        """Tokens the next sample must not be: the stop and EOS tokens while the request has
        fewer than `min_tokens` outputs (vLLM's meaning: they are not generated, not kept)."""
        return list(req.stop_tokens) if len(req.output_token_ids) < req.params.min_tokens else []

    @staticmethod
    def _stop_reason(req: Request) -> str | None:
        if not req.output_token_ids or req.is_prefill:
            return None
        if req.output_token_ids[-1] in req.stop_tokens:
            return "stop"
        if len(req.output_token_ids) >= req.params.max_tokens:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        """Leave the engine: pages back to the pool (prompt pages stay indexed), slot back."""
        was_running = req.status is Status.RUNNING
        if req.page_table:
            self.pool.register_prompt_pages(req.prompt_token_ids, req.page_table,
                                            req.num_computed_tokens, req.page_hashes)
            self.pool.release(req.page_table)
            req.page_table = []
        if req.swapped_pages:  # cancelled or out of time while swapped out
            self.pool.release_swap(req.swapped_pages)
            req.swapped_pages = []
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.pending:
            self.pending.remove(req)
        if not (was_running and self.scheduler.holds_finished_slots) and req.slot is not None:
            self.free_slots.append(req.slot)
            self.free_slots.sort()
            req.slot = None
        req.status = Status.FINISHED
        req.finish_reason = reason
        self._num_with_deadline -= req.deadline is not None
        # a few tuples per token, two vocabulary rows: not kept for every finished request
        req.ngram_index = req.token_counts = None
        req.metrics.finish_time = self.clock()
        req.metrics.finish_step = self.step_count
        if was_running and self.scheduler.holds_finished_slots and reason in ("stop", "length"):
            req.returned_whole = True  # a static batch returns whole, when its last member ends
            self._held.append(req)
        else:
            self._release(req, req.metrics.finish_time)
        if self._held and self.scheduler.batch_done():  # its last member just left, for
            for held in self._held:                     # whatever reason, during a step or
                self._release(held)                     # between steps
            self._held = []

    def _release(self, req: Request, now: float | None = None) -> None:
        """The response reaches its user: E2E latency ends here (chapter 02)."""
        req.metrics.released_time = self.clock() if now is None else now
        req.metrics.released_step = self.step_count

    # ------------------------------------------------------------------------------ checks
    def _validate(self, batch: ScheduledBatch, ctx: SchedulerContext) -> None:
        """Refuse an impossible batch (a learner's scheduler may build one) before the forward.
        The policy's verbs have acted by then (admissions, preemptions, swap copies): they are
        checked as they happen, this checks what the step would compute."""
        if batch is not ctx.batch:
            got = "another ScheduledBatch" if isinstance(batch, ScheduledBatch) \
                else type(batch).__name__
            raise SchedulerError(f"step {self.step_count}: schedule() must return ctx.batch, "
                                 f"the batch that ctx.schedule and ctx.preempt fill; got {got}")
        cfg = self.config
        seen: set[str] = set()
        for req, n in batch.items:
            rid = req.request_id if hasattr(req, "request_id") else repr(req)
            rule = self._broken_rule(req, rid, n, seen)
            if rule:
                raise SchedulerError(f"step {self.step_count}, request {rid!r}: {rule}")
            seen.add(rid)
        if len(batch.items) + len(batch.idle) > cfg.max_num_seqs:
            raise SchedulerError(f"step {self.step_count}: {len(batch.items)} members exceed "
                                 f"max_num_seqs={cfg.max_num_seqs}")
        if self.enforce_budget and batch.num_tokens > cfg.max_num_batched_tokens:
            raise SchedulerError(f"step {self.step_count}: {batch.num_tokens} tokens exceed "
                                 f"max_num_batched_tokens={cfg.max_num_batched_tokens}")
        for req, n in batch.items:  # after the budget, which a long whole prompt hears of first
            if self.enforce_budget and req.is_prefill and n > cfg.chunk_size:
                raise SchedulerError(f"step {self.step_count}, request {req.request_id!r}: a "
                                     f"prefill chunk of {n} tokens exceeds "
                                     f"chunk_size={cfg.chunk_size}")

    def _broken_rule(self, req: Request, rid: str, n: int, seen: set[str]) -> str | None:
        """The first rule that scheduling `n` tokens of `req` breaks, or None."""
        if self.requests.get(rid) is not req:
            return "unknown request (not added to this engine)"
        if req.is_finished:
            return f"request already finished ({req.finish_reason})"
        if req.status is not Status.RUNNING:
            return f"request is {req.status.value}, not running (admit it with ctx.admit first)"
        if rid in seen:
            return "scheduled twice in one step"
        if not isinstance(n, int) or n < 1 or n > req.num_remaining:
            return f"asks to advance {n} tokens but has {req.num_remaining} left to compute"
        if self.pool.pages_needed(req.num_computed_tokens + n) > len(req.page_table):
            return (f"{n} tokens need more pages than its page table holds "
                    f"({len(req.page_table)}); reserve them first")
        return None

    def check_invariants(self, record: StepRecord | None = None) -> None:
        """Raise InvariantError naming the step, request and rule if the books do not balance."""
        step = self.step_count
        try:
            self.pool.check([r.page_table for r in self.running],
                            [r.swapped_pages for r in self.waiting])
        except AssertionError as exc:
            raise InvariantError(f"step {step}: page pool: {exc}") from None
        places = {}
        for name, group in (("pending", self.pending), ("waiting", self.waiting),
                            ("running", self.running)):
            for req in group:
                if req.request_id in places:
                    raise InvariantError(f"step {step}: request {req.request_id!r} is both "
                                         f"{places[req.request_id]} and {name}")
                places[req.request_id] = name
                if req.is_finished:
                    raise InvariantError(f"step {step}: request {req.request_id!r} is finished "
                                         f"but still {name}")
        for req in self.requests.values():
            if req.request_id not in places and not req.is_finished:
                raise InvariantError(f"step {step}: request {req.request_id!r} is lost "
                                     f"(status {req.status.value}, in no queue)")
            if req.status is not Status.RUNNING and req.page_table:
                raise InvariantError(f"step {step}: request {req.request_id!r} holds pages "
                                     f"while {req.status.value}")
            if (req.status is Status.SWAPPED) != bool(req.swapped_pages):
                raise InvariantError(f"step {step}: request {req.request_id!r} is "
                                     f"{req.status.value} with {len(req.swapped_pages)} "
                                     f"swap pages")
        slots = [r.slot for r in self.running]
        if len(set(slots)) != len(slots) or None in slots:
            raise InvariantError(f"step {step}: running requests share or lack slots: {slots}")
        if record is None:
            return
        for m in record.members:
            guessed = record.speculated.get(m.request_id, (0, 0))[0]
            if m.kind == "decode" and m.num_tokens != 1 + guessed:
                raise InvariantError(f"step {step}: request {m.request_id!r}: decode advanced "
                                     f"{m.num_tokens} tokens, not 1 + {guessed} guessed")
        if getattr(self.scheduler, "decodes_every_step", False):
            scheduled = {m.request_id for m in record.members}
            skipped = [r.request_id for r in self.running if r.request_id not in scheduled
                       and not r.is_prefill and r.metrics.first_token_step is not None
                       and r.metrics.first_token_step < step and r.num_preemptions == 0]
            if skipped:
                raise InvariantError(f"step {step}: policy {self.scheduler.name!r} "
                                     f"(decodes_every_step) left running decodes out: {skipped}")

    # ------------------------------------------------------------------------------ results
    def stats(self) -> dict[str, int]:
        """Page and queue counts now; the swap space's too when there is one (chapter 06).
        `num_waiting` counts every request added and not running, those whose arrival step or
        time is still ahead included (a `StepRecord`'s counts only the arrived)."""
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
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        return RequestOutput(req.request_id, list(req.prompt_token_ids),
                             list(req.output_token_ids), text, req.finish_reason,
                             req.num_cached_tokens, req.metrics, req.error, req.num_preemptions,
                             None if req.params.logprobs is None else list(req.output_logprobs))

    def run(self, max_steps: int | None = None) -> list[RequestOutput]:
        """Step until every request has finished (or `max_steps`); outputs of the requests that
        were unfinished when called, in the order they were added."""
        todo = [rid for rid, r in self.requests.items() if not r.is_finished]
        steps = 0
        while self.has_unfinished() and (max_steps is None or steps < max_steps):
            self.step()  # raises if the policy stalls (_check_progress)
            steps += 1
        return [self.output(rid) for rid in todo]

    def request_records(self) -> list[RequestRecord]:
        """Every request as plain data, for `minicb.benchmark.metrics`."""
        out = []
        for r in self.requests.values():
            m = r.metrics
            out.append(RequestRecord(
                r.request_id, r.num_prompt_tokens, len(r.output_token_ids), r.finish_reason,
                m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finish_time,
                list(m.token_times), m.arrival_step, m.first_scheduled_step, m.first_token_step,
                m.finish_step, list(m.token_steps), r.num_cached_tokens, r.num_preemptions,
                r.num_recomputed_tokens, r.priority, m.released_time, m.released_step,
                r.tenant, r.returned_whole, num_discarded_tokens=r.num_discarded_tokens))
        return out
