"""The benchmark client (chapters 06 and 08): send a workload to any OpenAI-compatible server
and measure what a user sees. `python -m minicb bench serve` (`minicb.benchmark.serve`) is its
command line.

Each request leaves at its arrival time (the arrival processes and length distributions of
`minicb.benchmark.workload`) as a streamed call: to `/v1/completions` with token-id prompts, or
to `/v1/chat/completions` with the prompt as text, with `ignore_eos` and a fixed `max_tokens`, so
output lengths are exact on minicb, vLLM and SGLang alike. Times are taken where the user sits:
TTFT when the first token's chunk arrives, ITL between chunks, E2E at the end of the stream.
Each request becomes a `RequestRecord` (the plain data `minicb.benchmark.metrics` reads), with
times in seconds since the run started; queue time and steps are invisible from outside, so
they are left empty."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx

from minicb.benchmark import metrics
from minicb.benchmark.metrics import RequestRecord
from minicb.benchmark.runs import concurrency_declaration, without_slo
from minicb.config import is_positive_int

CLIENT_COLUMNS = (
    ("output_tokens_per_s", "out tok/s", "{:.1f}"),
    ("requests_per_s", "req/s", "{:.2f}"),
    ("ttft_s.p50", "TTFT p50", "{:.3f}"),
    ("ttft_s.p99", "TTFT p99", "{:.3f}"),
    ("itl_s.p50", "ITL p50", "{:.4f}"),
    ("itl_s.p99", "ITL p99", "{:.4f}"),
    ("max_itl_s.p99", "max ITL p99", "{:.3f}"),
    ("tpot_s.p50", "TPOT p50", "{:.4f}"),
    ("e2e_s.p99", "E2E p99", "{:.3f}"),
    ("goodput_rps", "goodput", "{:.2f}"),
    ("cancelled", "cancelled", "{}"),
    ("errors", "errors", "{}"),
)


# the contract's p50/p95/p99 of every latency the client sees (queue time it cannot)
CLIENT_LATENCY_COLUMNS = tuple(c for c in metrics.LATENCY_COLUMNS
                               if not c[0].startswith("queue_s"))


def report(results: dict[str, dict[str, Any]]) -> str:
    """The printed result of a client run (chapter 06): the main table, then p50/p95/p99, then
    the requests a full KV cache turned away and what the server's /metrics said of memory
    pressure, if any."""
    text = (metrics.format_table(results, CLIENT_COLUMNS) + "\n\nlatency percentiles (s)\n"
            + metrics.format_table(results, CLIENT_LATENCY_COLUMNS))
    for name, summary in results.items():
        if summary.get("rejected"):
            text += (f"\n{name}: {summary['rejected']} rejected (HTTP 503 cache_full: the "
                     "server's KV cache could not take them when they arrived)")
        if summary.get("from_server_metrics"):
            text += (f"\n{name}, from the server's /metrics over the run: "
                     + ", ".join(f"{field}={summary[field]}"
                                 for field in summary["from_server_metrics"]))
    return text


# what a replayed trace adds to each request it sends (chapter 06); not workload.TRACE_FIELDS,
# the columns of a trace file
SENT_FIELDS = ("user", "priority", "deadline")


# summary fields only the engine's trace can fill: None from the client's side
ENGINE_ONLY = ("num_steps", "preemptions", "discarded_tokens", "recomputed_tokens",
               "evicted_pages", "swapped_out_pages", "swapped_in_pages", "dead_slot_steps",
               "mean_batch_size", "output_tokens_per_step", "decode_tokens_per_s",
               "host_time_fraction", "cached_prompt_tokens", "prefill_tokens", "decode_tokens",
               "decode_rows", "mixed_steps", "draft_tokens", "accepted_draft_tokens")


# counters a server's Prometheus /metrics may have -> the summary field their growth over a run
# fills (minicb's own, and vLLM's preemptions); the rest of ENGINE_ONLY stays None
SERVER_COUNTERS = {"minicb:steps_total": "num_steps",
                   "minicb:num_preemptions_total": "preemptions",
                   "vllm:num_preemptions_total": "preemptions",
                   "minicb:preemption_discarded_tokens_total": "discarded_tokens",
                   "minicb:preemption_recomputed_tokens_total": "recomputed_tokens",
                   "minicb:kv_pages_evicted_total": "evicted_pages",
                   "minicb:kv_pages_swapped_out_total": "swapped_out_pages",
                   "minicb:kv_pages_swapped_in_total": "swapped_in_pages"}


def server_counters(endpoint: str) -> dict[str, float]:
    """The `SERVER_COUNTERS` fields a server's `/metrics` shows now, each summed over its label
    sets; {} from a server without a Prometheus /metrics."""
    url = httpx.URL(endpoint).copy_with(path="/metrics", query=None)
    try:
        response = httpx.get(url, timeout=10.0)
        response.raise_for_status()
    except httpx.HTTPError:
        return {}
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in SERVER_COUNTERS:  # comments too
            continue
        value_and_time = line[line.rfind("}") + 1:] if "{" in line else line[len(name):]
        try:  # `name{labels} value [timestamp]`
            value = float(value_and_time.split()[0])
        except (ValueError, IndexError):
            continue
        values[SERVER_COUNTERS[name]] = values.get(SERVER_COUNTERS[name], 0.0) + value
    return values


def completions_url(endpoint: str, chat: bool = False) -> str:
    """`http://host:port`, `.../v1` or a full URL ending in `/completions` -> the URL of the
    completions (or chat completions) endpoint."""
    url = endpoint.rstrip("/")
    if url.endswith("/completions"):
        return url
    path = "/chat/completions" if chat else "/completions"
    return url + (path if url.endswith("/v1") else "/v1" + path)


def models_url(endpoint: str) -> str:
    """The server's model list, on the same host."""
    return str(httpx.URL(endpoint).copy_with(path="/v1/models", query=None))


class WarmupFailed(RuntimeError):
    """The server refused the untimed first request (a wrong model name, prompt ids outside
    its vocabulary): nothing is measured."""


def unreachable(endpoint: str, exc: Exception) -> ValueError:
    """What to tell a user whose server did not answer (not running, wrong port or path)."""
    return ValueError(f"cannot reach {endpoint} ({type(exc).__name__}: {exc}); is the server "
                      "running? Start one with `python -m minicb serve --port 8000`")


def _server_error(status: int, body: str) -> str:
    """A refusal in the server's words: the OpenAI error's message, or the start of the body."""
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}: {message or body.strip()[:200]}"


def _is_rejection(status: int, body: str) -> bool:
    """minicb's 503 with code cache_full: its KV cache could not take the prompt
    (`reject_when_full`, chapter 06). A rejection the contract counts, not a failure."""
    if status != 503:  # only then is the body worth parsing
        return False
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == "cache_full"


def error_reasons(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Why the failed requests failed: each distinct message and how many it ended."""
    return dict(Counter(r.error or "unknown" for r in records if r.finish_reason == "error"))


def describe_errors(summary: dict[str, Any]) -> str:
    """One line per reason a request failed (empty when none did), for the CLIs' stderr."""
    reasons = summary.get("error_reasons") or {}
    lines = [f"error: {n} request{'s' * (n > 1)} failed: {why}" for why, n in reasons.items()]
    if any(re.search(rf"\b{name}\b", why) for why in reasons for name in SENT_FIELDS):
        lines.append("(a server that refuses a trace's field: leave it out with --omit-field)")
    return "\n".join(lines)


def _prompt(req: Any, index: int, vocab_size: int | None) -> list[int]:
    ids = req.token_ids(index) if hasattr(req, "token_ids") else list(req.prompt_token_ids)
    return [t % vocab_size for t in ids] if vocab_size else ids


async def _one(client: httpx.AsyncClient, url: str, payload: dict, request_id: str,
               arrival: float, cancel_after: int | None, t0: float, prompt_len: int,
               slots: Any = None) -> RequestRecord:
    """Send one request at `arrival` seconds after `t0`, or later when it must wait for one of
    the client's `slots` (a closed loop), and time its stream from when it was sent."""
    await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
    async with slots or contextlib.nullcontext():
        return await _send(client, url, payload, request_id, cancel_after, t0, prompt_len)


async def _send(client: httpx.AsyncClient, url: str, payload: dict, request_id: str,
                cancel_after: int | None, t0: float, prompt_len: int) -> RequestRecord:
    sent = time.perf_counter() - t0
    token_times: list[float] = []
    num_tokens, finish, usage, error = 0, None, None, None
    try:
        async with client.stream("POST", url, json=payload,
                                 headers={"X-Request-Id": request_id}) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                finish, error = ("rejected", None) if _is_rejection(resp.status_code, body) \
                    else ("error", _server_error(resp.status_code, body))
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        finish = "error"
                        error = _server_error(resp.status_code, data)
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        ids = choice.get("token_ids")
                        n = len(ids) if ids is not None else int(bool(text))
                        if n:
                            token_times.append(time.perf_counter() - t0)
                            num_tokens += n
                        finish = choice.get("finish_reason") or finish
                    # cancel, unless the chunk that reached the count also finished it
                    if cancel_after is not None and num_tokens >= cancel_after and not finish:
                        finish = "cancelled"  # leaving the block closes the connection
                        break
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        finish, error = "error", f"{type(exc).__name__}: {exc}"
    end = time.perf_counter() - t0
    if usage and finish not in ("cancelled", "error"):
        num_tokens = usage.get("completion_tokens", num_tokens)
    return RequestRecord(
        request_id, (usage or {}).get("prompt_tokens", prompt_len), num_tokens,
        {"abort": "cancelled"}.get(finish, finish), sent, None,
        token_times[0] if token_times else None, end, token_times, None, None, None, None, [],
        error=error)


async def run_client(endpoint: str, workload_requests: Sequence[Any], model: str | None = None,
                     temperature: float | None = 0.0, vocab_size: int | None = None,
                     timeout: float = 600.0, progress: bool = False,
                     warmup: bool = True, omit: Sequence[str] = (),
                     max_concurrency: int | None = None, texts: Sequence[str] | None = None,
                     ignore_eos: bool = True, extra: dict[str, Any] | None = None,
                     headers: dict[str, str] | None = None) -> list[RequestRecord]:
    """Send every request (a `WorkloadRequest` or anything with `prompt_token_ids`,
    `max_tokens`, `arrival_time`, `cancel_after_tokens`, `request_id`; a trace's `tenant`,
    `priority` and `deadline` go as `user`, `priority` and `deadline`) at its arrival time,
    streamed, all concurrently; returns one `RequestRecord` per request, in order (chapter 06).
    `model`: the name to send (default: the server's first model). `vocab_size`: fold prompt
    ids into a small vocabulary (tiny test checkpoints). `warmup`: first send one short
    request, untimed (as vLLM's benchmark does): it fails fast on a wrong endpoint and keeps
    first-use costs on both sides out of the first measured request. `omit`: trace fields not to
    send (`"priority"` for a vLLM server started without `--scheduling-policy priority`, which
    refuses a non-zero one). `max_concurrency=N`: a closed loop, as vLLM's `bench serve
    --max-concurrency`: at most N requests in flight; a request due while N are waits for one
    to finish, and its times count from when it is sent. `texts`: each request's prompt as
    text, sent as one user message to the chat endpoint (`endpoint` may name either endpoint in
    full). `temperature` None: not sent (the server's default); `extra`: more request fields;
    `headers`: sent with every request (an API key)."""
    unknown = set(omit) - set(SENT_FIELDS)
    if unknown:
        raise ValueError(f"omit: unknown field(s) {sorted(unknown)}; choose from {SENT_FIELDS}")
    if vocab_size is not None and not is_positive_int(vocab_size):  # ids % -5 are negative
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if max_concurrency is not None and not is_positive_int(max_concurrency):
        raise ValueError(f"max_concurrency must be a positive integer, got {max_concurrency!r}")
    # a closed loop's slots; FIFO, so requests are sent in the order they came due
    slots = None if max_concurrency is None else asyncio.Semaphore(max_concurrency)
    chat = texts is not None
    url = completions_url(endpoint, chat)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits,
                                 headers=headers) as client:
        if model is None:
            listing = await client.get(models_url(endpoint))
            listing.raise_for_status()
            model = listing.json()["data"][0]["id"]
        def prompt(i: int, req: Any) -> dict[str, Any]:
            if chat:
                return {"messages": [{"role": "user", "content": texts[i]}]}
            return {"prompt": _prompt(req, i, vocab_size)}

        if warmup and workload_requests:
            probe = {"model": model, **prompt(0, workload_requests[0]), "max_tokens": 2,
                     "temperature": 0.0, "stream": True}
            async with client.stream("POST", url, json=probe) as resp:
                body = (await resp.aread()).decode(errors="replace")
            if resp.status_code != 200:
                raise WarmupFailed(f"the warm-up request failed ({resp.status_code}): {body}")
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(workload_requests), desc="requests", unit="req")
        t0 = time.perf_counter()

        async def one(i: int, req: Any) -> RequestRecord:
            payload = {"model": model, **prompt(i, req),
                       "max_completion_tokens" if chat else "max_tokens": req.max_tokens,
                       "stream": True, "stream_options": {"include_usage": True},
                       **(extra or {})}
            if ignore_eos:
                payload["ignore_eos"] = True
            if temperature is not None:
                payload["temperature"] = temperature
                if temperature > 0:
                    payload["seed"] = i
            for field, value in (("user", getattr(req, "tenant", None)),  # only when a trace
                                 ("priority", getattr(req, "priority", 0) or None),  # gave one
                                 ("deadline", getattr(req, "deadline", None))):
                if value is not None and field not in omit:
                    payload[field] = value
            record = await _one(client, url, payload, req.request_id or f"req-{i}",
                                req.arrival_time or 0.0, req.cancel_after_tokens, t0,
                                req.prompt_len, slots)
            if bar is not None:
                bar.update(1)
            return record

        try:
            return list(await asyncio.gather(*(one(i, r)
                                               for i, r in enumerate(workload_requests))))
        finally:
            if bar is not None:
                bar.close()


def bench_endpoint(endpoint: str, workload: Any, label: str | None = None,
                   model: str | None = None, vocab_size: int | None = None,
                   temperature: float = 0.0, progress: bool = False,
                   slo: dict[str, float] | None = None,
                   omit: Sequence[str] = (),
                   max_concurrency: int | None = None, **send: Any) -> dict[str, Any]:
    """Run `workload` against a server; returns `{"declaration", "results": {label: summary},
    "records"}` in the results schema of `python -m minicb bench` (chapter 06). The summary is
    `minicb.benchmark.metrics.summarize` over the client's records (no trace: step metrics are
    None, and so is the queue age, which the client cannot see, and so are the fields in
    `ENGINE_ONLY`:
    preemptions, steps, evictions, swapped pages, except those the server's /metrics counts
    (`SERVER_COUNTERS`: their growth over the run, named in `from_server_metrics`); without an
    SLO no goodput, as in bench), with `error_reasons`: each failed request's reason in the
    server's words, and how many (a 503 cache_full is no failure: `rejected` counts it).
    `omit`, `send`: as in `run_client` (`texts`: the chat endpoint)."""
    try:
        if model is None:
            listing = httpx.get(models_url(endpoint), timeout=10.0,
                                headers=send.get("headers"))
            listing.raise_for_status()
            model = listing.json()["data"][0]["id"]
        before = server_counters(endpoint)
        records = asyncio.run(run_client(endpoint, workload.requests, model=model,
                                         temperature=temperature, vocab_size=vocab_size,
                                         progress=progress, omit=omit,
                                         max_concurrency=max_concurrency, **send))
        after = server_counters(endpoint)
    except (httpx.TransportError, httpx.HTTPStatusError) as exc:
        raise unreachable(endpoint, exc) from None
    except WarmupFailed as exc:  # the server's answer to what we sent: a one-line error
        raise ValueError(str(exc)) from None
    declaration = {**workload.declaration, "endpoint": endpoint, "model": model,
                   "measured_at": "client (streamed "
                                  f"{completions_url(endpoint, 'texts' in send)})",
                   "temperature": temperature, "omitted_fields": sorted(omit),
                   "concurrency": concurrency_declaration(max_concurrency),
                   "httpx": httpx.__version__}
    summary = without_slo(metrics.summarize([], records, slo), slo or {})
    summary["error_reasons"] = error_reasons(records)
    if all(r.first_scheduled_time is None for r in records):
        # queue time is invisible from outside: summarize's fallback (the finish time) would
        # report the largest E2E as the oldest wait
        summary["max_queue_age_s"] = summary["max_queue_age_steps"] = None
    for key in ENGINE_ONLY:  # the server knows these; a 0 here would be a guess
        summary[key] = None
    # ... and tells some in its /metrics
    summary["from_server_metrics"] = [key for key in dict.fromkeys(SERVER_COUNTERS.values())
                                      if key in after and key in before]
    for key in summary["from_server_metrics"]:
        summary[key] = round(after[key] - before[key])
    if after:
        declaration["server_metrics"] = ("growth of the server's /metrics counters over the run "
                                         f"({', '.join(sorted(after))}), the warm-up request "
                                         "included; other clients' requests at the same time "
                                         "would count too")
    return {"declaration": declaration, "results": {label or endpoint: summary},
            "records": [r.__dict__ for r in records]}
