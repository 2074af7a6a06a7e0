"""Planted-bug tests from a mutation review of minicb/serving/server.py (the server) and
minicb/serving/client.py (the benchmark client): each test fails on the bug its docstring names and
passes on the real code.

Servers run on the simulated engine where they can (no tokenizer, always answers one token, fast)
and on the tiny Llama with test_serve's word-level tokenizer where text matters; every server
binds a free 127.0.0.1 port (ServerThread's port 0) and every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from contextlib import contextmanager

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from test_serve import (
    GREEDY,
    TIMEOUT,
    hold_adds,
    reference,
    serving,
    sse_chunks,
    wait_idle,
)

from minicb.benchmark.sim import SIM_TOKEN, make_sim_engine
from minicb.benchmark.workload import Workload, WorkloadRequest
from minicb.serving.client import bench_endpoint, completions_url, models_url, run_client
from minicb.serving.server import (
    EngineWorker,
    InvalidRequest,
    ServerThread,
    create_app,
    parse_request,
)

T = SIM_TOKEN  # the simulated model's only answer: a prompt of T's keeps every guess


@contextmanager
def sim_server(max_queue=64, **options):
    """A server on the simulated engine; yields (url, worker, engine, http)."""
    engine = make_sim_engine(policy="pd", **options)
    app = create_app(engine, "sim", max_queue=max_queue)
    with ServerThread(app) as url, httpx.Client(timeout=TIMEOUT) as http:
        yield url, app.state.worker, engine, http


def metric_values(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                     if line and not line.startswith("#"))}


# ------------------------------------------------------------------------------ /metrics
def test_metrics_gauges_show_their_own_stat_and_counters_are_typed_counter():
    """Planted: the waiting gauge showed `num_running`; the free-pages gauge showed total minus
    used (cached pages counted as free); the counters were typed `gauge`; the `error` finish
    reason was missing from minicb_requests_total until some request failed. The swap space's
    gauges and counters and the deadline and rejected reasons (chapter 06) likewise."""
    worker = EngineWorker(make_sim_engine(policy="pd"))  # never started: the snapshot stays
    worker.snapshot = dict(num_waiting=1, num_running=2, pages_used=3, pages_free=4,
                           pages_cached=5, pages_total=12, swap_pages_free=6,
                           swap_pages_total=7)
    lines = worker.metrics_text("sim").splitlines()
    for name, value in (("num_requests_waiting", 1), ("num_requests_running", 2),
                        ("kv_pages_used", 3), ("kv_pages_free", 4), ("kv_pages_cached", 5),
                        ("kv_pages_total", 12), ("kv_swap_pages_free", 6),
                        ("kv_swap_pages_total", 7)):
        assert f"minicb_{name} {value}" in lines and f"# TYPE minicb_{name} gauge" in lines
    for name in ("num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "steps_total", "requests_total", "preemption_discarded_tokens_total",
                 "preemption_recomputed_tokens_total", "kv_pages_evicted_total",
                 "kv_pages_swapped_out_total", "kv_pages_swapped_in_total"):
        assert f"# TYPE minicb_{name} counter" in lines
    for reason in ("stop", "length", "cancelled", "error", "deadline", "rejected"):
        assert f'minicb_requests_total{{finish_reason="{reason}"}} 0' in lines


def test_metrics_count_prompt_tokens_steps_and_the_whole_gap_of_a_speculative_step():
    """Planted: prompt_tokens_total counted requests (`+= 1`), steps_total was never
    incremented, and the ITL of a step that kept guesses was measured from the step's
    second-to-last token (a gap of 0) instead of the previous delivery."""
    with sim_server(num_speculative_tokens=3) as (url, worker, engine, http):
        for prompt in ([T] * 8, [T] * 5):
            body = {"prompt": prompt, "max_tokens": 25, **GREEDY}
            assert http.post(url + "/v1/completions", json=body).status_code == 200
        wait_idle(worker)
        steps, records = worker.call(lambda e: (len(e.trace), e.request_records())).result(10)
        values = metric_values(http.get(url + "/metrics").text)
    assert values["minicb_prompt_tokens_total"] == 13
    assert values["minicb_steps_total"] == steps > 0
    assert values["minicb_generation_tokens_total"] == 50
    gaps = sum(r.token_times[-1] - r.first_token_time for r in records)  # deliveries' gaps
    assert gaps > 0
    assert values["minicb_inter_token_latency_seconds_sum"] == pytest.approx(gaps)


# ------------------------------------------------------------------------------ responses
def test_a_speculative_stream_reports_usage_in_tokens_and_openai_chunk_fields():
    """Planted: the streamed usage counted chunks (`n += 1`) not tokens, so a step that kept
    guesses under-reported completion_tokens; `"usage": null` was missing from the chunks
    before the usage chunk (include_usage); a completion's object was "completion", not
    "text_completion"."""
    body = {"prompt": [T] * 8, "max_tokens": 25, "stream": True,
            "stream_options": {"include_usage": True}, **GREEDY}
    with sim_server(num_speculative_tokens=3) as (url, _, _, http):
        with http.stream("POST", url + "/v1/completions", json=body) as r:
            chunks = sse_chunks(r)
        plain = http.post(url + "/v1/completions", json={**body, "stream": False}).json()
    *streamed, last = chunks
    assert sum(len(c["choices"][0]["token_ids"]) for c in streamed) == 25 > len(streamed)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 25
    assert all("usage" in c and c["usage"] is None for c in streamed)
    for out in (*chunks, plain):
        assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")


def test_a_request_the_engine_cancels_while_its_client_listens_ends_with_abort():
    """Planted: finish_reason "cancelled" went out as is; OpenAI servers (vLLM) say "abort".
    A request cancelled in the engine (here through worker.call) while another keeps the
    engine stepping."""
    async def run(url, worker):
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            body = {"prompt": [5, 6, 7], "max_tokens": 5000, "stream": True, **GREEDY}
            async with http.stream("POST", url + "/v1/completions", json=body,
                                   headers={"X-Request-Id": "keeper"}) as keeper, \
                    http.stream("POST", url + "/v1/completions", json=body,
                                headers={"X-Request-Id": "victim"}) as victim:
                lines = victim.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass
                worker.call(lambda e: e.cancel("victim"))
                events = [json.loads(line[6:]) async for line in lines
                          if line.startswith("data: {")]
                await keeper.aclose()
            return events

    with sim_server() as (url, worker, _, _):
        events = asyncio.run(asyncio.wait_for(run(url, worker), 30))
        wait_idle(worker)
    assert events[-1]["choices"][0]["finish_reason"] == "abort"


def test_the_only_request_cancelled_in_the_engine_ends_its_stream_at_once():
    """Found in the review, fixed: cancelled through worker.call while no other request ran,
    its stream waited for the next request's step (no step came, so no record told it)."""
    def cancel(engine, rid, then):
        engine.cancel(rid)
        for method in then:
            getattr(engine, method)(rid)

    async def run(url, worker, then):
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            body = {"prompt": [5, 6, 7], "max_tokens": 5000, "stream": True, **GREEDY}
            rid = f"only{len(then)}"
            async with http.stream("POST", url + "/v1/completions", json=body,
                                   headers={"X-Request-Id": rid}) as only:
                lines = only.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass
                worker.call(lambda e: cancel(e, rid, then))
                return [json.loads(line[6:]) async for line in lines
                        if line.startswith("data: {")]

    with sim_server() as (url, worker, _, http):
        events = asyncio.run(asyncio.wait_for(run(url, worker, ()), 10))
        wait_idle(worker)
        assert worker.call(lambda e: (e.requests["only0"].finish_reason, e.stats()["pages_used"])
                           ).result(10) == ("cancelled", 0)
        # a command that also forgets it: the stream still ends, and the server goes on
        events_forgotten = asyncio.run(asyncio.wait_for(run(url, worker, ("forget",)), 10))
        wait_idle(worker)
        assert worker.last_error is None
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    assert events_forgotten[-1]["choices"][0]["finish_reason"] == "abort"


def test_a_full_queue_says_when_to_retry_and_a_server_fault_is_a_500():
    """Planted: the 429 of a full queue lost its Retry-After header; an unexpected exception
    in a handler was answered 400 invalid_request_error instead of 500 server_error."""
    with sim_server(max_queue=0) as (url, worker, _, http):  # 0 waiting allowed: all refused
        r = http.post(url + "/v1/completions", json={"prompt": [T], "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"

        async def broken(*args, **kwargs):
            raise RuntimeError("a bug")
        worker.submit = broken
        r = http.post(url + "/v1/completions", json={"prompt": [T], "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert r.json()["error"]["message"] == "RuntimeError: a bug"


def test_health_models_and_chat_without_a_template():
    """Planted: /health said ok after the engine thread had stopped (it must answer 503);
    /v1/models lost max_model_len; a chat request to a model without a chat template was
    refused without the hint to use /v1/completions (the up-front check dropped: the template
    call failed instead)."""
    with sim_server() as (url, worker, _, http):
        assert http.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 8192
        r = http.post(url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "use /v1/completions" in r.json()["error"]["message"]
        assert http.get(url + "/health").status_code == 200
        worker.stop()
        r = http.get(url + "/health")
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_a_prompt_that_cannot_fit_is_context_length_exceeded():
    """Planted: the engine's refusal of a prompt beyond the context lost its OpenAI code
    `context_length_exceeded`."""
    with sim_server() as (url, _, _, http):
        r = http.post(url + "/v1/completions", json={"prompt": [T] * 8190, "max_tokens": 16})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_finished_and_disconnected_requests_leave_no_stream_behind():
    """Planted: _emit no longer dropped a finished request's stream, and _cancel no longer
    dropped a cancelled one: a long-running server's `_streams` grew with every request."""
    with sim_server() as (url, worker, _, http):
        assert http.post(url + "/v1/completions",
                         json={"prompt": [T], "max_tokens": 3}).status_code == 200
        with http.stream("POST", url + "/v1/completions",
                         json={"prompt": [T], "max_tokens": 5000, "stream": True}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
        deadline = time.monotonic() + 10
        while worker.call(lambda e: bool(worker._streams) or e.has_unfinished()).result(10):
            assert time.monotonic() < deadline, worker._streams
            time.sleep(0.01)


def test_a_submit_cancelled_while_the_engine_adds_it_is_cancelled_in_a_live_loop():
    """Planted: submit no longer cancelled the request its cancelled caller left behind (the
    done-callback dropped). test_serve's version closes its event loop at once, and then the
    engine thread's failed send cancels the request anyway; a server's loop stays open, so the
    request ran to its end for nobody."""
    worker = EngineWorker(make_sim_engine(policy="pd"))

    async def main():
        adding, release = hold_adds(worker)
        task = asyncio.create_task(worker.submit([T, T], dict(max_tokens=3000, **GREEDY),
                                                 request_id="late"))
        await asyncio.get_running_loop().run_in_executor(None, adding.wait, 10)
        task.cancel()  # while the engine thread adds it
        with contextlib.suppress(asyncio.CancelledError):
            await task
        del worker._add
        release.set()
        deadline = time.monotonic() + 10
        while True:  # the loop stays open while the engine finishes the request
            reason = await asyncio.wrap_future(worker.call(
                lambda e: e.requests["late"].finish_reason if "late" in e.requests else None))
            if reason is not None or time.monotonic() > deadline:
                return reason
            await asyncio.sleep(0.01)

    try:
        reason = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        worker.stop()
    assert reason == "cancelled"


# ------------------------------------------------------------------------------ parse_request
@pytest.mark.parametrize("body, param", [
    ({"n": 0}, "n"),
    ({"echo": True}, "echo"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": "usage"}, "stream_options"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["w5", ""]}, "stop"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_parse_request_refuses_each_bad_field(body, param):
    """Planted, one each: n=0 let through (`> 1` for `!= 1`); echo let through; a non-bool
    stream, stream_options not an object, a temperature above 2, a top_k below -1, an empty
    stop string (it matches at once: every answer empty), a non-bool ignore_eos."""
    with pytest.raises(InvalidRequest) as info:
        parse_request({"prompt": [5, 6], **body}, chat=False)
    assert info.value.param == param


def test_logprobs_0_is_refused_and_false_or_null_is_not_a_request_for_logprobs():
    """A real bug found by this review (the planted `if body.get("logprobs"):` showed it):
    `logprobs not in (None, False)` let logprobs=0 through, since 0 == False, and answered
    `"logprobs": null`; OpenAI's completions API returns the chosen tokens' logprobs for 0."""
    with pytest.raises(InvalidRequest) as info:
        parse_request({"prompt": [5], "logprobs": 0}, chat=False)
    assert info.value.param == "logprobs"
    for absent in (None, False):
        assert parse_request({"prompt": [5], "logprobs": absent}, chat=False)["prompt"] == [5]
        chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": absent}
        assert parse_request(chat, chat=True)["messages"] == chat["messages"]


def test_parse_request_defaults_batches_and_merges_stop_ids():
    """Planted: /v1/completions lost its default max_tokens of 16 (OpenAI's); chat's default
    became 16 instead of the room left; a batch of one prompt (["..."] or [[ids]]) was refused;
    token ids given as `stop` replaced stop_token_ids instead of joining them."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_request({"prompt": [5]}, chat=False)["params"]["max_tokens"] == 16
    assert parse_request(chat, chat=True)["params"]["max_tokens"] is None
    assert parse_request({**chat, "max_tokens": 7}, chat=True)["params"]["max_tokens"] == 7
    assert parse_request({"prompt": [[5, 6]]}, chat=False)["prompt"] == [5, 6]
    assert parse_request({"prompt": ["w5 w6"]}, chat=False)["prompt"] == "w5 w6"
    req = parse_request({"prompt": [5], "stop": [3], "stop_token_ids": [7]}, chat=False)
    assert req["params"]["stop_token_ids"] == (7, 3) and req["stop"] == ()


# ------------------------------------------------------------------------------ chat and stop
def test_chat_without_max_tokens_fills_the_pool_and_has_chat_ids(word_model):
    """Planted: chat's default max_tokens ignored the page pool (max_model_len minus the
    prompt: a request that can never fit, refused); a chat answer's id began "cmpl-", not
    "chatcmpl-"."""
    body = {"messages": [{"role": "user", "content": "w40 w41"}], **GREEDY}
    with serving(word_model, num_pages=4) as (url, worker), \
            httpx.Client(timeout=TIMEOUT) as http:
        capacity = worker.capacity
        out = http.post(url + "/v1/chat/completions", json=body).json()
        with http.stream("POST", url + "/v1/chat/completions",
                         json={**body, "max_tokens": 2, "stream": True}) as r:
            chunks = sse_chunks(r)
    assert capacity == 64 < worker.max_model_len
    usage = out["usage"]
    assert usage["completion_tokens"] == capacity - usage["prompt_tokens"]
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["id"].startswith("chatcmpl-")
    assert all(c["id"].startswith("chatcmpl-") and c["object"] == "chat.completion.chunk"
               for c in chunks)


@pytest.fixture(scope="module")
def word_text(word_model):
    """The greedy answer to "w5 w6 w7": (text, words)."""
    ref = reference(word_model, ["w5 w6 w7"], 12)[0]
    return ref.text, ref.text.split()


def _complete(http, url, body):
    """(text, finish_reason) of a request, not streamed and streamed."""
    out = http.post(url + "/v1/completions", json=body).json()["choices"][0]
    with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        chunks = sse_chunks(r)
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    return [(out["text"], out["finish_reason"]),
            (streamed, chunks[-1]["choices"][0]["finish_reason"])]


def test_a_stop_string_across_two_tokens_stops_and_is_never_streamed(word_model,
                                                                      word_text):
    """Planted: the stop-string search began at the new text only (`start = searched`), so a
    stop string across two tokens was missed; the stream sent text that might begin a stop
    string (`end = len(s.text)`, nothing held back), so the part in the first token went out
    before the stop was seen."""
    text, words = word_text
    stop = f"{words[3][-1]} {words[4]}"  # the last character of one word, then the next word
    at = text.find(stop)
    assert at == text.find(f"{words[3]} {words[4]}") + len(words[3]) - 1
    body = {"prompt": "w5 w6 w7", "max_tokens": 12, "stop": [stop], **GREEDY}
    with serving(word_model) as (url, _), httpx.Client(timeout=TIMEOUT) as http:
        answers = _complete(http, url, body)
    assert answers == [(text[:at], "stop")] * 2


def test_overlapping_stop_strings_cut_at_the_first_and_min_tokens_counts_its_own(
        word_model, word_text):
    """Planted: the text was cut at the last stop string found in a step (`max(hits)`), not
    the first; a stop string in the token that reaches min_tokens was ignored (`>` for
    `>=`: vLLM looks from min_tokens on)."""
    text, words = word_text
    k = next(i for i, w in enumerate(words)  # a word whose tail is first found in it
             if i >= 2 and text.find(w[1:]) == text.find(w) + 1)
    at = text.find(words[k])
    # a word found once in the text, even inside another word: only its own token can stop
    j = max(i for i in range(1, len(words)) if text.count(words[i]) == 1)
    stop_at = text.find(words[j])
    with serving(word_model) as (url, _), httpx.Client(timeout=TIMEOUT) as http:
        both = _complete(http, url, {"prompt": "w5 w6 w7", "max_tokens": 12,
                                     "stop": [words[k][1:], words[k]], **GREEDY})
        exact = _complete(http, url, {"prompt": "w5 w6 w7", "max_tokens": 12,
                                      "stop": [words[j]], "min_tokens": j + 1, **GREEDY})
    assert both == [(text[:at], "stop")] * 2
    assert exact == [(text[:stop_at], "stop")] * 2


# ------------------------------------------------------------------------------ the client
def _fake(*chunks, delay_after=None, seen=None, refuse=None):
    """A completions server that streams `chunks` (dicts, or raw SSE data strings) to every
    request, sleeping `delay_after` seconds before its final [DONE]; records each body in
    `seen`; answers 400 to a body for which `refuse(body)` holds."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if seen is not None:
            seen.append(body)
        if refuse is not None and refuse(body):
            return JSONResponse({"error": {"message": "no"}}, 400)

        async def stream():
            for c in chunks:
                yield c if isinstance(c, str) and c.startswith("data:") else \
                    f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n"
            if delay_after:
                await asyncio.sleep(delay_after)
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")
    return app


def _chunk(ids, finish=None, **extra):
    return {"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": finish}],
            **extra}


def _run(app, requests, **kw):
    with ServerThread(app) as url:
        return asyncio.run(asyncio.wait_for(run_client(url, requests, model="m",
                                                       warmup=kw.pop("warmup", False), **kw),
                                            30))


ONE = [WorkloadRequest(prompt_len=4, max_tokens=4)]


def test_the_client_counts_tokens_of_multi_token_chunks_and_stamps_only_chunks_with_tokens():
    """Planted: a chunk counted as one token whatever its token_ids (a speculating server's
    kept guesses lost; no usage chunk to correct it); a chunk without tokens (the finish) got
    a token time, a false gap in ITL."""
    records = _run(_fake(_chunk([1, 2, 3]), _chunk([4]), _chunk([], "length")), ONE)
    r = records[0]
    assert (r.num_output_tokens, len(r.token_times), r.finish_reason) == (4, 2, "length")


def test_the_client_maps_abort_and_survives_a_bad_chunk():
    """Planted: a server's finish_reason "abort" (vLLM) was recorded as is, not as
    "cancelled"; a chunk that is not JSON escaped as an exception that ended the whole run
    instead of failing that request."""
    aborted = _run(_fake(_chunk([1]), _chunk([2], "abort")), ONE)
    assert aborted[0].finish_reason == "cancelled"
    broken = _run(_fake(_chunk([1]), "{not json"), ONE)
    assert broken[0].finish_reason == "error"
    assert broken[0].error.startswith("JSONDecodeError")


def test_the_client_reads_data_lines_without_a_space():
    """Planted: only "data: " lines were read; SSE allows "data:" with no space."""
    chunks = [f"data:{json.dumps(_chunk([1]))}\n\n",
              f"data:{json.dumps(_chunk([2], 'length'))}\n\n"]
    records = _run(_fake(*chunks), ONE)
    assert (records[0].num_output_tokens, records[0].finish_reason) == (2, "length")


def test_the_client_ends_e2e_at_the_end_of_the_stream():
    """Planted: E2E ended at the last token's chunk, not when the stream ended (the usage
    chunk and [DONE] come after it, and a user waits for them)."""
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1,
                                      "total_tokens": 5}}
    r = _run(_fake(_chunk([1], "length"), usage, delay_after=0.3), ONE)[0]
    assert r.finish_time - r.token_times[-1] >= 0.25


def test_the_client_sends_the_sampling_fields_and_keeps_the_servers_counts():
    """Planted: the client stopped sending its temperature (always 0), the per-request seed
    when sampling, and stream_options.include_usage; folded prompt ids into vocab_size - 1;
    recorded its own prompt length instead of the server's usage.prompt_tokens."""
    seen = []
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1,
                                      "total_tokens": 10}}
    requests = [WorkloadRequest(prompt_len=40, max_tokens=1) for _ in range(2)]
    records = _run(_fake(_chunk([1], "length"), usage, seen=seen), requests,
                   temperature=0.7, vocab_size=50)
    assert sorted(b["seed"] for b in seen) == [0, 1]  # sent concurrently: in either order
    for body in seen:
        i = body["seed"]
        req = requests[i]
        assert body["temperature"] == 0.7 and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["prompt"] == [t % 50 for t in req.token_ids(i)]
        assert max(req.token_ids(i)) >= 50  # the fold did something
    assert [r.num_prompt_tokens for r in records] == [9, 9]


def test_the_client_waits_for_each_arrival_and_a_failed_warm_up_stops_it():
    """Planted: arrival times were ignored (every request sent at once); a failed warm-up
    request was printed and the run went on (it must raise before anything is measured)."""
    requests = [WorkloadRequest(prompt_len=4, max_tokens=1, arrival_time=t) for t in (0, 0.3)]
    records = _run(_fake(_chunk([1], "length")), requests)
    assert records[1].arrival_time >= 0.29  # seconds since the run started
    with pytest.raises(RuntimeError, match="warm-up request failed"):
        _run(_fake(_chunk([1], "length"), refuse=lambda body: True), requests, warmup=True)


def test_bench_endpoint_reports_no_queue_age_when_requests_failed():
    """Planted: bench_endpoint's override of the queue age dropped: a request that failed
    before its first token has no first_token_time, so summarize counts its whole E2E as a
    queue wait the client never saw."""
    refuse = lambda body: body["max_tokens"] != 2  # noqa: E731 - the warm-up probe passes
    workload = Workload("t", [WorkloadRequest(prompt_len=4, max_tokens=3)] * 2)
    with ServerThread(_fake(_chunk([1], "length"), refuse=refuse)) as url:
        summary = bench_endpoint(url, workload, label="x", model="m")["results"]["x"]
    assert summary["errors"] == 2
    assert summary["max_queue_age_s"] is None and summary["max_queue_age_steps"] is None


def test_completion_and_model_urls_from_any_endpoint_form():
    """Planted: a full .../v1/completions endpoint got a second path appended; the models URL
    of a .../v1 endpoint became .../v1/v1/models."""
    for endpoint in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/",
                     "http://h:1/v1/completions"):
        assert completions_url(endpoint) == "http://h:1/v1/completions"
        assert models_url(endpoint) == "http://h:1/v1/models"
