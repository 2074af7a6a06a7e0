"""The one thread that owns the engine behind the server (chapter 08).

The engine is synchronous and single-threaded, so exactly one thread, the `EngineWorker`,
touches it:

    HTTP handlers (asyncio)  --commands (queue.Queue)-->  engine thread: add / cancel / step()
    HTTP handlers (asyncio)  <--events (asyncio.Queue)--  engine thread, via call_soon_threadsafe

Every request from every client joins the same running engine, so continuous batching happens
across clients. A request for `n` choices is `n` engine requests: the first goes in at once,
the others once its prompt is in the prefix cache, so they reuse its pages."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minicb.config import is_int
from minicb.llm import StopMatcher, render_chat
from minicb.request import SamplingParams
from minicb.serving.stats import ServerStats

log = logging.getLogger("minicb.serving")


class InvalidRequest(ValueError):
    """A request the server refuses with HTTP 400; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class QueueFull(RuntimeError):
    """More requests wait than `max_queue` allows: HTTP 429."""


class CacheFull(RuntimeError):
    """The engine rejected the request (`reject_when_full`, chapter 06): the KV cache cannot
    take its prompt now. HTTP 503, before any stream starts."""


@dataclass
class Event:
    """What the engine thread tells a request's handler after a step, for one choice."""

    index: int  # which choice
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # stop, length, cancelled, error, deadline
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None  # one per token of token_ids, if asked


@dataclass
class Job:
    """One accepted request as its HTTP handler sees it: `n` choices, one engine request
    each, whose events arrive on one queue."""

    request_ids: list[str]  # the engine's id of each choice
    prompt_token_ids: list[int]
    events: asyncio.Queue
    finished: set[int] = field(default_factory=set)  # choices whose last event was read

    @property
    def request_id(self) -> str:
        return self.request_ids[0]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.request_ids)


@dataclass
class _Stream:
    """The engine thread's bookkeeping for one choice: what was sent, what is held back."""

    job: Job
    index: int
    loop: asyncio.AbstractEventLoop
    matcher: StopMatcher | None  # its text, cut at a stop string; None: the model has no tokenizer
    logprobs: bool = False
    sent_tokens: int = 0
    sent_text: int = 0  # characters of `matcher.text` already sent


@dataclass
class _Siblings:
    """A request's other choices, waiting for the first one's prompt to reach the cache."""

    stream: list[_Stream]
    request_ids: list[str]
    params: list[SamplingParams]
    add_args: dict[str, Any]


class EngineWorker:
    """Owns the engine and the one thread that touches it (chapter 08). Handlers call `submit`
    and `cancel` from any thread or event loop; the thread applies them between steps, steps while
    there is work, and sends each request its new tokens after every step.

    `max_queue`: refuse (QueueFull) a request when that many already wait; an engine with
    `reject_when_full` refuses (CacheFull) one its KV cache cannot take. A long-running
    server's memory stays bounded: `max_trace` steps are kept in `engine.trace` (the oldest half
    is dropped when it is full), and `max_finished` finished requests in `engine.requests` (the
    oldest are dropped with `Engine.forget`). `default_max_tokens`: a chat request that sets no
    max_tokens gets at most this many (None: whatever room the context and the pool leave, as
    vLLM; with `max_preemptions` such a request may hold pages for all of that room)."""

    def __init__(self, engine: Any, model_name: str = "minicb", max_queue: int | None = None,
                 max_trace: int = 10_000, max_finished: int = 10_000,
                 default_max_tokens: int | None = None) -> None:
        if default_max_tokens is not None and (not is_int(default_max_tokens)
                                               or default_max_tokens < 1):
            raise ValueError(f"default_max_tokens must be an integer >= 1 or None, got "
                             f"{default_max_tokens!r}")
        self.engine = engine
        self.max_queue = max_queue
        self.default_max_tokens = default_max_tokens
        self.max_trace = max_trace
        self.max_finished = max_finished
        self._finished_ids: deque[str] = deque()  # oldest first, still in engine.requests
        self._last_step = engine.step_count  # the last step whose record was counted
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.capacity = engine.pool.num_pages * engine.pool.page_size
        # no token stands for more characters than its longest vocabulary entry has: a longer
        # text cannot fit the context, and is refused before it is tokenized
        self.max_prompt_chars = self.max_model_len * max(
            map(len, self.tokenizer.get_vocab()), default=1) if self.tokenizer is not None \
            and hasattr(self.tokenizer, "get_vocab") else None
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._siblings: dict[str, _Siblings] = {}  # first choice's id -> the others, not added
        self._thread: threading.Thread | None = None
        self.stats = ServerStats(model_name)
        # finished through `_cancel` or rejected in `_add`: already counted when the step's
        # record lists them
        self._counted_early: set[str] = set()
        self.last_error: str | None = None
        self._refresh_gauges(engine.clock())

    # -------------------------------------------------------------- any thread
    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="minicb-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps; a Future of its result (tests
        and notebooks read the engine's trace and records this way)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, future))
        return future

    async def submit(self, prompt: str | list[int] | None, params: dict[str, Any],
                     messages: list[dict] | None = None, stop: tuple[str, ...] = (),
                     request_id: str | None = None, tenant: str | None = None,
                     priority: int = 0, deadline: float | None = None, n: int = 1) -> Job:
        """Queue a request for `n` choices; returns its Job once the engine has accepted it.
        Raises InvalidRequest (bad prompt or params), QueueFull or CacheFull. `tenant`: the
        OpenAI `user`; `priority`: smaller is more important (vLLM's extra field), for
        --preemption; `deadline`: seconds after arrival by which it must finish (minicb's own
        field)."""
        self.start()
        # tokenized here, on a worker thread: a long prompt holds up no step of the engine's
        token_ids, field_name = await asyncio.to_thread(self.tokenize, prompt, messages)
        sink = (asyncio.get_running_loop(), asyncio.Queue())  # made on the handler's loop
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", token_ids, field_name, params, stop, request_id,
                            dict(tenant=tenant, priority=priority, deadline=deadline), n, sink,
                            future))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the caller stopped waiting (timeout, disconnect)
            # the engine thread may be adding it right now: cancel the request it makes
            future.add_done_callback(self._cancel_unwanted)
            raise

    def tokenize(self, prompt: str | list[int] | None, messages: list[dict] | None
                 ) -> tuple[list[int], str]:
        """The prompt's token ids (of `messages` through the chat template, if given) and the
        request field they came from; InvalidRequest if it cannot be a prompt. Any thread."""
        field_name = "prompt"
        if messages is not None:
            field_name = "messages"
            if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
                raise InvalidRequest("this model has no chat template: use /v1/completions",
                                     "messages")
            try:
                prompt = render_chat(self.tokenizer, messages)
            except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
                raise InvalidRequest(f"cannot apply the chat template: {exc}", "messages") \
                    from None
        if isinstance(prompt, str) and self.max_prompt_chars is not None \
                and len(prompt) > self.max_prompt_chars:
            raise InvalidRequest(
                f"the {field_name} has {len(prompt)} characters: more than the model's context "
                f"of {self.max_model_len} tokens can hold (no token is longer than "
                f"{self.max_prompt_chars // self.max_model_len} characters)", field_name,
                "context_length_exceeded")
        try:  # a rendered chat holds its special tokens already; a text gets the tokenizer's
            return self.engine.tokenize(prompt, add_special_tokens=messages is None), field_name
        except ValueError as exc:
            raise InvalidRequest(str(exc), field_name) from None

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (vLLM's /detokenize); InvalidRequest without a tokenizer
        or for an id outside the vocabulary. Any thread."""
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer", "tokens")
        vocab = self.engine.info.config.vocab_size
        if any(t >= vocab for t in token_ids):
            raise InvalidRequest(f"token ids must be below the vocabulary size {vocab}",
                                 "tokens")
        return self.tokenizer.decode(token_ids)

    def _cancel_unwanted(self, future: concurrent.futures.Future) -> None:
        """Done-callback of a submit nobody awaits any more: cancel the request it made."""
        if not future.cancelled() and future.exception() is None:
            self.cancel(future.result())

    def cancel(self, job: Job) -> None:
        """Cancel every unfinished choice of a request (its client went away): their pages
        return at the engine's next pause between steps."""
        for rid in job.request_ids:
            self._commands.put(("cancel", rid))

    def metrics_text(self) -> bytes:
        """Everything `/metrics` shows, in the Prometheus text format."""
        return self.stats.text()

    # -------------------------------------------------------------- the engine thread only
    def _run(self) -> None:
        while True:
            # block while idle; between steps, take whatever has arrived
            commands = [] if self.engine.has_unfinished() else [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                if cmd[0] == "stop":
                    return
                try:  # each on its own: one command's fault must not drop the others
                    self._handle(cmd)
                except Exception:  # noqa: BLE001 - a bug: log it, keep serving
                    self._log_fault()
            try:
                if self.engine.has_unfinished():
                    self._step()  # its record refreshes the gauges, and so does each cancel
                    time.sleep(0)  # let the HTTP thread take the GIL and send the tokens
                    continue
                self._end_streams_of_finished()
            except Exception:  # noqa: BLE001 - a fault fails the requests, not the server
                self._fail_all()
            self._refresh_gauges(self.engine.clock())  # commands may have emptied the queue

    def _end_streams_of_finished(self) -> None:
        """A command finished a request in the engine (`call(lambda e: e.cancel(rid))`) and
        nothing is left to step: the next step's record would tell its stream, but no step
        comes until another request does, so tell it now."""
        self._add_siblings()
        for rid, stream in list(self._streams.items()):
            req = self.engine.requests.get(rid)
            if req is None:  # the command forgot it too: nothing left to send but the end
                self._streams.pop(rid)
                self._send(stream, Event(stream.index, [], "", "cancelled"))
            elif req.is_finished:
                self._send(stream, self._emit(rid, stream))

    def _log_fault(self) -> None:
        """Keep and print the traceback of the exception being handled."""
        self.last_error = traceback.format_exc()
        log.error("%s", self.last_error)

    def _fail_all(self) -> None:
        """A step raised on the engine thread: log it, end every open request with an error,
        and keep serving."""
        self._log_fault()
        self._siblings.clear()
        for rid, stream in list(self._streams.items()):
            self._send(stream, Event(stream.index, [], "", "error",
                                     "engine error: see the server log"))
            try:
                self._cancel(rid, "error")
            except Exception:  # noqa: BLE001 - the engine is broken; keep the thread alive
                time.sleep(0.1)

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "cancel":
            self._cancel(cmd[1], "cancelled")
            return
        future = cmd[-1]
        # False: its caller stopped waiting while it was queued, so nobody wants it; True: it
        # can no longer be cancelled, so setting its result below cannot raise
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = self._add(*cmd[1:-1]) if kind == "add" else cmd[1](self.engine)
        except Exception as exc:  # noqa: BLE001 - bad input, QueueFull, a bug: the caller answers
            if kind == "add" and isinstance(exc, ValueError) \
                    and not isinstance(exc, InvalidRequest):
                exc = InvalidRequest(str(exc))  # the engine refused the caller's input
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _sampling(self, params: dict[str, Any], stop: tuple[str, ...]) -> SamplingParams:
        """SamplingParams of a request; InvalidRequest naming the field it refuses."""
        try:
            return SamplingParams(**params, stop=stop)
        except ValueError as exc:
            raise InvalidRequest(str(exc), str(exc).split()[0]) from None

    def _add(self, token_ids: list[int], field_name: str, params: dict[str, Any],
             stop: tuple[str, ...], request_id: str | None, add_args: dict[str, Any], n: int,
             sink: tuple) -> Job:
        engine = self.engine
        waiting = len(engine.waiting) + len(engine.pending)
        if self.max_queue is not None and waiting >= self.max_queue:
            raise QueueFull(f"the server's queue is full ({waiting} requests waiting, "
                            f"--max-queue {self.max_queue}); retry later")
        if stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer, and this model has none: use "
                                 "stop_token_ids", "stop")
        params = dict(params)
        if params.get("max_tokens") is None:  # chat's default: whatever room is left
            room = max(1, min(self.max_model_len, self.capacity) - len(token_ids))
            params["max_tokens"] = min(room, self.default_max_tokens or room)
        elif params["max_tokens"] >= self.max_model_len:  # no prompt leaves room for it
            raise InvalidRequest(f"max_tokens is {params['max_tokens']}: the model's context "
                                 f"holds {self.max_model_len} tokens, prompt included",
                                 "max_tokens", "context_length_exceeded")
        sampling = self._sampling(params, stop)
        ids = self._fresh_ids(request_id or uuid.uuid4().hex[:16], n)
        job = Job(ids, list(token_ids), sink[1])
        streams = [_Stream(job, i, sink[0], None if self.tokenizer is None else
                           StopMatcher(self.tokenizer, sampling.stop, sampling.min_tokens),
                           logprobs=params.get("logprobs") is not None) for i in range(n)]
        self._add_one(ids[0], streams[0], sampling, add_args, field_name)
        if n > 1:  # each its own seed: seeded choices must still differ
            others = _Siblings(streams[1:], ids[1:], [
                sampling if sampling.seed is None else
                dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**64)
                for i in range(1, n)], add_args)
            self._siblings[ids[0]] = others
            if not engine.config.enable_prefix_caching:
                self._add_siblings()  # nothing to wait for
        return job

    def _fresh_ids(self, base: str, n: int) -> list[str]:
        """`n` request ids not in use, from `base` (X-Request-Id may be reused)."""
        ids: list[str] = []
        suffix = 0
        while len(ids) < n:
            rid = base if suffix == 0 else f"{base}-{suffix}"
            if rid not in self.engine.requests and rid not in ids:
                ids.append(rid)
            suffix += 1
        return ids

    def _add_one(self, rid: str, stream: _Stream, sampling: SamplingParams,
                 add_args: dict[str, Any], field_name: str = "prompt") -> None:
        engine = self.engine
        token_ids = stream.job.prompt_token_ids
        try:
            engine.add_request(token_ids, sampling, request_id=rid, **add_args)
        except ValueError as exc:
            message = str(exc)
            fits = "exceeds the model's context" in message or "never fit" in message
            if message.startswith("stop_token_ids"):
                field_name = "stop_token_ids"
            raise InvalidRequest(message, field_name,
                                 "context_length_exceeded" if fits else None) from None
        req = engine.requests[rid]
        if req.finish_reason == "rejected":  # reject_when_full (chapter 06)
            self.stats.finished("rejected", req.metrics)  # counted now; the next step's
            self._counted_early.add(rid)  # record retires it like any other
            raise CacheFull(f"the KV cache is full: it cannot take this prompt's "
                            f"{len(token_ids)} tokens now (free pages, less what the waiting "
                            "requests will take, are too few; the server rejects rather than "
                            "queues, --reject-when-full); retry later")
        self._streams[rid] = stream
        self.stats.count("prompt_tokens", len(token_ids))

    def _add_siblings(self) -> None:
        """Add the other choices of every request whose first choice has its prompt in the
        cache now (it has a token, or has ended)."""
        for first in list(self._siblings):
            req = self.engine.requests.get(first)
            if req is not None and not req.output_token_ids and not req.is_finished:
                continue
            others = self._siblings.pop(first)
            for rid, stream, sampling in zip(others.request_ids, others.stream, others.params):
                try:
                    self._add_one(rid, stream, sampling, others.add_args)
                except Exception as exc:  # noqa: BLE001 - this choice fails, not the others
                    self._send(stream, Event(stream.index, [], "", "error", str(exc)))

    def _cancel(self, rid: str, reason: str) -> None:
        """Cancel in the engine (pages back at once) and count it under `reason`."""
        self._streams.pop(rid, None)
        for first, others in list(self._siblings.items()):
            if rid in others.request_ids:  # not added yet: nothing to free
                i = others.request_ids.index(rid)
                for items in (others.request_ids, others.stream, others.params):
                    del items[i]
                if not others.request_ids:
                    del self._siblings[first]
                return
        req = self.engine.requests.get(rid)
        if req is None or req.is_finished:
            return
        self.engine.cancel(rid, "stop" if reason == "stop" else "cancelled")
        self._refresh_gauges(self.engine.clock())
        self._finished(rid, reason)
        self._counted_early.add(rid)

    def _finished(self, rid: str, reason: str) -> None:
        """Count a finished request and log its line: id, reason, tokens, TTFT, E2E."""
        req = self.engine.requests[rid]
        m = req.metrics
        self.stats.finished(reason, m)
        ttft = None if m.first_token_time is None else m.first_token_time - m.arrival_time
        e2e = None if m.finish_time is None or m.arrival_time is None \
            else m.finish_time - m.arrival_time
        log.info("request %s %s: reason=%s prompt_tokens=%d completion_tokens=%d ttft=%s "
                 "e2e=%s", rid, "aborted" if reason in ("cancelled", "error") else "finished",
                 reason, req.num_prompt_tokens, len(req.output_token_ids),
                 "-" if ttft is None else f"{ttft:.3f}s", "-" if e2e is None else f"{e2e:.3f}s")

    def _refresh_gauges(self, now: float) -> None:
        """The engine's counts and the queue age as of `now` (engine seconds), for /metrics."""
        unscheduled = [r.metrics.arrival_time for r in self.engine.waiting
                       if r.metrics.first_scheduled_time is None]  # as metrics.max_queue_age
        self.oldest_waiting_s = now - min(unscheduled) if unscheduled else 0.0
        self.stats.set_gauges(self.engine.stats(), self.oldest_waiting_s)

    def _step(self) -> None:
        engine = self.engine
        try:
            record = engine.step()
        except Exception:
            last = engine.trace[-1] if engine.trace else None
            if last is not None and last.step > self._last_step:  # a check raised after the
                self._count(last)  # step was recorded: its finished requests still count,
                self._retire(last)  # and must still be forgotten in time
            raise
        self._count(record)
        events = []
        try:
            for rid in dict.fromkeys(record.sampled + record.finished):
                stream = self._streams.get(rid)
                if stream is not None:
                    events.append((stream, self._emit(rid, stream)))
        finally:  # even if an emit raised
            try:  # after the emits (a "length" may become a "stop"), before any handler hears
                self._retire(record)  # of a finish (and reads /metrics)
            finally:
                for stream, event in events:
                    self._send(stream, event)
        self._add_siblings()

    def _count(self, record: Any) -> None:
        """Count a step's tokens and latencies (before any handler hears of the step)."""
        self._last_step = record.step
        self._refresh_gauges(record.t_end)
        count = self.stats.count
        count("steps")
        count("num_preemptions", len(record.preempted))
        count("kv_pages_evicted", record.pages_evicted)
        count("preemption_discarded_tokens", record.tokens_discarded)
        count("preemption_recomputed_tokens", record.tokens_recomputed)
        count("kv_pages_swapped_out", record.pages_swapped_out)
        count("kv_pages_swapped_in", record.pages_swapped_in)
        for member in record.members:  # admitted this step: its prefix-cache lookup
            req = self.engine.requests.get(member.request_id)
            if req is not None and req.metrics.first_scheduled_step == record.step:
                count("prefix_cache_queries", req.num_prompt_tokens)
                count("prefix_cache_hits", req.num_cached_tokens)
        for rid in record.sampled:
            m = self.engine.requests[rid].metrics
            new = 1  # tokens this step gave it: more than one when guesses were kept
            while new < len(m.token_steps) and m.token_steps[-new - 1] == record.step:
                new += 1
            if len(m.token_times) == new:
                self.stats.ttft.observe(m.first_token_time - m.arrival_time)
            else:  # one gap per delivery, since the last step that gave it tokens
                self.stats.itl.observe(m.token_times[-1] - m.token_times[-new - 1])

    def _retire(self, record: Any) -> None:
        """Count a step's finished requests by reason, and bound the trace and the records."""
        engine = self.engine
        for rid in record.finished:  # every `_cancel` and rejection was counted already
            if rid in self._counted_early:
                self._counted_early.discard(rid)
            elif rid in engine.requests:
                self._finished(rid, engine.requests[rid].finish_reason)
        if len(engine.trace) > self.max_trace:
            del engine.trace[:len(engine.trace) - self.max_trace // 2]
        self._finished_ids.extend(record.finished)
        while len(self._finished_ids) > self.max_finished:
            engine.forget(self._finished_ids.popleft())

    def _emit(self, rid: str, s: _Stream) -> Event:
        """The event that brings a choice its new tokens and text; stops it at a stop
        string."""
        req = self.engine.requests[rid]
        reason = req.finish_reason
        delta = ""
        m = s.matcher
        if m is not None:
            if m.step(req.output_token_ids, final=reason is not None):
                reason = "stop"
            end = max(s.sent_text, m.ready(final=reason is not None))
            delta, s.sent_text = m.text[s.sent_text:end], end
        if reason:
            self._streams.pop(rid, None)
        if m is not None and m.stopped:
            self._cancel(rid, "stop")  # a stop string: the engine stops now (if it runs still)
            self.engine.stop_at(rid, m.num_tokens)  # and drops tokens after the stop string's
        ids = req.output_token_ids
        new_ids = ids[s.sent_tokens:]
        self.stats.count("generation_tokens", len(new_ids))  # what the client gets
        logprobs = None
        if s.logprobs:
            logprobs = list(getattr(req, "output_logprobs", None) or [])[s.sent_tokens:len(ids)]
        s.sent_tokens = len(ids)
        return Event(s.index, new_ids, delta, reason, req.error, logprobs)

    def _send(self, s: _Stream, event: Event) -> None:
        try:
            s.loop.call_soon_threadsafe(s.job.events.put_nowait, event)
        except RuntimeError:  # the handler's event loop is gone: nobody listens any more
            self._cancel(s.job.request_ids[event.index], "cancelled")
