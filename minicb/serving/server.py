"""An OpenAI-compatible HTTP server in front of one running engine (chapters 06 and 08).

    python -m minicb serve --model smollm2-135m --policy pd --port 8000

Engines are used through servers, and a benchmark is measured where the user sits: at the client.
The engine is synchronous and single-threaded, so exactly one thread, the `EngineWorker`, owns it:

    HTTP handlers (asyncio)  --commands (queue.Queue)-->  engine thread: add / cancel / step()
    HTTP handlers (asyncio)  <--events (asyncio.Queue)--  engine thread, via call_soon_threadsafe

Every request from every client joins the same running engine, so continuous batching happens
across clients. Endpoints: POST /v1/completions and /v1/chat/completions (streamed as
server-sent events or not), GET /v1/models, GET /health, GET /metrics (Prometheus text).
Each choice carries the generated `token_ids` as an extra field (vLLM's `return_token_ids`), so a
checkpoint without a tokenizer can still be checked token for token."""

from __future__ import annotations

import argparse
import asyncio
import bisect
import concurrent.futures
import json
import queue
import socket
import threading
import time
import traceback
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from minicb.benchmark.bench import add_full_cache_arguments, check_full_cache_flags
from minicb.config import QUANTIZATIONS, is_finite_number, is_int
from minicb.llm import StopMatcher, is_conversation, render_chat
from minicb.request import FINISH_REASONS, SamplingParams, stop_strings

# vLLM's bucket edges, in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0)


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
    """What the engine thread tells one request's handler after a step."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # stop, length, cancelled, error
    error: str | None = None


@dataclass
class Job:
    """One accepted request as its HTTP handler sees it."""

    request_id: str
    num_prompt_tokens: int
    events: asyncio.Queue
    finished: bool = False


@dataclass
class _Stream:
    """The engine thread's bookkeeping for one request: what was sent, what is held back."""

    job: Job
    loop: asyncio.AbstractEventLoop
    matcher: StopMatcher | None  # its text, cut at a stop string; None: the model has no tokenizer
    sent_tokens: int = 0
    sent_text: int = 0  # characters of `matcher.text` already sent


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets, self.counts = buckets, [0] * (len(buckets) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        total = 0
        for edge, n in zip([*map(repr, self.buckets), "+Inf"], self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{edge}"}} {total}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]


# ------------------------------------------------------------------------------ the engine thread
class EngineWorker:
    """Owns the engine and the one thread that touches it (chapter 06). Handlers call `submit`
    and `cancel` from any thread or event loop; the thread applies them between steps, steps while
    there is work, and sends each request its new tokens after every step.

    `max_queue`: refuse (QueueFull) a request when that many already wait; an engine with
    `reject_when_full` refuses (CacheFull) one its KV cache cannot take. A long-running
    server's memory stays bounded: `max_trace` steps are kept in `engine.trace` (the oldest half
    is dropped when it is full), and `max_finished` finished requests in `engine.requests` (the
    oldest are dropped with `Engine.forget`). `default_max_tokens`: a chat request that sets no
    max_tokens gets at most this many (None: whatever room the context and the pool leave, as
    vLLM; with `max_preemptions` such a request may hold pages for all of that room)."""

    def __init__(self, engine: Any, max_queue: int | None = None,
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
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the counters below (read by /metrics)
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self.finish_reasons: Counter[str] = Counter()
        # finished through `_cancel` or rejected in `_add`: already counted when the step's
        # record lists them
        self._counted_early: set[str] = set()
        self.counters = Counter(preemptions=0, prompt_tokens=0, generation_tokens=0, steps=0,
                                discarded_tokens=0, recomputed_tokens=0, evicted_pages=0,
                                swapped_out_pages=0, swapped_in_pages=0)
        self.oldest_waiting_s = 0.0  # queue age of the longest-waiting unscheduled request
        self.snapshot: dict[str, int] = dict(engine.stats())
        self.last_error: str | None = None

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
                     priority: int = 0, deadline: float | None = None) -> Job:
        """Queue a request; returns its Job once the engine has accepted it. Raises
        InvalidRequest (bad prompt or params) or QueueFull. `tenant`: the OpenAI `user`;
        `priority`: smaller is more important (vLLM's extra field), for --preemption;
        `deadline`: seconds after arrival by which it must finish (minicb's own field)."""
        self.start()
        # tokenized here, on a worker thread: a long prompt holds up no step of the engine's
        token_ids, field_name = await asyncio.to_thread(self.tokenize, prompt, messages)
        sink = (asyncio.get_running_loop(), asyncio.Queue())  # made on the handler's loop
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", token_ids, field_name, params, stop, request_id, tenant,
                            priority, deadline, sink, future))
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

    def _cancel_unwanted(self, future: concurrent.futures.Future) -> None:
        """Done-callback of a submit nobody awaits any more: cancel the request it made."""
        if not future.cancelled() and future.exception() is None:
            self.cancel(future.result().request_id)

    def cancel(self, request_id: str) -> None:
        """Cancel a request (its client went away): its pages return at the engine's next
        pause between steps."""
        self._commands.put(("cancel", request_id))

    def metrics_text(self, model_name: str) -> str:
        """Everything `/metrics` shows, in the Prometheus text format."""
        s = self.snapshot
        gauges = [("num_requests_waiting", "Requests waiting to be scheduled.", s["num_waiting"]),
                  ("num_requests_running", "Requests in the running batch.", s["num_running"]),
                  ("kv_pages_used", "KV pages held by running requests.", s["pages_used"]),
                  ("kv_pages_free", "KV pages on the free list.", s["pages_free"]),
                  ("kv_pages_cached", "Unreferenced KV pages kept by the prefix index.",
                   s["pages_cached"]),
                  ("kv_pages_total", "KV pages in the pool.", s["pages_total"]),
                  ("kv_swap_pages_free", "Host memory pages free to hold swapped-out K/V.",
                   s.get("swap_pages_free", 0)),  # stats() lists them only with a swap space
                  ("kv_swap_pages_total", "Host memory pages of swap space (0: preemption "
                   "mode recompute).", s.get("swap_pages_total", 0)),
                  ("oldest_waiting_seconds", "Queue age: how long the longest-waiting request "
                   "not yet scheduled had waited, as of the engine's last step or command.",
                   self.oldest_waiting_s)]
        out = [f"# minicb model={model_name}"]
        for name, help_text, value in gauges:
            out += [f"# HELP minicb_{name} {help_text}", f"# TYPE minicb_{name} gauge",
                    f"minicb_{name} {value}"]
        with self._lock:
            counters = [("num_preemptions_total", "Preemptions (pages freed; recomputed, or "
                         "swapped back, later).", self.counters["preemptions"]),
                        ("prompt_tokens_total", "Prompt tokens accepted.",
                         self.counters["prompt_tokens"]),
                        ("generation_tokens_total", "Tokens generated.",
                         self.counters["generation_tokens"]),
                        ("steps_total", "Engine steps run.", self.counters["steps"]),
                        ("preemption_discarded_tokens_total",
                         "Computed K/V tokens that preemptions threw away (lost work).",
                         self.counters["discarded_tokens"]),
                        ("preemption_recomputed_tokens_total",
                         "Of those, tokens computed again (the rest came back from the prefix "
                         "cache).", self.counters["recomputed_tokens"]),
                        ("kv_pages_evicted_total",
                         "Cached prefix pages given up to make room (reuse lost).",
                         self.counters["evicted_pages"]),
                        ("kv_pages_swapped_out_total",
                         "KV pages copied to host memory by preemptions (preemption mode swap).",
                         self.counters["swapped_out_pages"]),
                        ("kv_pages_swapped_in_total", "KV pages copied back from host memory.",
                         self.counters["swapped_in_pages"])]
            for name, help_text, value in counters:
                out += [f"# HELP minicb_{name} {help_text}", f"# TYPE minicb_{name} counter",
                        f"minicb_{name} {value}"]
            out += ["# HELP minicb_requests_total Finished requests by finish reason.",
                    "# TYPE minicb_requests_total counter"]
            for reason in sorted(set(FINISH_REASONS) | set(self.finish_reasons)):
                out.append(f'minicb_requests_total{{finish_reason="{reason}"}} '
                           f'{self.finish_reasons[reason]}')
            out += self.ttft.lines("minicb_time_to_first_token_seconds",
                                   "Time from arrival to the first token (engine clock).")
            out += self.itl.lines("minicb_inter_token_latency_seconds",
                                  "Time between consecutive tokens of one request.")
        return "\n".join(out) + "\n"

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
        for rid, stream in list(self._streams.items()):
            req = self.engine.requests.get(rid)
            if req is None:  # the command forgot it too: nothing left to send but the end
                self._streams.pop(rid)
                self._send(stream, Event([], "", "cancelled"))
            elif req.is_finished:
                self._send(stream, self._emit(stream))

    def _log_fault(self) -> None:
        """Keep and print the traceback of the exception being handled."""
        self.last_error = traceback.format_exc()
        print(self.last_error, flush=True)

    def _fail_all(self) -> None:
        """A step raised on the engine thread: log it, end every open request with an error,
        and keep serving."""
        self._log_fault()
        for rid, stream in list(self._streams.items()):
            self._send(stream, Event([], "", "error", "engine error: see the server log"))
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

    def _add(self, token_ids, field_name, params, stop, request_id, tenant, priority, deadline,
             sink) -> Job:
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
        try:
            sampling = SamplingParams(**params, stop=stop)
        except ValueError as exc:
            raise InvalidRequest(str(exc), str(exc).split()[0]) from None
        base = rid = request_id or uuid.uuid4().hex[:16]
        for suffix in range(1, len(engine.requests) + 2):  # X-Request-Id reused: make it unique
            if rid not in engine.requests:
                break
            rid = f"{base}-{suffix}"
        try:
            engine.add_request(token_ids, sampling, request_id=rid, tenant=tenant,
                               priority=priority, deadline=deadline)
        except ValueError as exc:
            message = str(exc)
            fits = "exceeds the model's context" in message or "never fit" in message
            if message.startswith("stop_token_ids"):
                field_name = "stop_token_ids"
            raise InvalidRequest(message, field_name,
                                 "context_length_exceeded" if fits else None) from None
        if engine.requests[rid].finish_reason == "rejected":  # reject_when_full (chapter 06)
            with self._lock:  # counted now; the next step's record retires it like any other
                self.finish_reasons["rejected"] += 1
                self._counted_early.add(rid)
            raise CacheFull(f"the KV cache is full: it cannot take this prompt's "
                            f"{len(token_ids)} tokens now (free pages, less what the waiting "
                            "requests will take, are too few; the server rejects rather than "
                            "queues, --reject-when-full); retry later")
        job = Job(rid, len(token_ids), sink[1])
        matcher = None if self.tokenizer is None else \
            StopMatcher(self.tokenizer, sampling.stop, sampling.min_tokens)
        self._streams[rid] = _Stream(job, sink[0], matcher)
        with self._lock:
            self.counters["prompt_tokens"] += len(token_ids)
        return job

    def _cancel(self, rid: str, reason: str) -> None:
        """Cancel in the engine (pages back at once) and count it under `reason`."""
        self._streams.pop(rid, None)
        req = self.engine.requests.get(rid)
        if req is None or req.is_finished:
            return
        self.engine.cancel(rid, "stop" if reason == "stop" else "cancelled")
        self._refresh_gauges(self.engine.clock())
        with self._lock:
            self.finish_reasons[reason] += 1
            self._counted_early.add(rid)

    def _refresh_gauges(self, now: float) -> None:
        """The engine's counts and the queue age as of `now` (engine seconds), for /metrics."""
        self.snapshot = dict(self.engine.stats())
        unscheduled = [r.metrics.arrival_time for r in self.engine.waiting
                       if r.metrics.first_scheduled_time is None]  # as metrics.max_queue_age
        self.oldest_waiting_s = now - min(unscheduled) if unscheduled else 0.0

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
                    events.append((stream, self._emit(stream)))
        finally:  # even if an emit raised
            try:  # after the emits (a "length" may become a "stop"), before any handler hears
                self._retire(record)  # of a finish (and reads /metrics)
            finally:
                for stream, event in events:
                    self._send(stream, event)

    def _count(self, record: Any) -> None:
        """Count a step's tokens and latencies (before any handler hears of the step)."""
        self._last_step = record.step
        self._refresh_gauges(record.t_end)
        with self._lock:
            self.counters["steps"] += 1
            self.counters["preemptions"] += len(record.preempted)
            self.counters["evicted_pages"] += record.pages_evicted
            self.counters["discarded_tokens"] += record.tokens_discarded
            self.counters["recomputed_tokens"] += record.tokens_recomputed
            self.counters["swapped_out_pages"] += record.pages_swapped_out
            self.counters["swapped_in_pages"] += record.pages_swapped_in
            for rid in record.sampled:
                m = self.engine.requests[rid].metrics
                new = 1  # tokens this step gave it: more than one when guesses were kept
                while new < len(m.token_steps) and m.token_steps[-new - 1] == record.step:
                    new += 1
                self.counters["generation_tokens"] += new
                if len(m.token_times) == new:
                    self.ttft.observe(m.first_token_time - m.arrival_time)
                else:  # one gap per delivery, since the last step that gave it tokens
                    self.itl.observe(m.token_times[-1] - m.token_times[-new - 1])

    def _retire(self, record: Any) -> None:
        """Count a step's finished requests by reason, and bound the trace and the records."""
        engine = self.engine
        with self._lock:
            for rid in record.finished:  # every `_cancel` and rejection was counted already
                if rid in self._counted_early:
                    self._counted_early.discard(rid)
                elif rid in engine.requests:
                    self.finish_reasons[engine.requests[rid].finish_reason] += 1
        if len(engine.trace) > self.max_trace:
            del engine.trace[:len(engine.trace) - self.max_trace // 2]
        self._finished_ids.extend(record.finished)
        while len(self._finished_ids) > self.max_finished:
            engine.forget(self._finished_ids.popleft())

    def _emit(self, s: _Stream) -> Event:
        """The event that brings a request its new tokens and text; stops it at a stop
        string."""
        rid = s.job.request_id
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
            dropped = len(req.output_token_ids) - m.num_tokens
            self.engine.stop_at(rid, m.num_tokens)  # and drops tokens after the stop string's
            with self._lock:  # counted by _count, never delivered: /metrics sums what clients got
                self.counters["generation_tokens"] -= dropped
        ids = req.output_token_ids
        new_ids, s.sent_tokens = ids[s.sent_tokens:], len(ids)
        return Event(new_ids, delta, reason, req.error)

    def _send(self, s: _Stream, event: Event) -> None:
        try:
            s.loop.call_soon_threadsafe(s.job.events.put_nowait, event)
        except RuntimeError:  # the handler's event loop is gone: nobody listens any more
            self._cancel(s.job.request_id, "cancelled")


# ------------------------------------------------------------------------------ request parsing
def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           kind: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _number(body: dict, name: str, default: Any, kind: type = float, low: float | None = None,
            high: float | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = is_finite_number(value)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise InvalidRequest(f"{name} must be {'an integer' if kind is int else 'a number'}, "
                             f"got {value!r}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise InvalidRequest(f"{name} must be in {bounds}, got {value!r}", name)
    return kind(value)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def parse_request(body: Any, chat: bool) -> dict[str, Any]:
    """Check an OpenAI request body; returns what `EngineWorker.submit` needs. Raises
    InvalidRequest naming the field. Unknown fields are ignored, as OpenAI servers do."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if chat:
        messages = body.get("messages")
        if not is_conversation(messages):
            raise InvalidRequest("messages must be a non-empty list of {role, content} objects",
                                 "messages")
        prompt = None
    else:
        messages, prompt = None, body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt))):
            raise InvalidRequest("prompt must be a string or a list of token ids (one prompt "
                                 "per request)", "prompt")
    if _number(body, "n", 1, int) != 1:
        raise InvalidRequest("only n=1 is supported", "n")
    logprobs = body.get("logprobs")  # 0 == False, yet logprobs=0 asks for the chosen tokens'
    wants_logprobs = logprobs is not None and logprobs is not False  # (OpenAI): `is`, not ==
    if wants_logprobs or body.get("echo"):
        name = "logprobs" if wants_logprobs else "echo"
        raise InvalidRequest(f"{name} is not supported by this server", name)
    stream = body.get("stream")
    stream = False if stream is None else stream  # null: not given, as OpenAI allows
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", "stream_options")
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    top_k = _number(body, "top_k", 0, int, low=-1)
    stop, stop_ids = body.get("stop"), body.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else stop_ids
    if not _is_token_ids(stop_ids):
        raise InvalidRequest("stop_token_ids must be a list of token ids", "stop_token_ids")
    if isinstance(stop, list) and stop and _is_token_ids(stop):
        stop, stop_ids = None, stop_ids + stop  # token ids given as `stop`
    try:  # SamplingParams' own rule, said in the request's field name
        stop = list(stop_strings(stop))
    except ValueError as exc:
        raise InvalidRequest(str(exc), "stop") from None
    ignore_eos = body.get("ignore_eos")
    ignore_eos = False if ignore_eos is None else ignore_eos  # null: not given
    if not isinstance(ignore_eos, bool):
        raise InvalidRequest("ignore_eos must be true or false", "ignore_eos")
    max_tokens = _number(body, max_name, None if chat else 16, int, low=1)
    params = dict(max_tokens=max_tokens,
                  temperature=_number(body, "temperature", 1.0, float, 0.0, 2.0),
                  top_p=_number(body, "top_p", 1.0, float),  # (0, 1]: SamplingParams checks
                  top_k=max(top_k, 0),
                  seed=_number(body, "seed", None, int),
                  stop_token_ids=tuple(stop_ids),
                  ignore_eos=ignore_eos,
                  min_tokens=_number(body, "min_tokens", 0, int, 0,
                                     max_tokens if max_tokens is not None else None))
    user = body.get("user")  # OpenAI's end-user id: the tenant for preemption="fair"
    if user is not None and not isinstance(user, str):
        raise InvalidRequest(f"user must be a string, got {user!r}", "user")
    deadline = _number(body, "deadline", None, float)  # minicb's own: seconds after arrival
    if deadline is not None and deadline <= 0:
        raise InvalidRequest(f"deadline must be a number of seconds > 0 (after the request "
                             f"arrives), got {deadline!r}", "deadline")
    return dict(prompt=prompt, messages=messages, params=params, stop=tuple(stop),
                stream=stream, include_usage=bool(options.get("include_usage")),
                model=body.get("model"), tenant=user,
                priority=_number(body, "priority", 0, int), deadline=deadline)


# ------------------------------------------------------------------------------ the app
class _EventStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the stream ends (client gone too)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def create_app(engine_or_llm: Any, model_name: str = "minicb", max_queue: int | None = 256,
               max_trace: int = 10_000, max_finished: int = 10_000,
               default_max_tokens: int | None = None) -> FastAPI:
    """The FastAPI app around one engine (chapters 06 and 08). `engine_or_llm`: an Engine or an
    LLM. The worker is `app.state.worker`; it starts with the app (or at the first request)."""
    engine = getattr(engine_or_llm, "engine", engine_or_llm)
    worker = EngineWorker(engine, max_queue=max_queue, max_trace=max_trace,
                          max_finished=max_finished, default_max_tokens=default_max_tokens)

    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="minicb", lifespan=lifespan)
    app.state.worker = worker
    created = int(time.time())

    @app.get("/health")
    async def health():
        if not worker.alive and worker._thread is not None:
            return _error(503, "the engine thread has stopped", kind="server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "minicb",
            "max_model_len": worker.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(worker.metrics_text(model_name),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except ClientDisconnect:  # it hung up while sending the body: nobody hears an answer
            return _error(400, "the client disconnected before its request was read")
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of 4301+ digits
            return _error(400, f"the request body is not valid JSON: {exc}")
        except RecursionError:
            return _error(400, "the request body is nested too deeply")
        try:
            req = parse_request(body, chat)
            if req["model"] not in (None, model_name):
                return _error(404, f"the model `{req['model']}` does not exist; this server "
                              f"serves `{model_name}`", "model", "model_not_found")
            job = await worker.submit(req["prompt"], req["params"], req["messages"],
                                      req["stop"], request.headers.get("x-request-id"),
                                      req["tenant"], req["priority"], req["deadline"])
        except InvalidRequest as exc:
            return _error(400, str(exc), exc.param, exc.code)
        except QueueFull as exc:
            return _error(429, str(exc), code="queue_full", kind="rate_limit_error",
                          headers={"Retry-After": "1"})
        except CacheFull as exc:  # the service is full for now, not the caller's fault
            return _error(503, str(exc), code="cache_full", kind="server_error",
                          headers={"Retry-After": "1"})
        except Exception as exc:  # noqa: BLE001 - a server bug: say so, keep serving
            return _error(500, f"{type(exc).__name__}: {exc}", kind="server_error")
        kind = ("chat.completion.chunk" if req["stream"] else "chat.completion") if chat \
            else "text_completion"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{job.request_id}", "object": kind,
                "created": int(time.time()), "model": model_name}

        def usage(n: int) -> dict:
            return {"prompt_tokens": job.num_prompt_tokens, "completion_tokens": n,
                    "total_tokens": job.num_prompt_tokens + n}

        def choice(ev: Event, streaming: bool) -> dict:
            out: dict[str, Any] = {"index": 0}
            if chat and streaming:
                out["delta"] = {"content": ev.text} if ev.text else {}
            elif chat:
                out["message"] = {"role": "assistant", "content": ev.text}
            else:
                out["text"] = ev.text
            reason = ev.finish_reason if ev.finish_reason != "cancelled" else "abort"
            return {**out, "token_ids": ev.token_ids, "logprobs": None, "finish_reason": reason}

        def close() -> None:
            if not job.finished:
                worker.cancel(job.request_id)

        if req["stream"]:
            async def events() -> AsyncIterator[str]:
                n = 0
                if chat:
                    yield _sse({**head, "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}]})
                while not job.finished:
                    ev = await job.events.get()
                    job.finished = ev.finish_reason is not None
                    n += len(ev.token_ids)
                    if ev.error:
                        yield _sse({"error": {"message": ev.error, "type": "server_error",
                                              "param": None, "code": None}})
                    chunk = {**head, "choices": [choice(ev, True)]}
                    if req["include_usage"]:
                        chunk["usage"] = None
                    yield _sse(chunk)
                if req["include_usage"]:
                    yield _sse({**head, "choices": [], "usage": usage(n)})
                yield _sse("[DONE]")

            return _EventStream(events(), close)

        token_ids, text, ev = [], "", None
        loop = asyncio.get_running_loop()
        check_at = loop.time() + 0.25
        try:
            while ev is None or ev.finish_reason is None:
                try:  # wait for the next tokens, and look for a client gone every 0.25 s
                    ev = await asyncio.wait_for(job.events.get(), max(0, check_at - loop.time()))
                    token_ids += ev.token_ids
                    text += ev.text
                except TimeoutError:
                    pass
                if loop.time() >= check_at:
                    if await request.is_disconnected():
                        break
                    check_at = loop.time() + 0.25
        finally:
            job.finished = ev is not None and ev.finish_reason is not None
            close()
        if ev is None or ev.finish_reason is None:
            return _error(499, "the client closed the connection", kind="client_closed")
        if ev.finish_reason == "error":
            return _error(500, ev.error or "the engine failed this request", kind="server_error")
        final = choice(Event(token_ids, text, ev.finish_reason), False)
        return {**head, "choices": [final], "usage": usage(len(token_ids))}

    return app


# ------------------------------------------------------------------------------ running it
class ServerThread:
    """Run an app with uvicorn in a background thread on 127.0.0.1 (tests and notebooks):

        with ServerThread(create_app(llm)) as url:
            httpx.get(url + "/health")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 startup_timeout: float = 30.0) -> None:
        import uvicorn
        # IPPROTO_TCP, so asyncio sets TCP_NODELAY on accepted connections (else Nagle holds
        # each small SSE chunk back until the client's delayed ACK: ~40 ms per token)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.startup_timeout = startup_timeout

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m minicb serve`: load a model, start the engine thread, serve HTTP."""
    parser = argparse.ArgumentParser(prog="python -m minicb serve", description=main.__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as `model` (default: --model)")
    parser.add_argument("--policy", default="pd")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests allowed to wait before the server answers 429 (0: no "
                        "limit)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--preemption", default="newest",
                        choices=["newest", "priority", "deadline", "fair"],
                        help="queue order and preemption: newest (first come first served), "
                             "priority (the requests' `priority`, smaller first, as vLLM's), "
                             "deadline (the requests' `deadline`, earliest first) or fair "
                             "(between the requests' `user`s)")
    parser.add_argument("--max-preemptions", type=int, default=None,
                        help="a bound on preemption loss: a request preempted this many times "
                             "comes back holding pages for its whole life and is never "
                             "preempted again (0: reserve every request's whole life)")
    parser.add_argument("--default-max-tokens", type=int, default=None,
                        help="the max_tokens of a chat request that sets none (default: all the "
                             "room its prompt leaves; with --max-preemptions such a request may "
                             "hold pages for all of it, so set this for a shared server)")
    add_full_cache_arguments(parser)
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (CUDA when "
                        "torch sees a GPU)")
    parser.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q], default=None,
                        help="int8: weight-only int8 projections (faster CPU decode, numbers "
                             "slightly off float32)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="speculative decoding by prompt lookup: up to this many guessed "
                             "tokens per decode step (default 0, off)")
    parser.add_argument("--log-level", default="info",  # uvicorn's names (a KeyError else)
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    args = parser.parse_args(argv)
    try:
        check_full_cache_flags(args.preemption_mode, args.num_swap_pages)
    except ValueError as exc:
        parser.error(str(exc))
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 0:  # else every request is refused with a 429
        parser.error(f"--max-queue must be >= 0 (0: no limit), got {args.max_queue}")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        parser.error(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    import uvicorn

    from minicb.llm import LLM

    options = {k: v for k, v in dict(chunk_size=args.chunk_size, num_pages=args.num_pages,
                                     num_speculative_tokens=args.num_speculative_tokens,
                                     max_preemptions=args.max_preemptions,
                                     preemption_mode=args.preemption_mode,
                                     num_swap_pages=args.num_swap_pages)
               .items() if v is not None}
    try:
        llm = LLM(args.model, policy=args.policy, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
                  quantization=args.quantization, preemption=args.preemption,
                  reject_when_full=args.reject_when_full,
                  trace_snapshots=False, **options)  # a server draws no pictures
    except ValueError as exc:  # a bad option or model: say which, no traceback
        parser.error(str(exc))
    name = args.served_model_name or args.model
    app = create_app(llm, name, max_queue=args.max_queue or None,
                     default_max_tokens=args.default_max_tokens)
    if args.max_preemptions is not None and args.default_max_tokens is None:
        print("minicb: note: with --max-preemptions, a chat request without max_tokens may hold "
              "pages for the whole context; --default-max-tokens bounds it", flush=True)
    print(f"minicb: serving {name} (policy {args.policy}) on http://{args.host}:{args.port}/v1",
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
