"""The OpenAI-compatible server and the benchmark client (chapters 06 and 08), on loopback only.

Every server runs uvicorn in a background thread on a free 127.0.0.1 port; every wait is bounded.
Answers are compared token for token (the `token_ids` extra field) with `LLM.generate`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from helpers import rec
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from tiny_models import guessable_model, three_in_six

from minicb import LLM, Engine, SamplingParams
from minicb.__main__ import main as main_cli
from minicb.benchmark import metrics
from minicb.benchmark.serve import serve_parser
from minicb.benchmark.sim import SIM_TOKEN, make_sim_engine
from minicb.benchmark.workload import Workload, WorkloadRequest, make_workload
from minicb.llm import IncrementalDecoder
from minicb.serving import client
from minicb.serving.client import bench_endpoint, completions_url, models_url, run_client
from minicb.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    logprobs_wanted,
    sampling_params,
    stop_text,
    validation_error,
)
from minicb.serving.server import ServerThread, create_app, main
from minicb.serving.worker import EngineWorker

GREEDY = dict(temperature=0.0, ignore_eos=True)
TIMEOUT = httpx.Timeout(20.0)


def hold_adds(worker) -> tuple[threading.Event, threading.Event]:
    """Make `worker`'s engine thread stop inside its next add until `release` is set; `adding`
    is set when it gets there (to cancel a submit while the engine is adding it)."""
    real_add, adding, release = worker._add, threading.Event(), threading.Event()

    def slow_add(*args):
        adding.set()
        release.wait(10)
        return real_add(*args)
    worker._add = slow_add
    return adding, release


@pytest.fixture(scope="module")
def byte_model(tiny_model):
    """The tiny Llama with a byte-level tokenizer: token i is byte i, so its outputs decode to
    multi-byte characters split across tokens, and to broken UTF-8."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model, info = tiny_model
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's byte alphabet
    others = [b for b in range(256) if b not in printable]
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
    raw = Tokenizer(models.BPE({char[b]: b for b in range(256)}, []))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    return model, dataclasses.replace(info, tokenizer=PreTrainedTokenizerFast(
        tokenizer_object=raw))


class CountingTokenizer:
    """A tokenizer that counts the tokens it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@contextmanager
def serving(model, max_queue=64, **options):
    """Start a server on `model`; yields (url, worker). The worker's pages must all be free
    at the end."""
    options = {"policy": "pd", "num_pages": 256, "check_invariants": True, **options}
    app = create_app(Engine(model, **options), "tiny", max_queue=max_queue)
    with ServerThread(app) as url:
        yield url, app.state.worker
        wait_idle(app.state.worker)
        stats = app.state.worker.call(lambda e: e.stats()).result(10)
        assert stats["pages_used"] == 0 and stats["num_running"] == 0, stats


def wait_idle(worker, timeout=10.0):
    """Wait (bounded) until the engine has nothing left: a client that hung up is cancelled
    when the server notices, a moment after the client returns."""
    deadline = time.monotonic() + timeout
    while worker.call(lambda e: e.has_unfinished()).result(timeout):
        assert time.monotonic() < deadline, "the engine still has unfinished requests"
        time.sleep(0.01)


def reference(model, prompts, max_tokens, **params):
    llm = LLM(model, policy="continuous", num_pages=256)
    sp = SamplingParams(max_tokens=max_tokens, **{**GREEDY, **params})
    return llm.generate(prompts, sp, use_tqdm=False)


def metric_values(text: str | bytes) -> dict[str, float]:
    """/metrics' samples: `name` or `name{label="value",...}` (model_name left out) -> value."""
    out = {}
    text = text if isinstance(text, str) else text.decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())
                              if k != "model_name")
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def finished(text: str | bytes, reason: str) -> float:
    """/metrics' count of requests finished for `reason`."""
    return metric_values(text)[f'minicb:request_success_total{{finished_reason="{reason}"}}']


def sse_chunks(response) -> list[dict]:
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_answers_equal_generate_streaming_or_not(tiny_model):
    """Completions, streamed or not, greedy or seeded, return the tokens generate returns, one
    stream chunk per token plus the usage chunk, and the metrics count every request and token
    with nothing left running."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], list(range(20, 60))]
    refs = reference(tiny_model, prompts, 12)
    seeded = reference(tiny_model, prompts[:1], 12, temperature=0.8, seed=7)[0].token_ids
    with serving(tiny_model) as (url, worker), httpx.Client(timeout=TIMEOUT) as http:
        assert http.get(url + "/health").json() == {"status": "ok"}
        assert http.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
        for prompt, ref in zip(prompts, refs):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, **GREEDY}
            out = http.post(url + "/v1/completions", json=body).json()
            choice = out["choices"][0]
            assert choice["token_ids"] == ref.token_ids and choice["finish_reason"] == "length"
            assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12,
                                    "total_tokens": len(prompt) + 12}
            body.update(stream=True, stream_options={"include_usage": True})
            with http.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                chunks = sse_chunks(r)
            ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
            assert ids == ref.token_ids
            assert len(chunks) == 13, "one chunk per generated token, then the usage chunk"
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
            assert chunks[-1]["usage"]["completion_tokens"] == 12
        body = {"prompt": prompts[0], "max_tokens": 12, "temperature": 0.8, "seed": 7,
                "ignore_eos": True}
        assert http.post(url + "/v1/completions", json=body).json()["choices"][0][
            "token_ids"] == seeded
        metrics = http.get(url + "/metrics").text
        assert finished(metrics, "length") == 7
        assert metric_values(metrics)["minicb:time_to_first_token_seconds_count"] == 7
        assert metric_values(metrics)["minicb:inter_token_latency_seconds_count"] == 77
        values = metric_values(metrics)
        assert values["minicb:kv_pages_used"] == values["minicb:num_requests_running"] == 0


def test_a_text_prompt_gets_the_tokenizers_bos_and_a_chat_gets_only_its_templates(tiny_model):
    """A Llama-style tokenizer adds BOS to a text, as transformers' `tok(text)` and vLLM
    feed it, so the tokens match theirs; a chat template writes BOS itself, so a rendered chat
    is encoded without special tokens (one BOS, not two). LLM and server alike."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    model, info = tiny_model
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    tok.chat_template = "<s>{% for m in messages %}{{ m['content'] }} {% endfor %}w9"
    bos_model = (model, dataclasses.replace(info, tokenizer=tok))
    llm = LLM(bos_model, num_pages=256)
    params = SamplingParams(max_tokens=2, **GREEDY)
    assert llm.generate("w5 w6", params, use_tqdm=False)[0].prompt_token_ids == [1, 5, 6]
    chat = [{"role": "user", "content": "w40 w41"}]
    assert llm.apply_chat_template(chat) == [1, 40, 41, 9]
    with serving(bos_model) as (url, _), httpx.Client(timeout=TIMEOUT) as http:
        body = {"prompt": "w5 w6", "max_tokens": 2, **GREEDY}
        usage = http.post(url + "/v1/completions", json=body).json()["usage"]
        assert usage["prompt_tokens"] == 3
        body = {"messages": chat, "max_tokens": 2, **GREEDY}
        usage = http.post(url + "/v1/chat/completions", json=body).json()["usage"]
        assert usage["prompt_tokens"] == 4


def test_text_prompts_stop_strings_and_chat(word_model):
    """A text prompt returns generate's text; a stop string ends the request in the engine and cuts
    the text before it, streamed or not; chat returns the chat template's answer, streamed as
    role then content."""
    tok = word_model[1].tokenizer
    ref = reference(word_model, ["w5 w6 w7"], 12)[0]
    words = ref.text.split()
    stop = words[4]
    expected = ref.text[:ref.text.find(stop)]
    chat_ref = LLM(word_model, num_pages=256).chat([{"role": "user", "content": "w40 w41"}],
                                                   SamplingParams(max_tokens=8, **GREEDY),
                                                   use_tqdm=False)[0]
    with serving(word_model) as (url, worker), httpx.Client(timeout=TIMEOUT) as http:
        body = {"prompt": "w5 w6 w7", "max_tokens": 12, **GREEDY}
        out = http.post(url + "/v1/completions", json=body).json()["choices"][0]
        assert out["text"] == ref.text and out["token_ids"] == ref.token_ids
        for stream in (False, True):
            body = {"prompt": "w5 w6 w7", "max_tokens": 12, "stop": [stop, "nowhere"],
                    "stream": stream, **GREEDY}
            headers = {"X-Request-Id": f"stop-{stream}"}
            if stream:
                with http.stream("POST", url + "/v1/completions", json=body,
                                 headers=headers) as r:
                    chunks = sse_chunks(r)
                text = "".join(c["choices"][0]["text"] for c in chunks)
                reason = chunks[-1]["choices"][0]["finish_reason"]
            else:
                out = http.post(url + "/v1/completions", json=body, headers=headers).json()
                text, reason = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
            assert (text, reason) == (expected, "stop"), "text truncated before the stop string"
        engine_reasons = worker.call(
            lambda e: [e.requests[f"stop-{s}"].finish_reason for s in (False, True)]).result(10)
        assert engine_reasons == ["stop"] * 2, "a stop string ends the request in the engine"
        body = {"messages": [{"role": "user", "content": "w40 w41"}], "max_tokens": 8, **GREEDY}
        out = http.post(url + "/v1/chat/completions", json=body).json()
        assert out["object"] == "chat.completion"
        assert out["choices"][0]["message"] == {"role": "assistant", "content": chat_ref.text}
        assert out["usage"]["prompt_tokens"] == len(tok.encode("w40 w41 w9"))
        with http.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) \
                as r:
            chunks = sse_chunks(r)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
            chat_ref.text
        assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == \
            chat_ref.token_ids


def test_fifty_concurrent_streams_are_batched_and_leak_nothing(tiny_model):
    """Fifty concurrent streams each get the tokens generate gives, and at least twenty of them
    share a step."""
    prompts = [[(7 * i + j) % 250 + 3 for j in range(4 + i % 13)] for i in range(50)]
    refs = reference(tiny_model, prompts, 16)

    async def clients(url):
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            async def one(i):
                body = {"prompt": prompts[i], "max_tokens": 16, "stream": True, **GREEDY}
                ids = []
                async with http.stream("POST", url + "/v1/completions", json=body,
                                       headers={"X-Request-Id": f"c{i}"}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            ids += json.loads(line[6:])["choices"][0]["token_ids"]
                return ids
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(50))), 60)

    with serving(tiny_model, max_num_seqs=64, max_num_batched_tokens=1024) as (url, worker):
        answers = asyncio.run(clients(url))
        trace = worker.call(lambda e: list(e.trace)).result(10)
    assert answers == [r.token_ids for r in refs], "every request answered, as generate would"
    widest = max(len(s.members) for s in trace)
    assert widest >= 20, f"requests from many clients share steps (widest step: {widest})"


def test_a_long_running_server_keeps_only_recent_finished_requests(tiny_model):
    """The server keeps only the last max_finished finished requests; a forgotten id can be used
    again, and the metrics still count every request."""
    app = create_app(Engine(tiny_model, policy="pd", num_pages=64), "tiny", max_finished=3)
    with ServerThread(app) as url, httpx.Client(timeout=TIMEOUT) as http:
        for i in range(7):
            body = {"prompt": [5 + i, 6, 7], "max_tokens": 2, **GREEDY}
            r = http.post(url + "/v1/completions", json=body, headers={"X-Request-Id": f"r{i}"})
            assert r.status_code == 200
        worker = app.state.worker
        wait_idle(worker)
        kept = worker.call(lambda e: sorted(e.requests)).result(10)
        assert kept == ["r4", "r5", "r6"], "the oldest finished requests were forgotten"
        # a forgotten id is free again, and the counters still count every request
        r = http.post(url + "/v1/completions", json={"prompt": [9, 9], "max_tokens": 1, **GREEDY},
                      headers={"X-Request-Id": "r0"})
        assert r.status_code == 200 and r.json()["id"].endswith("r0")
        values = metric_values(http.get(url + "/metrics").text)
        assert values['minicb:request_success_total{finished_reason="length"}'] == 8


def test_disconnect_mid_stream_cancels_and_frees_pages(tiny_model):
    """A client that disconnects mid-stream, or gives up while queued, has its request cancelled and
    its pages freed, and the metrics count both as cancelled."""
    body = {"prompt": list(range(3, 40)), "max_tokens": 1800, **GREEDY}
    with serving(tiny_model, max_num_seqs=1) as (url, worker), \
            httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                         headers={"X-Request-Id": "leaver"}) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            with pytest.raises(httpx.ReadTimeout):  # queued behind it, a client gives up
                http.post(url + "/v1/completions", json=body, timeout=0.3,
                          headers={"X-Request-Id": "waiter"})
        # leaving the block closed the stream's connection mid-stream
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done = worker.call(lambda e: {rid: (e.requests[rid].finish_reason,
                                                len(e.requests[rid].output_token_ids))
                                          for rid in ("leaver", "waiter")}).result(10)
            if all(reason for reason, _ in done.values()):
                break
            time.sleep(0.02)
        assert all(reason == "cancelled" and n < 1800 for reason, n in done.values()), done
        stats = worker.call(lambda e: e.stats()).result(10)
        assert stats["pages_used"] == 0 and stats["num_running"] == 0
        values = metric_values(http.get(url + "/metrics").text)
        assert values['minicb:request_success_total{finished_reason="cancelled"}'] == 2


@pytest.fixture(scope="module")
def shared_server(tiny_model):
    with serving(tiny_model, num_pages=32) as (url, _):
        yield url


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": [5, 6], "temperature": -1}, 400, "temperature"),
    ({"prompt": [5, 6], "top_p": 1.5}, 400, "top_p"),
    ({"prompt": [5, 6], "top_p": 0}, 400, "top_p"),
    (b'{"prompt": [5, 6], "temperature": NaN}', 400, "temperature"),
    ({"prompt": [5, 6], "seed": 2**70}, 400, "seed"),
    ({"prompt": [5, 6], "stop_token_ids": [999]}, 400, "stop_token_ids"),
    ({"prompt": [5, 6], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [5, 6], "max_tokens": 10**400}, 400, "max_tokens"),
    ({"prompt": [5, 6], "user": 5}, 400, "user"),
    ({"prompt": [5, 6], "user": "alice"}, 200, None),  # the tenant, for --preemption fair
    ({"prompt": [5, 6], "priority": 1.5}, 400, "priority"),
    ({"prompt": [5, 6], "priority": -2}, 200, None),
    ({"prompt": [5, 6], "deadline": 0}, 400, "deadline"),  # seconds after arrival, minicb's own
    ({"prompt": [5, 6], "deadline": "soon"}, 400, "deadline"),
    ({"prompt": [5, 6], "deadline": 30}, 200, None),
    ({"prompt": [5, 6], "temperature": 10**400}, 400, "temperature"),
    ({"prompt": [5, 6], "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": [5, 6], "n": 17}, 400, "n"),
    (b'{"prompt": [5, 6], "max_tokens": 1e30}', 400, "max_tokens"),  # not the prompt's fault
    ({"prompt": [5, 6], "max_tokens": 10**30}, 400, "max_tokens"),
    ({"prompt": [5, 6], "stop_token_ids": [5] * 1025}, 400, "stop_token_ids"),  # bounded
    ({"prompt": [5, 6], "logit_bias": {"5": 1}}, 400, "logit_bias"),  # not implemented
    ({"prompt": [5, 6], "temprature": 0}, 400, "temprature"),  # no one's field
    ({"prompt": [5, 6], "n": 2}, 200, None),
    ({"prompt": [5, 6], "stop": [3]}, 200, None),  # token ids given as `stop`
    ({"prompt": [5, 6], "stop": "w1"}, 400, "stop"),  # no tokenizer, no stop strings
    ({"prompt": [5, 6], "stop_token_ids": ["x"]}, 400, "stop_token_ids"),
    ({"prompt": [5, 6], "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    ({"prompt": [5, 999]}, 400, "prompt"),
    ({"prompt": "hello"}, 400, "prompt"),
    ({"prompt": [5] * 2040, "max_tokens": 64}, 400, "prompt"),
    ({"prompt": [5, 6], "model": "gpt-9"}, 404, "model"),
    ({"prompt": [5, 6], "stop": 5}, 400, "stop"),
    ({"prompt": [5, 6], "stop": True}, 400, "stop"),
    ({"prompt": [5, 6], "stop": [3], "stop_token_ids": 7}, 400, "stop_token_ids"),
    ({"prompt": [5, 6], "stream": None, "ignore_eos": None}, 200, None),  # null: not given
    pytest.param(b"[" * 100_000, 400, None, id="nested-too-deeply-for-json"),
    pytest.param(b'{"prompt": [5, 6], "max_tokens": 1' + b"0" * 5000 + b"}", 400, None,
                 id="an-integer-past-pythons-4300-digits"),  # a 400, not a 500 and a traceback
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(shared_server, body,
                                                                     status, param):
    """Each bad body (bad JSON, an out-of-range, wrong-typed or unknown field, an unknown model)
    gets an OpenAI error with its status and the field named, and the next good request is
    answered."""
    url = shared_server
    with httpx.Client(timeout=TIMEOUT) as http:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = http.post(url + "/v1/completions", **kw)
        assert r.status_code == status, r.text
        if status != 200:
            err = r.json()["error"]
            assert err["param"] == param and err["message"]
            assert err["type"] == "invalid_request_error" or status == 404
        ok = http.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2


def test_a_lone_surrogate_is_refused_naming_its_field(word_model):
    """A JSON string may hold a lone surrogate, which no tokenizer can encode: a 400 naming
    the prompt or the messages, not a 500 from the tokenizer."""
    app = create_app(Engine(word_model, policy="pd", num_pages=64), "tiny")
    with ServerThread(app) as url, httpx.Client(timeout=TIMEOUT) as http:
        for path, body, param in (
                ("/v1/completions", b'{"prompt": "w5 \\ud800 w6"}', "prompt"),
                ("/v1/chat/completions",
                 b'{"messages": [{"role": "user", "content": "w5 \\ud800"}]}', "messages")):
            r = http.post(url + path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "surrogate" in r.json()["error"]["message"]


def test_an_oversized_body_is_refused_before_it_is_read(tiny_model):
    """A body over --max-request-bytes gets a 413: by its Content-Length at once, or by the
    bytes counted as a body without one streams in; /health answers all the while."""
    app = create_app(Engine(tiny_model, policy="pd", num_pages=64), "tiny",
                     max_request_bytes=1000)
    body = json.dumps({"prompt": [5] * 400}).encode()  # 1,210 bytes

    def chunks():  # no Content-Length: sent chunked
        yield body[:600]
        yield body[600:]
    with ServerThread(app) as url, httpx.Client(timeout=TIMEOUT) as http:
        for content in (body, chunks()):
            r = http.post(url + "/v1/completions", content=content)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            assert http.get(url + "/health").json() == {"status": "ok"}
        ok = http.post(url + "/v1/completions", json={"prompt": [5] * 100, "max_tokens": 2})
        assert ok.status_code == 200


def test_the_schema_names_the_field():
    """A request is checked against its endpoint's schema; a refusal names the field."""
    assert sampling_params(CompletionRequest(prompt=[1], top_k=-1), chat=False)["top_k"] == 0
    with pytest.raises(ValidationError, match="messages"):
        ChatCompletionRequest.model_validate({"prompt": "x"})
    with pytest.raises(ValidationError, match="one prompt per request"):
        CompletionRequest.model_validate({"prompt": [[1], [2]]})


def test_a_full_queue_answers_429(tiny_model):
    """Requests past max_queue get 429 with code "queue_full", and the server still answers
    afterwards."""
    async def burst(url):
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            body = {"prompt": [5, 6, 7], "max_tokens": 150, **GREEDY}
            return await asyncio.wait_for(asyncio.gather(*(
                http.post(url + "/v1/completions", json=body) for _ in range(6))), 60)

    with serving(tiny_model, max_queue=2, max_num_seqs=1) as (url, worker):
        answers = asyncio.run(burst(url))
        codes = sorted(r.status_code for r in answers)
        assert codes.count(429) >= 3 and codes.count(200) >= 1, codes
        refused = next(r for r in answers if r.status_code == 429)
        assert refused.json()["error"]["code"] == "queue_full"
        ok = httpx.post(url + "/v1/completions", json={"prompt": [5], "max_tokens": 2},
                        timeout=TIMEOUT)
        assert ok.status_code == 200


def test_client_metrics_agree_with_the_engine_record(tiny_model):
    """The client measures, from outside, what the engine records: the same requests, token
    counts and finish reasons, one time stamp per token, TTFT at the first token's stamp; and
    for every token the client's time since it sent the request is at least the engine's since
    the request arrived, the client's window holding the engine's (both clocks are
    perf_counter). How much longer it is (network, HTTP, hand-over) is a benchmark's number,
    not a rule."""
    workload = make_workload(10, prompt_lengths="uniform:8:64", output_lengths="fixed:48",
                             arrival="poisson", rate=40.0, seed=3, cancel_fraction=0.2,
                             cancel_after_tokens=4)
    with serving(tiny_model, max_num_seqs=16) as (url, worker):
        assert completions_url(url + "/v1") == url + "/v1/completions"
        client = asyncio.run(asyncio.wait_for(run_client(url, workload.requests,
                                                         vocab_size=256), 60))
        wait_idle(worker)
        engine = {r.request_id: r for r in worker.call(metrics.request_records).result(10)}
    rounding = 1e-6  # float error of differences of perf_counter readings, not a time bound
    completed = 0
    for c, w in zip(client, workload.requests):
        e = engine[w.request_id]
        assert c.num_prompt_tokens == e.num_prompt_tokens == w.prompt_len
        assert c.first_token_time == c.token_times[0] and c.finish_time >= c.token_times[-1]
        if w.cancel_after_tokens:
            # the client hangs up after 4 tokens; the engine stops when the server notices (on
            # a busy machine the tiny model may have finished all 48 tokens by then)
            assert c.finish_reason == "cancelled" and c.num_output_tokens == 4
            assert e.finish_reason in ("cancelled", "length"), e
        else:
            completed += 1
            assert c.finish_reason == e.finish_reason == "length", (c, e)
            assert c.num_output_tokens == e.num_output_tokens == 48
            assert len(c.token_times) == len(e.token_times) == 48
            assert len(metrics.itls(c)) == len(metrics.itls(e)) == 47
            e2e_client, e2e_engine = c.finish_time - c.arrival_time, \
                e.finish_time - e.arrival_time
            assert e2e_client >= e2e_engine - rounding, (c, e)
        # the client sent before the engine took the request, and read each token after the
        # engine produced it
        for k, received in enumerate(c.token_times):
            produced = e.token_times[k] - e.arrival_time
            assert received - c.arrival_time >= produced - rounding, (k, c, e)
    assert completed == 8  # 2 of the 10 cancel


def test_server_thread_turns_nagle_off():
    """asyncio sets TCP_NODELAY only on IPPROTO_TCP sockets; without it each small SSE chunk
    can wait for the client's delayed ACK (measured: +20-40 ms on the first token)."""
    server = ServerThread(FastAPI())
    assert server.sock.proto == socket.IPPROTO_TCP
    server.sock.close()


def test_serve_cli_help(capsys):
    """`serve --help` exits 0 and lists --max-queue, --quantization, --num-speculative-tokens and
    --max-preemptions."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--max-queue" in out and "--quantization" in out
    assert "--num-speculative-tokens" in out and "--max-preemptions" in out


def test_a_request_past_its_deadline_ends_with_finish_reason_deadline(shared_server):
    """A deadline too short to meet ends the request, streamed or not, with finish_reason
    "deadline" and what it had produced; /metrics counts it; the next request is served."""
    url = shared_server
    body = {"prompt": [5, 6, 7], "max_tokens": 200, "deadline": 1e-6, **GREEDY}
    with httpx.Client(timeout=TIMEOUT) as http:
        r = http.post(url + "/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "deadline"
        assert len(r.json()["choices"][0]["token_ids"]) < 200
        with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "deadline"
        values = metric_values(http.get(url + "/metrics").text)
        assert values['minicb:request_success_total{finished_reason="deadline"}'] >= 1
        ok = http.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert ok.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("order", ["newest", "priority", "deadline", "fair"])
def test_serve_cli_takes_every_preemption_order(order, monkeypatch, capsys):
    """`serve --preemption ORDER` hands each of the four orders to the engine it builds."""
    built = {}

    def fake_llm(model, **options):
        built.update(options)
        raise ValueError("stop before loading")

    monkeypatch.setattr("minicb.llm.LLM", fake_llm)
    with pytest.raises(SystemExit) as exit_info:
        main(["--preemption", order])
    assert exit_info.value.code == 2 and "stop before loading" in capsys.readouterr().err
    assert built["preemption"] == order


def test_serve_cli_passes_the_preemption_bound_to_the_engine(capsys):
    """Checked by the engine's config before any model loads: a bad bound is named."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--max-preemptions", "-1"])
    assert exit_info.value.code == 2
    assert "max_preemptions must be an integer >= 0" in capsys.readouterr().err


def test_metrics_count_every_token_of_a_step_that_kept_guesses():
    """The simulated model always predicts T, so every guess of a prompt of T's is kept: 25
    tokens in 7 steps. /metrics counts 25 generated tokens (not 7) and one gap per step that
    delivered (none of 0 inside a step)."""
    from minicb.benchmark.sim import make_sim_engine
    engine = make_sim_engine(policy="pd", num_speculative_tokens=3)
    t = engine.model.token
    app = create_app(engine, "sim")
    with ServerThread(app) as url, httpx.Client(timeout=TIMEOUT) as http:
        r = http.post(url + "/v1/completions", json={"prompt": [t] * 8, "max_tokens": 25,
                                                     **GREEDY})
        assert r.status_code == 200
        text = http.get(url + "/metrics").text
    assert metric_values(text)["minicb:generation_tokens_total"] == 25
    steps = len(engine.trace)
    assert metric_values(text)["minicb:inter_token_latency_seconds_count"] == steps - 1


def test_a_speculating_server_streams_the_same_tokens(tiny_model):
    """Guessed tokens kept in one step stream together; the tokens are a plain server's."""
    body = {"prompt": [5, 6, 7, 5, 6, 7, 5, 6], "max_tokens": 24, "stream": True, **GREEDY}
    streamed = {}
    for k in (0, 3):
        with serving(tiny_model, num_speculative_tokens=k, prompt_lookup_min=1) as (url, _), \
                httpx.Client(timeout=TIMEOUT) as http, \
                http.stream("POST", url + "/v1/completions", json=body) as r:
            streamed[k] = [t for c in sse_chunks(r) for t in c["choices"][0].get("token_ids", [])]
    assert streamed[3] == streamed[0] and len(streamed[0]) == 24


def test_a_stop_string_completed_among_kept_guesses_ends_the_stream_there(word_model):
    """A step with kept guesses brings 4 tokens at once; the stop string "w100 w100" is done at the
    output's 2nd: the client gets 2 token ids and the engine's record keeps 2, not the 5 the first
    two steps made."""
    model, clock = guessable_model(word_model[1].tokenizer)
    engine = Engine(model, clock=clock, device="cpu", attention_backend="torch", policy="pd",
                    num_speculative_tokens=3, check_invariants=True)
    body = {"prompt": [100] * 8, "max_tokens": 12, "stop": ["w100 w100"], "stream": True,
            **GREEDY}
    with ServerThread(create_app(engine, "sim")) as url, httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", url + "/v1/completions", json=body,
                         headers={"X-Request-Id": "spec"}) as r:
            chunks = [c["choices"][0] for c in sse_chunks(r)]
        text = http.get(url + "/metrics").text
    assert [t for c in chunks for t in c.get("token_ids", [])] == [100, 100]
    assert "".join(c["text"] for c in chunks) == ""
    assert chunks[-1]["finish_reason"] == "stop"
    req = engine.requests["spec"]
    assert (req.output_token_ids, req.finish_reason, len(req.metrics.token_times)) == \
        ([100, 100], "stop", 2)
    assert finished(text, "stop") == 1
    # not the 5 the two steps made
    assert metric_values(text)["minicb:generation_tokens_total"] == 2
    assert engine.pool.num_used == 0


def test_engine_faults_fail_the_request_not_the_server(tiny_model):
    """A fault inside a step fails that request with a 500, or an error chunk when streamed, and the
    next request is answered; the metrics count both as errors."""
    def fail_once(engine, where):  # replace engine.<where> by a function that raises once
        real = getattr(engine, where)

        def broken(*args):
            setattr(engine, where, real)
            raise RuntimeError("injected fault")
        setattr(engine, where, broken)

    body = {"prompt": [5, 6, 7], "max_tokens": 8, **GREEDY}
    with serving(tiny_model) as (url, worker), httpx.Client(timeout=TIMEOUT) as http:
        worker.call(lambda e: fail_once(e, "_failure_hook")).result(10)  # contained by the engine
        r = http.post(url + "/v1/completions", json=body)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        worker.call(lambda e: fail_once(e, "step")).result(10)  # escapes the engine's step
        with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            chunks = sse_chunks(r)
        assert "error" in chunks[0] and chunks[-1]["choices"][0]["finish_reason"] == "error"
        assert http.post(url + "/v1/completions", json=body).status_code == 200
        values = metric_values(http.get(url + "/metrics").text)
        assert values['minicb:request_success_total{finished_reason="error"}'] == 2


def test_the_client_sends_a_traces_tenant_priority_and_deadline(tiny_model):
    """A replayed trace's tenant, priority and deadline reach the server (as `user`,
    `priority`, `deadline`): the engine holds them, and a deadline too short to meet comes
    back as finish_reason "deadline". A request without them sends none of the three. A numpy
    priority is sent as an int (JSON has no numpy types)."""
    from minicb.benchmark.workload import Workload, WorkloadRequest
    workload = Workload("t", [
        WorkloadRequest(prompt_len=6, max_tokens=40, request_id="late", tenant="team-a",
                        priority=np.int64(2), deadline=1e-6),  # numpy's, as a trace gives
        WorkloadRequest(prompt_len=6, max_tokens=3, request_id="plain")])
    with serving(tiny_model) as (url, worker):
        records = asyncio.run(asyncio.wait_for(run_client(url, workload.requests,
                                                          vocab_size=256, warmup=False), 60))
        seen = worker.call(lambda e: {rid: (r.tenant, r.priority, r.deadline)
                                      for rid, r in e.requests.items()}).result(10)
    assert [r.finish_reason for r in records] == ["deadline", "length"]
    assert seen["late"] == ("team-a", 2, 1e-6) and seen["plain"] == (None, 0, None)


def test_bench_endpoint_measures_a_running_server(tiny_model):
    """The client's summary: what only the server's engine knows is unknown (None), not 0,
    unless its /metrics counts it (steps, preemptions)."""
    with serving(tiny_model, max_num_seqs=8) as (url, _):
        data = bench_endpoint(url, make_workload(3, prompt_lengths="uniform:8:32",
                                                 output_lengths="fixed:4"), vocab_size=256)
    result = data["results"][url]
    assert result["completed"] == 3 and result["ttft_s"]["p50"] > 0
    assert result["mean_batch_size"] is None and result["dead_slot_steps"] is None
    assert result["preemptions"] == 0 and result["num_steps"] > 0  # minicb's /metrics
    assert "num_steps=" in client.report(data["results"])
    records_only = metrics.summarize([], [])  # a summary not from bench_endpoint: no such line
    assert "/metrics" not in client.report({"x": {**records_only, "preemptions": 0}})


def test_a_submitter_that_stops_waiting_harms_no_one(tiny_model):
    """A submit cancelled while its command waits (a timeout, a client gone) neither fails the
    other requests nor drops the commands queued with it; one cancelled while the engine
    thread adds it leaves no request running."""
    short = dict(max_tokens=4, **GREEDY)
    with serving(tiny_model) as (url, worker):
        async def main():
            other = await worker.submit([3, 4, 5], dict(max_tokens=1000, **GREEDY))
            gate = threading.Event()
            worker.call(lambda e: gate.wait(10))  # holds the engine thread: commands queue up
            a = asyncio.create_task(worker.submit([5, 6], short))
            b = asyncio.create_task(worker.submit([7, 8], short))
            await asyncio.sleep(0.05)
            a.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await a
            gate.set()
            job = await asyncio.wait_for(b, 5)  # its command was not dropped
            events = [await asyncio.wait_for(job.events.get(), 5)]
            while events[-1].finish_reason is None:
                events.append(await asyncio.wait_for(job.events.get(), 5))
            assert events[-1].finish_reason == "length"
            assert sum(len(ev.token_ids) for ev in events) == 4
            assert all(other.events.get_nowait().finish_reason != "error"
                       for _ in range(other.events.qsize())), "an unrelated request failed"
            worker.cancel(other)

            adding, release = hold_adds(worker)
            late = asyncio.create_task(worker.submit([9, 10], dict(max_tokens=1000, **GREEDY),
                                                     request_id="late"))
            await asyncio.get_running_loop().run_in_executor(None, adding.wait, 10)
            late.cancel()  # while the engine thread adds it
            with contextlib.suppress(asyncio.CancelledError):
                await late
            del worker._add
            release.set()

        asyncio.run(main())
        wait_idle(worker)
        assert worker.call(lambda e: e.requests["late"].finish_reason).result(10) == \
            "cancelled"
        assert worker.last_error is None, worker.last_error


def test_streamed_text_equals_a_full_decode_at_linear_cost(byte_model):
    """Text is decoded a few tokens at a time (not the whole output after every step), and
    still equals a full decode, multi-byte characters split across tokens included."""
    tok = byte_model[1].tokenizer
    prompts, n = [[5, 6, 7], [200, 201, 3], [226, 130, 40, 9]], 64
    refs = reference(byte_model, prompts, n)
    fulls = [tok.decode(r.token_ids, skip_special_tokens=True) for r in refs]
    assert any(ord(c) > 127 and c != "\ufffd" for text in fulls for c in text)
    with serving(byte_model) as (url, worker), httpx.Client(timeout=TIMEOUT) as http:
        worker.tokenizer = counting = CountingTokenizer(tok)
        for prompt, ref, full in zip(prompts, refs, fulls):
            body = {"prompt": prompt, "max_tokens": n, **GREEDY}
            out = http.post(url + "/v1/completions", json=body).json()["choices"][0]
            assert out["token_ids"] == ref.token_ids and out["text"] == full
            with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) \
                    as r:
                chunks = sse_chunks(r)
            assert "".join(c["choices"][0]["text"] for c in chunks) == full
    # a few tokens per step (about 6 on these broken bytes); a full decode per step would read
    # n * (n + 1) / 2 = 2,080 tokens per request
    assert counting.decoded < 12 * n * 2 * len(prompts), counting.decoded
    llm = LLM(byte_model, policy="continuous", num_pages=256)
    llm.tokenizer = counting = CountingTokenizer(tok)
    texts: dict[str, str] = {}
    for rid, _, delta in llm.stream(prompts, SamplingParams(max_tokens=n, **GREEDY)):
        texts[rid] = texts.get(rid, "") + delta
    assert list(texts.values()) == fulls
    assert counting.decoded < 12 * n * len(prompts), counting.decoded


def test_incremental_decoding_equals_a_full_decode_on_smollm2():
    """On SmolLM2's tokenizer, decoding token by token gives the same text as decoding all the
    tokens at once, for real text, random tokens and special tokens."""
    from transformers import AutoTokenizer

    from minicb.config import cache_root
    folder = cache_root() / "smollm2-135m"
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("SmolLM2's tokenizer is not converted here")
    tok = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(0)
    words = tok.encode("naïve café, Grüße aus 東京 🙂🚀 — «ok» ∑x² 🇫🇷\n\tend")
    for trial in range(20):  # real text, random tokens, special tokens, in random runs
        ids = [t for _ in range(30) for t in rng.choice(
            [words[rng.randrange(len(words)):][:5], [rng.randrange(tok.vocab_size)],
             [rng.choice(tok.all_special_ids)]])]
        decoder = IncrementalDecoder(tok)
        text = "".join(decoder.step(ids[:i + 1], final=i == len(ids) - 1)
                       for i in range(len(ids)))
        assert text == tok.decode(ids, skip_special_tokens=True), trial


def metaspace_tokenizer():
    """A Llama-2/Mistral-style (SentencePiece) tokenizer: a word's "▁" becomes a space, except
    at the start of a decode, where it is dropped."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Hello": 3, "▁world": 4, "▁again": 5, "!": 6}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.mark.parametrize("kind", ["word", "metaspace"])
def test_incremental_decoding_around_special_tokens(word_model, kind):
    """A generated special token (EOS under ignore_eos, a BOS) decodes to nothing; the word after
    it keeps its space: the window never starts on a special token, which would decode that
    word as the text's first ('Helloworld')."""
    tok = word_model[1].tokenizer if kind == "word" else metaspace_tokenizer()
    words = [3, 4, 5] if kind == "metaspace" else [80, 81, 82]
    rng = random.Random(1)
    for trial in range(30):
        ids = [rng.choice(words + [1, 2, 6] if kind == "metaspace" else words + [1, 2])
               for _ in range(rng.randrange(1, 12))]
        decoder = IncrementalDecoder(tok)
        text = "".join(decoder.step(ids[:i + 1], final=i == len(ids) - 1)
                       for i in range(len(ids)))
        assert text == tok.decode(ids, skip_special_tokens=True), (trial, ids)
    decoder = IncrementalDecoder(tok)
    assert [decoder.step([3, 2, 4][:n]) for n in (1, 2, 3)] == (
        ["Hello", "", " world"] if kind == "metaspace" else ["w3", "", " w4"])


def test_stop_strings_wait_for_min_tokens(word_model):
    """As vLLM: no stop string ends a request before it has `min_tokens` tokens."""
    ref = reference(word_model, ["w5 w6 w7"], 12)[0]
    words = ref.text.split()
    stop = words[1]
    min_tokens = max(i for i, w in enumerate(words) if w == stop) + 2  # after its last one
    assert min_tokens <= 12
    with serving(word_model) as (url, worker), httpx.Client(timeout=TIMEOUT) as http:
        body = {"prompt": "w5 w6 w7", "max_tokens": 12, "stop": [stop], "min_tokens": min_tokens,
                **GREEDY}
        out = http.post(url + "/v1/completions", json=body).json()["choices"][0]
        assert (out["text"], out["finish_reason"]) == (ref.text, "length")


def test_a_stop_string_in_the_last_token_is_a_stop_everywhere(word_model):
    """A stop string in the last allowed token finishes the request as "stop" in the answer, the
    engine and the metrics, not as "length"."""
    ref = reference(word_model, ["w5 w6 w7"], 2)[0]
    first, stop = ref.text.split()
    assert stop not in first
    with serving(word_model) as (url, worker), httpx.Client(timeout=TIMEOUT) as http:
        body = {"prompt": "w5 w6 w7", "max_tokens": 2, "stop": [stop], **GREEDY}
        out = http.post(url + "/v1/completions", json=body,
                        headers={"X-Request-Id": "last"}).json()["choices"][0]
        assert (out["text"], out["finish_reason"]) == (ref.text[:ref.text.find(stop)], "stop")
        assert worker.call(lambda e: e.requests["last"].finish_reason).result(10) == "stop"
        text = http.get(url + "/metrics").text
        assert finished(text, "stop") == 1
        assert finished(text, "length") == 0


def test_a_fault_after_a_step_still_forgets_its_finished_requests(tiny_model):
    """A fault while emitting a finished request or after the step's record still lets the server
    forget old finished requests, keeping only the last max_finished."""
    engine = Engine(tiny_model, policy="pd", num_pages=64, check_invariants=True)
    app = create_app(engine, "tiny", max_finished=3)
    worker = app.state.worker

    def fail_once(obj, name, when):  # obj.<name> raises the first time `when(*args)` holds
        real = getattr(obj, name)

        def broken(*args):
            if not when(*args):
                return real(*args)
            delattr(obj, name)
            raise RuntimeError("injected fault")
        setattr(obj, name, broken)

    body = {"prompt": [5, 6, 7], "max_tokens": 4, **GREEDY}
    with ServerThread(app) as url, httpx.Client(timeout=TIMEOUT) as http:
        worker.call(lambda e: fail_once(worker, "_emit", lambda rid, s: e.requests[
            rid].is_finished)).result(10)  # in _emit, at the request's last step
        r = http.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "emit"})
        assert r.status_code == 500
        worker.call(lambda e: fail_once(e, "check_invariants", lambda record: bool(
            record.finished))).result(10)  # in engine.step, after its record was made
        r = http.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "check"})
        assert r.status_code == 500
        for i in range(5):
            r = http.post(url + "/v1/completions", json=body, headers={"X-Request-Id": f"r{i}"})
            assert r.status_code == 200
        wait_idle(worker)
        assert worker.call(lambda e: sorted(e.requests)).result(10) == ["r2", "r3", "r4"]


def test_a_client_that_cancels_at_its_last_token_records_the_finish(tiny_model):
    """A client that cancels after its last token records the finish as "length" with all its
    tokens, not as cancelled."""
    workload = make_workload(3, prompt_lengths="fixed:8", output_lengths="fixed:4", seed=1,
                             cancel_fraction=1.0, cancel_after_tokens=4)
    with serving(tiny_model) as (url, worker):
        records = asyncio.run(asyncio.wait_for(run_client(url, workload.requests,
                                                          vocab_size=256), 60))
    assert [(r.finish_reason, r.num_output_tokens) for r in records] == [("length", 4)] * 3


def test_the_client_summary_reports_no_queue_age(tiny_model):
    """The client cannot see queue time; the summary says so instead of giving an E2E."""
    workload = make_workload(4, prompt_lengths="fixed:8", output_lengths="fixed:8", seed=2)
    with serving(tiny_model, max_num_seqs=2) as (url, _):
        result = bench_endpoint(url, workload, label="tiny", vocab_size=256)["results"]["tiny"]
    assert result["completed"] == 4
    assert result["max_queue_age_s"] is None and result["max_queue_age_steps"] is None
    assert result["goodput_rps"] is None and result["slo_attainment"] is None  # no SLO given


def test_bench_endpoint_reads_memory_pressure_from_the_servers_metrics(tiny_model, capsys):
    """Preemptions, the work they lost and evicted pages are invisible to a client; a server
    that counts them in /metrics (minicb's names, or vLLM's preemptions) tells: the summary has
    the counters' growth over the run, equal to the engine's own records (the warm-up request
    included), and the report prints them."""
    workload = make_workload(4, prompt_lengths="fixed:20", output_lengths="fixed:40", seed=3)
    with serving(tiny_model, num_pages=7, max_num_seqs=4) as (url, worker):
        data = bench_endpoint(url, workload, label="tiny", vocab_size=256)
        wait_idle(worker)
        records, steps = worker.call(
            lambda e: (metrics.request_records(e), len(e.trace))).result(10)
    summary = data["results"]["tiny"]
    assert summary["preemptions"] == sum(r.num_preemptions for r in records) > 0
    assert summary["discarded_tokens"] == sum(r.num_discarded_tokens for r in records) > 0
    assert summary["recomputed_tokens"] == sum(r.num_recomputed_tokens for r in records)
    assert summary["num_steps"] == steps and summary["evicted_pages"] is not None
    assert summary["mean_batch_size"] is None  # not a counter any server exports
    assert "warm-up request included" in data["declaration"]["server_metrics"]
    assert summary["from_server_metrics"] == ["num_steps", "preemptions", "discarded_tokens",
                                              "recomputed_tokens", "evicted_pages",
                                              "swapped_out_pages", "swapped_in_pages"]
    assert summary["swapped_out_pages"] == summary["swapped_in_pages"] == 0  # recompute
    assert (f"tiny, from the server's /metrics over the run: num_steps={steps}, "
            f"preemptions={summary['preemptions']}") in client.report(data["results"])


def test_a_closed_loop_client_sends_the_next_request_when_one_comes_back(tiny_model):
    """max_concurrency=1 (bench --endpoint --max-concurrency 1): no two requests overlap, each
    is sent after the one before it ended, and its times count from when it was sent; the
    declaration says so."""
    workload = make_workload(4, prompt_lengths="fixed:8", output_lengths="fixed:4", seed=4)
    with serving(tiny_model) as (url, _):
        data = bench_endpoint(url, workload, label="tiny", vocab_size=256, max_concurrency=1)
    records = sorted(data["records"], key=lambda r: r["arrival_time"])
    assert len(records) == 4 and all(r["finish_reason"] == "length" for r in records)
    for before, after in zip(records, records[1:]):
        assert after["arrival_time"] >= before["finish_time"]
    assert data["declaration"]["concurrency"]["max_concurrency"] == 1
    with pytest.raises(ValueError, match="max_concurrency must be a positive integer"):
        asyncio.run(run_client("http://127.0.0.1:9", workload.requests, max_concurrency=0))


def test_server_counters_sum_label_sets_and_skip_other_lines():
    """vLLM labels its counters (one line per engine); a timestamp may follow the value."""
    text = ("# TYPE vllm:num_preemptions_total counter\n"
            'vllm:num_preemptions_total{engine="0",model_name="a b"} 3.0\n'
            'vllm:num_preemptions_total{engine="1",model_name="a b"} 2.0 1700000000\n'
            "minicb:kv_pages_evicted_total 7\nvllm:num_preemptions_created 9\n")
    app = FastAPI()
    app.get("/metrics")(lambda: Response(text, media_type="text/plain"))
    with ServerThread(app) as url:
        assert client.server_counters(url + "/v1") == {"preemptions": 5.0, "evicted_pages": 7.0}
    with ServerThread(FastAPI()) as url:  # no /metrics: nothing known
        assert client.server_counters(url) == {}


def test_a_server_keeps_a_bounded_trace_by_default(tiny_model):
    """A step record of 16 members is about 2.4 KB: 10,000 steps keep about 23 MiB (the
    200,000 of before kept 455 MiB that the server never reads)."""
    engine = Engine(tiny_model, policy="pd", num_pages=16)
    assert create_app(engine).state.worker.max_trace == EngineWorker(engine).max_trace == 10_000


# ------------------------------------------------------------------------ metrics and refusals
def test_metrics_ttft_is_measured_from_arrival_and_preemptions_are_counted(tiny_model):
    """/metrics' TTFT sum equals the engine records' TTFTs (arrival to first token), and its
    preemption counters their preemptions and the tokens those discarded and recomputed (a
    pool too small for four requests forces some)."""
    async def burst(url):
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            body = {"prompt": list(range(3, 23)), "max_tokens": 40, **GREEDY}
            return await asyncio.wait_for(asyncio.gather(*(
                http.post(url + "/v1/completions", json=body) for _ in range(4))), 60)

    with serving(tiny_model, num_pages=7, max_num_seqs=4) as (url, worker):
        assert all(r.status_code == 200 for r in asyncio.run(burst(url)))
        wait_idle(worker)
        records = worker.call(metrics.request_records).result(10)
        text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    values = metric_values(text)
    ttfts = [r.first_token_time - r.arrival_time for r in records]
    assert float(values["minicb:time_to_first_token_seconds_sum"]) == pytest.approx(sum(ttfts))
    preempted = sum(r.num_preemptions for r in records)
    assert preempted > 0 and int(values["minicb:num_preemptions_total"]) == preempted
    discarded = sum(r.num_discarded_tokens for r in records)
    recomputed = sum(r.num_recomputed_tokens for r in records)
    assert discarded > 0 and int(values["minicb:preemption_discarded_tokens_total"]) == discarded
    assert 0 < int(values["minicb:preemption_recomputed_tokens_total"]) == recomputed < discarded


def test_metrics_show_evicted_prefix_pages_and_the_oldest_wait():
    """Two more things the contract asks to watch when the cache is full: cached prefix pages
    evicted (a counter, the trace's sum) and queue age (a gauge: the longest wait of a request
    not yet scheduled, after the last step; 0 once nobody waits)."""
    engine = make_sim_engine(policy="continuous", num_pages=4, max_num_seqs=1)
    worker = EngineWorker(engine)  # not started: its per-step counting is driven here
    params = SamplingParams(max_tokens=2, **GREEDY)
    engine.add_request([7] * 32, params, request_id="a")  # leaves 2 cached prompt pages
    engine.add_request(list(range(3, 51)), params, request_id="b")  # 4 pages: evicts them
    ages = []
    while engine.has_unfinished():
        record = engine.step()
        worker._count(record)
        ages.append(worker.oldest_waiting_s)
        waiting = [engine.requests[r].metrics for r in record.waiting]
        assert ages[-1] == pytest.approx(max((record.t_end - m.arrival_time for m in waiting
                                              if m.first_scheduled_time is None), default=0))
    values = metric_values(worker.metrics_text())
    evicted = sum(rec.pages_evicted for rec in engine.trace)
    assert evicted == 2 and int(values["minicb:kv_pages_evicted_total"]) == evicted
    assert ages[0] > 0 and ages[-1] == 0 and float(values["minicb:oldest_waiting_seconds"]) == 0


def test_the_queue_age_gauge_falls_to_zero_when_the_waiting_hang_up():
    """Clients that hang up together are cancelled between steps; with nothing left to step,
    no step record comes to update the gauge, so the cancels must bring it to 0."""
    engine = make_sim_engine(policy="continuous", num_pages=64, max_num_seqs=1)
    worker = EngineWorker(engine)  # not started: its engine-thread methods are driven here
    for rid in "abc":
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, **GREEDY), request_id=rid)
    worker._count(engine.step())
    assert worker.oldest_waiting_s > 0  # b and c wait behind a
    for rid in "abc":
        worker._cancel(rid, "cancelled")
    assert not engine.has_unfinished() and worker.oldest_waiting_s == 0


def test_a_slow_tokenization_holds_up_no_step(word_model):
    """Prompts are tokenized off the engine thread: while one is still being tokenized, other
    requests run to the end (tokenized between steps, one 18 MB prompt held every stream for
    49 s)."""
    import concurrent.futures
    with serving(word_model) as (url, worker), httpx.Client(timeout=TIMEOUT) as http:
        entered, release = threading.Event(), threading.Event()
        real = worker.engine.tokenize

        def slow(prompt, **options):
            if prompt == "w9 w9 w9":
                entered.set()
                release.wait(10)
            return real(prompt, **options)
        worker.engine.tokenize = slow
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            body = {"prompt": "w9 w9 w9", "max_tokens": 2, **GREEDY}
            held = pool.submit(http.post, url + "/v1/completions", json=body)
            assert entered.wait(10)
            try:
                out = http.post(url + "/v1/completions", timeout=5,
                                json={"prompt": "w5 w6", "max_tokens": 3, **GREEDY})
            finally:
                release.set()
            assert out.status_code == 200 and len(out.json()["choices"][0]["token_ids"]) == 3
            assert held.result(10).status_code == 200


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(word_model):
    """No token of the word tokenizer is longer than 5 characters ("<unk>"), so a prompt of
    more than 5 x max_model_len characters cannot fit: refused without tokenizing it."""
    with serving(word_model) as (url, worker), httpx.Client(timeout=TIMEOUT) as http:
        limit = worker.max_prompt_chars
        assert limit == 5 * worker.max_model_len
        calls = []
        real = worker.engine.tokenize
        worker.engine.tokenize = lambda prompt, **options: (
            isinstance(prompt, str) and calls.append(prompt) or real(prompt, **options))
        for chat in (False, True):
            body = {"messages": [{"role": "user", "content": "w5 " * limit}]} if chat \
                else {"prompt": "w5 " * limit}
            out = http.post(url + ("/v1/chat/completions" if chat else "/v1/completions"),
                            json={**body, "max_tokens": 2})
            error = out.json()["error"]
            assert out.status_code == 400 and error["code"] == "context_length_exceeded"
            assert "characters" in error["message"]
            assert error["param"] == ("messages" if chat else "prompt")
        assert calls == []
        ok = http.post(url + "/v1/completions", json={"prompt": "w5 w6", "max_tokens": 2})
        assert ok.status_code == 200 and calls == ["w5 w6"]


def test_default_max_tokens_bounds_a_chat_without_one(word_model):
    """default_max_tokens caps a chat that gives no max_tokens, a request's own max_tokens overrides
    it, and a value below 1 is refused."""
    engine = Engine(word_model, policy="pd", num_pages=64)
    with pytest.raises(ValueError, match="default_max_tokens must be an integer >= 1"):
        create_app(engine, "tiny", default_max_tokens=0)
    app = create_app(engine, "tiny", default_max_tokens=4)
    chat = {"messages": [{"role": "user", "content": "w5 w6"}], "ignore_eos": True, **GREEDY}
    with ServerThread(app) as url, httpx.Client(timeout=TIMEOUT) as http:
        out = http.post(url + "/v1/chat/completions", json=chat).json()
        assert out["usage"]["completion_tokens"] == 4
        assert out["choices"][0]["finish_reason"] == "length"
        out = http.post(url + "/v1/chat/completions", json={**chat, "max_tokens": 6}).json()
        assert out["usage"]["completion_tokens"] == 6  # a request's own max_tokens still rules


def test_a_client_that_hangs_up_while_sending_its_body_gets_a_quiet_answer(tiny_model):
    """Starlette raises ClientDisconnect from request.body(): answered, not a traceback."""
    app = create_app(Engine(tiny_model, policy="pd", num_pages=64), "tiny")
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "query_string": b"", "http_version": "1.1", "scheme": "http", "root_path": "",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400
    assert b"disconnected" in sent[1]["body"]


def test_the_server_trims_its_trace_to_max_trace(tiny_model):
    """The server's engine keeps at most max_trace step records."""
    engine = Engine(tiny_model, policy="pd", num_pages=64)
    app = create_app(engine, "tiny", max_trace=6)
    with ServerThread(app) as url, httpx.Client(timeout=TIMEOUT) as http:
        for i in range(3):
            body = {"prompt": [5 + i, 6, 7], "max_tokens": 5, **GREEDY}
            assert http.post(url + "/v1/completions", json=body).status_code == 200
        assert app.state.worker.call(lambda e: len(e.trace)).result(10) <= 6


def test_max_queue_refuses_the_request_beyond_it(tiny_model):
    """max_queue=2: two requests may wait; the third, added before any step, is refused."""
    worker = EngineWorker(Engine(tiny_model, policy="pd", num_pages=64), max_queue=2)

    async def main():
        gate = threading.Event()
        worker.start()
        worker.call(lambda e: gate.wait(10))  # hold the engine thread: the adds queue up
        tasks = [asyncio.create_task(worker.submit([5, 6, 7], dict(max_tokens=2, **GREEDY)))
                 for _ in range(3)]
        await asyncio.sleep(0.05)
        gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        results = asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        worker.stop()
    assert [type(r).__name__ for r in results] == ["Job", "Job", "QueueFull"]


def test_chat_honours_max_completion_tokens(word_model):
    """Chat's max_completion_tokens caps the answer's tokens and finishes it by length."""
    body = {"messages": [{"role": "user", "content": "w40 w41"}], "max_completion_tokens": 3,
            **GREEDY}
    with serving(word_model) as (url, _), httpx.Client(timeout=TIMEOUT) as http:
        out = http.post(url + "/v1/chat/completions", json=body).json()
    assert out["usage"]["completion_tokens"] == 3 and out["choices"][0]["finish_reason"] == "length"


def test_serve_cli_max_queue_0_means_no_limit_and_the_served_name(tiny_llama_dir, monkeypatch):
    """`serve --max-queue 0` sets no queue limit, --default-max-tokens reaches the worker, and
    /v1/models lists the --served-model-name."""
    import uvicorn

    from minicb.serving.server import main as serve_main
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    assert serve_main(["--model", str(tiny_llama_dir), "--device", "cpu", "--max-queue", "0",
                       "--served-model-name", "tiny-x", "--num-pages", "32",
                       "--default-max-tokens", "64"]) == 0
    app = apps[0]
    assert app.state.worker.max_queue is None and app.state.worker.default_max_tokens == 64
    with ServerThread(app) as url:
        assert httpx.get(url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"] == "tiny-x"


def test_serve_cli_refuses_a_negative_max_queue_and_an_unknown_log_level(tiny_llama_dir,
                                                                          monkeypatch, capsys):
    """--max-queue -1 (a server that would answer every request 429) and --log-level loud (which
    uvicorn would refuse only after the model loads) are refused before any model loads."""
    import uvicorn
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    base = ["--model", str(tiny_llama_dir), "--device", "cpu", "--num-pages", "32"]
    for argv, message in ((["--max-queue", "-1"], "--max-queue must be >= 0"),
                          (["--default-max-tokens", "0"], "--default-max-tokens must be >= 1"),
                          (["--log-level", "loud"], "argument --log-level: invalid choice")):
        with pytest.raises(SystemExit) as exit_info:
            main([*base, *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_an_event_stream_runs_on_close_when_the_send_fails():
    """ASGI spec 2.4 servers report a client gone as an OSError from `send`: the stream must
    still cancel its request."""
    from minicb.serving.server import _EventStream
    closed = []

    async def body():
        yield "data: 1\n\n"

    async def send(message):
        if message["type"] == "http.response.body":
            raise OSError("client gone")

    async def receive():
        return {"type": "http.disconnect"}

    response = _EventStream(body(), lambda: closed.append(True))
    with pytest.raises(Exception):  # noqa: B017 - starlette's ClientDisconnect
        asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    assert closed == [True]


def test_a_conversation_with_a_message_without_content_is_refused():
    """Every chat message needs a role and a content."""
    with pytest.raises(ValidationError, match="messages.1.content"):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "user"}]})


def test_chat_applies_the_template_with_the_generation_prompt(word_model):
    """LLM.chat: one conversation or a list of them; each prompt is the checkpoint's template
    with add_generation_prompt (this template only adds w9 when asked)."""
    tok = word_model[1].tokenizer
    saved = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}w9{% endif %}")
    try:
        llm = LLM(word_model, num_pages=64)
        sp = SamplingParams(max_tokens=3, **GREEDY)
        a, b = [{"role": "user", "content": "w40 w41"}], [{"role": "user", "content": "w7"}]
        one = llm.chat(a, sp, use_tqdm=False)
        two = llm.chat([a, b], sp, use_tqdm=False)
    finally:
        tok.chat_template = saved
    assert one[0].prompt_token_ids == tok.encode("w40 w41 w9")
    assert [o.prompt_token_ids for o in two] == [tok.encode("w40 w41 w9"), tok.encode("w7 w9")]
    with pytest.raises(ValueError, match=r"got the string 'w40 w41': pass \[\{'role'"):
        llm.chat("w40 w41")


def test_the_client_counts_refused_and_failed_requests_as_errors(tiny_model):
    """A 400 (prompt ids beyond the tiny vocabulary, no --vocab-size) and a refused connection
    are errors, not completed requests."""
    workload = make_workload(2, prompt_lengths="fixed:8", output_lengths="fixed:4", seed=1)
    with serving(tiny_model) as (url, _):
        records = asyncio.run(asyncio.wait_for(run_client(url, workload.requests,
                                                          warmup=False), 60))
    assert [r.finish_reason for r in records] == ["error", "error"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening
        records = asyncio.run(asyncio.wait_for(run_client(closed, workload.requests,
                                                          model="x", warmup=False), 60))
    assert [r.finish_reason for r in records] == ["error", "error"]
    app = FastAPI()  # a server that reports a failure as an error chunk, then [DONE] (vLLM)

    @app.post("/v1/completions")
    async def failing():
        return StreamingResponse(iter(['data: {"error": {"message": "boom"}}\n\n',
                                       "data: [DONE]\n\n"]), media_type="text/event-stream")
    with ServerThread(app) as url:
        records = asyncio.run(asyncio.wait_for(run_client(url, workload.requests, model="x",
                                                          warmup=False), 60))
    assert [r.finish_reason for r in records] == ["error", "error"]


def test_a_refusal_is_reported_in_the_servers_words_and_omit_field_avoids_it(capsys):
    """A server that refuses a non-zero priority (vLLM without --scheduling-policy priority):
    the failed request's reason comes back in the summary and on stderr with the way out, and
    `omit` leaves the field off so every request completes. A field name not among the trace's
    is refused before anything is sent."""
    from minicb.benchmark.workload import Workload, WorkloadRequest
    from minicb.serving.client import describe_errors
    app, sent = FastAPI(), []

    @app.post("/v1/completions")
    async def vllm_like(body: dict):
        sent.append(body)
        if body.get("priority"):
            return JSONResponse({"error": {"message": f"Got priority {body['priority']} but "
                                           "Priority scheduling is not enabled."}}, 400)
        return StreamingResponse(iter(['data: {"choices": [{"text": "a", "finish_reason": '
                                       '"length"}]}\n\n',
                                       "data: [DONE]\n\n"]), media_type="text/event-stream")
    workload = Workload("t", [WorkloadRequest(prompt_len=4, max_tokens=1, priority=2),
                              WorkloadRequest(prompt_len=4, max_tokens=1, tenant="a")])
    with ServerThread(app) as url:
        refused = bench_endpoint(url, workload, label="x", model="m")["results"]["x"]
        omitted = bench_endpoint(url, workload, label="x", model="m", omit=["priority", "user"])
        with pytest.raises(ValueError, match="tenant"):
            asyncio.run(run_client(url, workload.requests, model="m", omit=["tenant"]))
    reason = "HTTP 400: Got priority 2 but Priority scheduling is not enabled."
    assert refused["errors"] == 1 and refused["error_reasons"] == {reason: 1}
    assert describe_errors(refused).splitlines() == [
        f"error: 1 request failed: {reason}",
        "(a server that refuses a trace's field: leave it out with --omit-field)"]
    assert omitted["results"]["x"]["errors"] == 0 and omitted["results"]["x"]["completed"] == 2
    assert omitted["declaration"]["omitted_fields"] == ["priority", "user"]
    measured = [b for b in sent if b["max_tokens"] == 1]  # not the warm-up probes
    assert [("priority" in b, "user" in b) for b in measured] == [
        (True, False), (False, True), (False, False), (False, False)]
    assert describe_errors(omitted["results"]["x"]) == ""
    quota = describe_errors({"error_reasons": {"HTTP 429: too many users": 2}})
    assert quota == "error: 2 requests failed: HTTP 429: too many users"  # no field named
    assert serve_parser().parse_args(["--omit-field", "priority"]).omit_field == ["priority"]
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--omit-field", "tenant"])
    assert "invalid choice" in capsys.readouterr().err


def test_the_client_stamps_every_token_the_last_one_too(tiny_model):
    """The benchmark client records a time for every output token, the last one included, none after
    the finish."""
    workload = make_workload(3, prompt_lengths="fixed:8", output_lengths="fixed:5", seed=4)
    with serving(tiny_model) as (url, _):
        records = asyncio.run(asyncio.wait_for(run_client(url, workload.requests,
                                                          vocab_size=256), 60))
    for r in records:
        assert r.num_output_tokens == len(r.token_times) == 5
        assert r.token_times[-1] <= r.finish_time


# --- the full-cache answers beside preemption (chapter 06): reject (503), swap -----------------
def test_a_full_cache_answers_503_streamed_or_not_and_the_server_keeps_serving(tiny_model):
    """reject_when_full: while one request holds 3 of the 4 pages, a 20-token prompt (2 pages)
    gets HTTP 503 code cache_full, as JSON before any stream starts, with a Retry-After; each
    is counted once as rejected, retired like any finished request (max_finished=1: forgotten,
    nothing left behind), and a prompt that fits is served after."""
    engine = Engine(tiny_model, policy="pd", num_pages=4, reject_when_full=True,
                    check_invariants=True)
    app = create_app(engine, "tiny", max_finished=1)
    worker = app.state.worker
    adding, release = hold_adds(worker)  # the big prompts queue while the holder is added
    holder = {"prompt": list(range(3, 43)), "max_tokens": 20, **GREEDY}  # 40 tokens: 3 pages
    big = {"prompt": list(range(100, 120)), "max_tokens": 2, **GREEDY}  # 2 pages, no hit

    async def send(url):
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            def post(body, rid):
                return asyncio.create_task(http.post(url + "/v1/completions", json=body,
                                                     headers={"X-Request-Id": rid}))
            first = post(holder, "holder")
            assert await asyncio.to_thread(adding.wait, 10)
            refused = [post({**big, "stream": stream}, f"big-{stream}")
                       for stream in (False, True)]
            deadline = time.monotonic() + 10
            while worker._commands.qsize() < 2:  # both queued behind the holder's add
                assert time.monotonic() < deadline, "the big prompts never reached the engine"
                await asyncio.sleep(0.005)
            release.set()  # the holder is added and prefilled; the big prompts come next
            return await asyncio.wait_for(asyncio.gather(first, *refused), 60)

    with ServerThread(app) as url:
        held, *answers = asyncio.run(send(url))
        assert held.status_code == 200 and len(held.json()["choices"][0]["token_ids"]) == 20
        for answer in answers:
            assert answer.status_code == 503, answer.text
            assert answer.headers["content-type"] == "application/json"  # no stream began
            assert answer.headers["retry-after"] == "1"
            error = answer.json()["error"]
            assert (error["code"], error["type"]) == ("cache_full", "server_error")
            assert "KV cache is full" in error["message"] and "20 tokens" in error["message"]
        fits = httpx.post(url + "/v1/completions", json=big, headers={"X-Request-Id": "fits"},
                          timeout=TIMEOUT)
        assert fits.status_code == 200 and len(fits.json()["choices"][0]["token_ids"]) == 2
        wait_idle(worker)
        text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
        kept, stats = worker.call(lambda e: (sorted(e.requests), e.stats())).result(10)
    assert finished(text, "rejected") == 2
    assert finished(text, "length") == 2
    assert metric_values(text)["minicb:prompt_tokens_total"] == 60  # the rejected were not taken
    assert kept == ["fits"] and worker._counted_early == set() and stats["pages_used"] == 0


def test_swapped_pages_are_counted_in_metrics_as_the_trace_sums(tiny_model):
    """preemption_mode="swap": a pool too small for four requests preempts, and the victims'
    K/V goes to host pages and back; /metrics counts the pages each way as the engine's trace
    does (and bench --endpoint reads them there), and its swap gauges show the space."""
    async def burst(url):
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            body = {"prompt": list(range(3, 23)), "max_tokens": 40, **GREEDY}
            return await asyncio.wait_for(asyncio.gather(*(
                http.post(url + "/v1/completions", json=body) for _ in range(4))), 60)

    with serving(tiny_model, num_pages=7, max_num_seqs=4, preemption_mode="swap",
                 num_swap_pages=6) as (url, worker):
        assert all(r.status_code == 200 for r in asyncio.run(burst(url)))
        wait_idle(worker)
        trace = worker.call(lambda e: [(r.pages_swapped_out, r.pages_swapped_in)
                                       for r in e.trace]).result(10)
        values = metric_values(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
        counters = client.server_counters(url)
    swapped_out, swapped_in = sum(o for o, _ in trace), sum(i for _, i in trace)
    # every victim came back; its prompt pages still cached (the four share one prompt) are
    # shared again, not copied in
    assert 0 < swapped_in < swapped_out
    assert int(values["minicb:kv_pages_swapped_out_total"]) == swapped_out
    assert int(values["minicb:kv_pages_swapped_in_total"]) == swapped_in
    assert (counters["swapped_out_pages"], counters["swapped_in_pages"]) == (swapped_out,
                                                                             swapped_in)
    assert values["minicb:kv_swap_pages_total"] == values["minicb:kv_swap_pages_free"] == 6


def test_the_client_counts_a_503_cache_full_as_rejected_not_as_an_error():
    """A server whose KV cache is full answers 503 cache_full: the client's record finishes as
    rejected (summarize counts it there, not among the errors) and the report says so; any
    other 503 stays an error, in the server's words."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def answer(request: Request):
        code = {"req-0": "cache_full", "req-1": None}.get(request.headers.get("x-request-id"),
                                                            "served")
        if code == "served":
            return StreamingResponse(iter([
                'data: {"choices": [{"index": 0, "text": "a", "token_ids": [5], '
                '"finish_reason": "length"}]}\n\n', "data: [DONE]\n\n"]),
                media_type="text/event-stream")
        return JSONResponse({"error": {"message": "busy", "type": "server_error",
                                       "param": None, "code": code}}, status_code=503)

    workload = make_workload(3, prompt_lengths="fixed:4", output_lengths="fixed:1", seed=0)
    with ServerThread(app) as url:
        data = bench_endpoint(url, workload, label="x", model="x", vocab_size=256)
    records = {r["request_id"]: r for r in data["records"]}
    assert [records[f"req-{i}"]["finish_reason"] for i in range(3)] == [
        "rejected", "error", "length"]
    assert records["req-0"]["error"] is None
    summary = data["results"]["x"]
    assert (summary["rejected"], summary["errors"], summary["completed"]) == (1, 1, 1)
    assert summary["error_reasons"] == {"HTTP 503: busy": 1}
    assert summary["swapped_out_pages"] is None  # engine-only, and this server has no /metrics
    assert "x: 1 rejected (HTTP 503 cache_full" in client.report(data["results"])


def test_serve_cli_passes_the_full_cache_answers_to_the_engine(tiny_llama_dir, monkeypatch,
                                                               capsys):
    """--preemption-mode, --num-swap-pages and --reject-when-full reach the engine; bad values
    are named before any model loads."""
    import uvicorn

    import minicb.llm
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    base = ["--model", str(tiny_llama_dir), "--device", "cpu", "--num-pages", "32"]
    assert main([*base, "--preemption-mode", "swap", "--num-swap-pages", "5",
                 "--reject-when-full"]) == 0
    assert main(base) == 0
    configs = [(a.state.worker.engine.config, a.state.worker.engine.pool) for a in apps]
    assert [(c.preemption_mode, p.num_swap_pages, c.reject_when_full) for c, p in configs] == [
        ("swap", 5, True), ("recompute", 0, False)]
    monkeypatch.setattr(minicb.llm, "LLM", lambda *a, **k: pytest.fail("a model loaded"))
    for argv, message in (
            (["--num-swap-pages", "5"],
             "--num-swap-pages sizes the swap space: it needs --preemption-mode swap"),
            (["--preemption-mode", "swap", "--num-swap-pages", "0"],
             "--num-swap-pages must be >= 1, got 0"),
            (["--preemption-mode", "lifo"], "argument --preemption-mode: invalid choice")):
        with pytest.raises(SystemExit) as exit_info:
            main([*base, *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


# ---------------------------------------------------------------------- the simulated engine
T = SIM_TOKEN  # the simulated model's only answer: a prompt of T's keeps every guess


@contextmanager
def sim_server(max_queue=64, **options):
    """A server on the simulated engine; yields (url, worker, engine, http)."""
    engine = make_sim_engine(policy="pd", **options)
    app = create_app(engine, "sim", max_queue=max_queue)
    with ServerThread(app) as url, httpx.Client(timeout=TIMEOUT) as http:
        yield url, app.state.worker, engine, http


# ------------------------------------------------------------------------------ /metrics
def test_metrics_gauges_show_their_own_stat_and_counters_are_typed_counter():
    """Each gauge shows its own engine count (the free pages are the free list, not total
    minus used); every counter is typed counter; every finish reason shows from the start."""
    worker = EngineWorker(make_sim_engine(policy="pd"))  # never started
    worker.stats.set_gauges(dict(num_waiting=1, num_running=2, pages_used=3, pages_free=4,
                                 pages_cached=5, pages_total=12, swap_pages_free=6,
                                 swap_pages_total=7), 0.0)
    text = worker.metrics_text().decode()
    values = metric_values(text)
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name, value in (("num_requests_waiting", 1), ("num_requests_running", 2),
                        ("kv_pages_used", 3), ("kv_pages_free", 4), ("kv_pages_cached", 5),
                        ("kv_pages_total", 12), ("kv_swap_pages_free", 6),
                        ("kv_swap_pages_total", 7), ("kv_cache_usage_perc", 0.25)):
        assert values[f"minicb:{name}"] == value and kinds[f"minicb:{name}"] == "gauge"
    for name in ("num_preemptions", "prompt_tokens", "generation_tokens", "steps",
                 "request_success", "preemption_discarded_tokens",
                 "preemption_recomputed_tokens", "kv_pages_evicted", "kv_pages_swapped_out",
                 "kv_pages_swapped_in", "prefix_cache_queries", "prefix_cache_hits"):
        assert kinds[f"minicb:{name}"] == "counter"
    for reason in ("stop", "length", "cancelled", "error", "deadline", "rejected"):
        assert finished(text, reason) == 0
    assert 'model_name="sim"' not in text and 'model_name="minicb"' in text


def test_metrics_count_prompt_tokens_steps_and_the_whole_gap_of_a_speculative_step():
    """prompt_tokens counts tokens, steps counts steps, and the gap of a step that kept
    guesses is measured from the previous delivery, not from the step's own tokens."""
    with sim_server(num_speculative_tokens=3) as (url, worker, engine, http):
        for prompt in ([T] * 8, [T] * 5):
            body = {"prompt": prompt, "max_tokens": 25, **GREEDY}
            assert http.post(url + "/v1/completions", json=body).status_code == 200
        wait_idle(worker)
        steps, records = worker.call(
            lambda e: (len(e.trace), metrics.request_records(e))).result(10)
        values = metric_values(http.get(url + "/metrics").text)
    assert values["minicb:prompt_tokens_total"] == 13
    assert values["minicb:steps_total"] == steps > 0
    assert values["minicb:generation_tokens_total"] == 50
    gaps = sum(r.token_times[-1] - r.first_token_time for r in records)  # deliveries' gaps
    assert gaps > 0
    assert values["minicb:inter_token_latency_seconds_sum"] == pytest.approx(gaps)


# ------------------------------------------------------------------------------ responses
def test_a_speculative_stream_reports_usage_in_tokens_and_openai_chunk_fields():
    """The streamed usage counts tokens, not chunks (a step that kept guesses delivers
    several); with include_usage every chunk before the usage chunk has `"usage": null`; a
    completion's object is "text_completion"."""
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
    """A request cancelled in the engine (here through worker.call) while another keeps the
    engine stepping ends with finish_reason "abort", as vLLM says it."""
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
    """A request cancelled through worker.call while no other request runs ends its stream at
    once: no step comes to tell it, so the worker does; also when the command forgets it."""
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
    """A full queue answers 429 with Retry-After; an unexpected exception in a handler is a
    500 server_error naming it."""
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
    """/health answers 503 once the engine thread has stopped; /v1/models lists
    max_model_len; a chat request to a model without a chat template is refused with the hint
    to use /v1/completions."""
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
    """A prompt beyond the context is refused with OpenAI's code context_length_exceeded."""
    with sim_server() as (url, _, _, http):
        r = http.post(url + "/v1/completions", json={"prompt": [T] * 8190, "max_tokens": 16})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_finished_and_disconnected_requests_leave_no_stream_behind():
    """A finished or cancelled request's stream bookkeeping is dropped: a long-running
    server's `_streams` does not grow with every request."""
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
    """A submit whose caller stops waiting while the engine adds it cancels the request it
    leaves behind, even while the caller's event loop stays open (a server's does)."""
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


# ------------------------------------------------------------------------------ the schema
@pytest.mark.parametrize("body, param", [
    ({"n": 0}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": "usage"}, "stream_options"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["w5", ""]}, "stop"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt": [True, 5]}, "prompt"),
])
def test_the_schema_refuses_each_bad_field(body, param):
    """Each bad value is refused naming its field: n below 1, a stream or ignore_eos that is
    not a boolean, stream_options not an object, a temperature above 2, a top_k below -1, an
    empty stop string (it would match at once), logprobs above 20, a boolean as a token id."""
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": [5, 6], **body})
    assert validation_error(info.value.errors())[1] == param


def test_logprobs_0_asks_for_the_chosen_tokens_and_false_or_null_for_none():
    """OpenAI's logprobs=0 returns the chosen tokens' logprobs (0 == False, yet it asks);
    chat's logprobs=false or null asks for none."""
    assert logprobs_wanted(CompletionRequest(prompt=[5], logprobs=0), chat=False) == 0
    assert logprobs_wanted(CompletionRequest(prompt=[5]), chat=False) is None
    for absent in (None, False):
        chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                     logprobs=absent, top_logprobs=3)
        assert logprobs_wanted(chat, chat=True) is None


def test_the_schema_defaults_batches_of_one_and_merges_stop_ids():
    """/v1/completions defaults max_tokens to 16 (OpenAI's); chat leaves it to the room left;
    a batch of one prompt (["..."] or [[ids]]) is that prompt; token ids given as `stop` join
    stop_token_ids."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert sampling_params(CompletionRequest(prompt=[5]), chat=False)["max_tokens"] == 16
    assert sampling_params(ChatCompletionRequest(**chat), chat=True)["max_tokens"] is None
    assert sampling_params(ChatCompletionRequest(**chat, max_tokens=7),
                           chat=True)["max_tokens"] == 7
    assert CompletionRequest(prompt=[[5, 6]]).prompt == [5, 6]
    assert CompletionRequest(prompt=["w5 w6"]).prompt == "w5 w6"
    req = CompletionRequest(prompt=[5], stop=[3], stop_token_ids=[7])
    assert sampling_params(req, chat=False)["stop_token_ids"] == (7, 3) and stop_text(req) == ()


# ------------------------------------------------------------------------------ chat and stop
def test_chat_without_max_tokens_fills_the_pool_and_has_chat_ids(word_model):
    """A chat without max_tokens may take the room the page pool leaves (not max_model_len
    minus the prompt, which could never fit); a chat answer's id begins "chatcmpl-"."""
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
    """A stop string across two tokens stops the answer, and no part of it is streamed: text
    that might begin a stop string is held back until it is known not to."""
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
    """Overlapping stop strings cut the text at the first; a stop string in the token that
    reaches min_tokens counts (vLLM looks from min_tokens on)."""
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
    """A chunk counts as many tokens as its token_ids hold (a speculating server's kept
    guesses); a chunk without tokens (the finish) gets no token time, so no false gap."""
    records = _run(_fake(_chunk([1, 2, 3]), _chunk([4]), _chunk([], "length")), ONE)
    r = records[0]
    assert (r.num_output_tokens, len(r.token_times), r.finish_reason) == (4, 2, "length")


def test_the_client_maps_abort_and_survives_a_bad_chunk():
    """A server's finish_reason "abort" (vLLM's) is recorded as "cancelled"; a chunk that is
    not JSON fails that request, not the whole run."""
    aborted = _run(_fake(_chunk([1]), _chunk([2], "abort")), ONE)
    assert aborted[0].finish_reason == "cancelled"
    broken = _run(_fake(_chunk([1]), "{not json"), ONE)
    assert broken[0].finish_reason == "error"
    assert broken[0].error.startswith("JSONDecodeError")


def test_the_client_reads_data_lines_without_a_space():
    """SSE allows "data:" with no space after it: those lines are read too."""
    chunks = [f"data:{json.dumps(_chunk([1]))}\n\n",
              f"data:{json.dumps(_chunk([2], 'length'))}\n\n"]
    records = _run(_fake(*chunks), ONE)
    assert (records[0].num_output_tokens, records[0].finish_reason) == (2, "length")


def test_the_client_ends_e2e_at_the_end_of_the_stream():
    """E2E ends when the stream ends: the usage chunk and [DONE] come after the last token,
    and a user waits for them."""
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1,
                                      "total_tokens": 5}}
    r = _run(_fake(_chunk([1], "length"), usage, delay_after=0.3), ONE)[0]
    assert r.finish_time - r.token_times[-1] >= 0.25


def test_the_client_sends_the_sampling_fields_and_keeps_the_servers_counts():
    """The client sends its temperature, a seed per request when sampling, and
    stream_options.include_usage; folds prompt ids below vocab_size; records the server's
    usage.prompt_tokens, not its own prompt length."""
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
    """Each request leaves at its arrival time; a failed warm-up request raises before
    anything is measured."""
    requests = [WorkloadRequest(prompt_len=4, max_tokens=1, arrival_time=t) for t in (0, 0.3)]
    records = _run(_fake(_chunk([1], "length")), requests)
    assert records[1].arrival_time >= 0.29  # seconds since the run started
    with pytest.raises(RuntimeError, match="warm-up request failed"):
        _run(_fake(_chunk([1], "length"), refuse=lambda body: True), requests, warmup=True)


def test_bench_endpoint_reports_no_queue_age_when_requests_failed():
    """The client sees no queue time: a request that failed before its first token must not
    count its whole E2E as a queue wait."""
    refuse = lambda body: body["max_tokens"] != 2  # noqa: E731 - the warm-up probe passes
    workload = Workload("t", [WorkloadRequest(prompt_len=4, max_tokens=3)] * 2)
    with ServerThread(_fake(_chunk([1], "length"), refuse=refuse)) as url:
        summary = bench_endpoint(url, workload, label="x", model="m")["results"]["x"]
    assert summary["errors"] == 2
    assert summary["max_queue_age_s"] is None and summary["max_queue_age_steps"] is None


def test_completion_and_model_urls_from_any_endpoint_form():
    """Any form of a server's URL gives its completions, chat and models URLs."""
    for endpoint in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/",
                     "http://h:1/v1/completions"):
        assert completions_url(endpoint) == "http://h:1/v1/completions"
        assert models_url(endpoint) == "http://h:1/v1/models"
    assert completions_url("http://h:1", chat=True) == "http://h:1/v1/chat/completions"


def test_the_servers_swap_counters_grow_each_way_as_the_steps_copy():
    """The server's swap counters grow each way as the steps copy."""
    engine = three_in_six(num_swap_pages=2)
    worker = EngineWorker(engine)  # not started: its per-step counting is driven here
    seen = []
    while engine.has_unfinished():
        rec = engine.step()
        before = (worker.stats.value("kv_pages_swapped_out"),
                  worker.stats.value("kv_pages_swapped_in"))
        worker._count(rec)
        worker._retire(rec)
        grew = (worker.stats.value("kv_pages_swapped_out") - before[0],
                worker.stats.value("kv_pages_swapped_in") - before[1])
        if grew != (0, 0):
            seen.append(grew)
    assert seen == [(2, 0), (0, 2)]
    assert worker.stats.value("kv_swap_pages_free") == 2


@pytest.mark.parametrize("status, body", [
    (500, '{"error": {"code": "cache_full"}}'),  # only a 503 is the full-cache answer
    (503, '{"error": "busy"}'),  # an error that is no object
    (503, "[1, 2]"),  # JSON with no .get
    (503, "busy"),  # no JSON
])
def test_only_a_503_with_code_cache_full_is_a_rejection(status, body):
    """Only a 503 whose error code is cache_full counts as a rejection; an odd body counts as an
    error, without crashing the client."""
    assert client._is_rejection(status, body) is False
    assert client._is_rejection(503, '{"error": {"code": "cache_full"}}') is True


def test_a_servers_error_is_its_message_or_the_start_of_its_body():
    """A refusal is reported in the server's words: the OpenAI error's message, an error
    given as a plain string, or the first 200 characters of a body that is not JSON."""
    assert client._server_error(400, '{"error": {"message": "too long"}}') == \
        "HTTP 400: too long"
    assert client._server_error(503, '{"error": "overloaded"}') == "HTTP 503: overloaded"
    page = "<html>" + "x" * 1000 + "</html>"
    assert client._server_error(502, f"  {page}\n") == f"HTTP 502: {page[:200]}"


def test_describe_errors_plurals_and_hints_only_for_a_trace_field():
    """describe_errors gives one line per reason, in the singular for one request, and
    suggests --omit-field only when a reason names a field a replayed trace sends."""
    text = client.describe_errors({"error_reasons": {"HTTP 500: boom": 2, "HTTP 400: x": 1}})
    assert text.splitlines() == ["error: 2 requests failed: HTTP 500: boom",
                                 "error: 1 request failed: HTTP 400: x"]
    assert client.describe_errors({"error_reasons": {"HTTP 400: bad deadline": 3}}).endswith(
        "leave it out with --omit-field)")
    assert client.describe_errors({"error_reasons": {}}) == client.describe_errors({}) == ""


def test_error_reasons_count_only_failed_requests():
    """error_reasons counts the failed requests only: stopped, cancelled, late and
    length-ended ones are no failures; a failure without a reason is "unknown"."""
    records = [rec(f"r{i}", 2, why) for i, why in enumerate(("stop", "cancelled", "deadline",
                                                             "length"))]
    records += [dataclasses.replace(rec("e1", 0, "error"), error="HTTP 400: no"),
                rec("e2", 0, "error")]
    assert client.error_reasons(records) == {"HTTP 400: no": 1, "unknown": 1}


def dead_endpoint() -> str:
    """The URL of a port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_failures_keep_their_reason_in_the_stream_and_on_the_wire(capsys):
    """A failed request keeps its reason: an error chunk in a 200 stream (vLLM's way) and a
    refused connection each give theirs to error_reasons, and bench serve prints the reasons
    under its summary."""
    workload = Workload("t", [WorkloadRequest(prompt_len=4, max_tokens=2)] * 2)
    with ServerThread(_fake('{"error": {"message": "boom"}}')) as url:
        records = asyncio.run(run_client(url, workload.requests, model="m", warmup=False))
        assert main_cli(["bench", "serve", "--base-url", url, "--model", "m", "--num-prompts",
                         "2", "--random-input-len", "4", "--random-output-len", "2",
                         "--disable-tqdm"]) == 0
    assert client.error_reasons(records) == {"HTTP 200: boom": 2}
    assert "error: 2 requests failed: HTTP 200: boom" in capsys.readouterr().err
    records = asyncio.run(run_client(dead_endpoint(), workload.requests, model="m",
                                     warmup=False))
    assert [r.finish_reason for r in records] == ["error", "error"]
    assert all(r.error.startswith("ConnectError: ") for r in records)


def test_a_server_answering_404_at_the_endpoint_is_named_not_a_traceback():
    """Something other than a server answering at the endpoint (a 404 from a wrong port or
    path) is one line naming the endpoint, as a refused connection is."""
    import http.server
    import re

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the http.server name)
            self.send_error(404)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/wrong"
    try:
        told = f"(?s)cannot reach {re.escape(url)} .*is the server running"
        with pytest.raises(ValueError, match=told):
            bench_endpoint(url, make_workload(1), progress=False)
    finally:
        server.shutdown()
        server.server_close()


def test_bench_endpoint_leaves_every_engine_only_field_null():
    """From the client's side every figure only the server's engine knows is null, not 0 (a
    server with a prefix cache must not read as caching nothing); the model the caller names
    is the one sent (this server has no /v1/models)."""
    engine_only = ("num_steps", "preemptions", "discarded_tokens", "recomputed_tokens",
                   "evicted_pages", "dead_slot_steps", "mean_batch_size",
                   "output_tokens_per_step", "decode_tokens_per_s", "host_time_fraction",
                   "cached_prompt_tokens", "prefill_tokens", "decode_tokens", "decode_rows",
                   "mixed_steps", "draft_tokens", "accepted_draft_tokens")
    chunks = [{"choices": [{"text": "a", "finish_reason": why}]} for why in (None, "length")]
    seen: list[dict] = []
    with ServerThread(_fake(*chunks, seen=seen)) as url:
        data = bench_endpoint(url, make_workload(2, output_lengths="fixed:2"), label="x",
                              model="mine")
    summary = data["results"]["x"]
    assert summary["completed"] == 2 and {body["model"] for body in seen} == {"mine"}
    assert {key: summary[key] for key in engine_only} == dict.fromkeys(engine_only)


def test_server_counters_read_a_label_value_with_a_brace_and_survive_a_dead_server():
    """server_counters reads a counter whose label value holds a brace, and gives {} for a
    server that does not answer, so a server that dies as the run ends costs no results."""
    app = FastAPI()
    text = 'vllm:num_preemptions_total{model_name="a}b"} 4.0\n'
    app.get("/metrics")(lambda: Response(text, media_type="text/plain"))
    with ServerThread(app) as url:
        assert client.server_counters(url) == {"preemptions": 4.0}
    assert client.server_counters(dead_endpoint()) == {}


def test_bench_endpoint_reports_no_growth_for_a_counter_missing_before_the_run(monkeypatch):
    """A counter in the /metrics read after the run but not in the one before (a server that
    began exporting it mid-run) has no growth to report: it stays null, and the declaration
    still names what the server's /metrics held."""
    reads = iter([{}, {"preemptions": 3.0}])
    monkeypatch.setattr(client, "server_counters", lambda endpoint: next(reads))
    workload = Workload("t", [WorkloadRequest(prompt_len=4, max_tokens=1)])
    with ServerThread(_fake(_chunk([1], "length"))) as url:
        data = client.bench_endpoint(url, workload, label="x", model="m")
    summary = data["results"]["x"]
    assert summary["from_server_metrics"] == [] and summary["preemptions"] is None
    assert "preemptions" in data["declaration"]["server_metrics"]


def test_report_prints_the_server_metrics_line_of_every_result():
    """The client's report prints the server-metrics line of every result that has one."""
    text = client.report({"a": {"from_server_metrics": ["preemptions"], "preemptions": 3},
                          "b": {"from_server_metrics": ["num_steps"], "num_steps": 9},
                          "c": {"from_server_metrics": []}})
    assert text.endswith("\na, from the server's /metrics over the run: preemptions=3"
                         "\nb, from the server's /metrics over the run: num_steps=9")


@pytest.mark.parametrize("vocab_size", [0, 2.5, True])
def test_run_client_refuses_a_vocab_size_that_is_not_a_positive_int(vocab_size):
    """run_client refuses a vocab_size that is not a positive integer before it sends
    anything (prompt ids are folded by it)."""
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        asyncio.run(run_client(dead_endpoint(), ONE, model="m", vocab_size=vocab_size))


# ------------------------------------------------------------------------------ the worker
def drive(engine, worker, added=None):
    """Step `engine` to the end as the worker's thread would (count, then retire); `added`:
    {step: [(prompt, params, id)]} to add after that step. Yields each record."""
    while engine.has_unfinished():
        record = engine.step()
        worker._count(record)
        worker._retire(record)
        for prompt, params, rid in (added or {}).get(record.step, []):
            engine.add_request(prompt, params, request_id=rid)
        yield record


def test_oldest_wait_is_the_oldest_unscheduled_request_and_preempted_ones_do_not_count():
    """The oldest-wait gauge is the wait of the longest-waiting request never yet scheduled,
    in seconds, in /metrics as in the worker: a preempted request waiting again (b, preempted,
    arrived before c and d) does not count."""
    engine = make_sim_engine(policy="continuous", num_pages=4, max_num_seqs=2)
    worker = EngineWorker(engine)  # not started: its per-step counting is driven here
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(3, 30)), long, request_id="a")
    engine.add_request(list(range(40, 67)), long, request_id="b")
    short = SamplingParams(max_tokens=2)
    checked = 0
    for record in drive(engine, worker, {3: [([5, 6, 7], short, "c")],
                                         4: [([8, 9, 7], short, "d")]}):
        unscheduled = [engine.requests[r].metrics.arrival_time for r in ("c", "d")
                       if r in record.waiting]
        expected = record.t_end - min(unscheduled) if unscheduled else 0.0
        assert worker.oldest_waiting_s == pytest.approx(expected), record.step
        if "b" in record.waiting and len(unscheduled) == 2:
            checked += 1
            shown = metric_values(worker.metrics_text())["minicb:oldest_waiting_seconds"]
            assert shown == pytest.approx(worker.oldest_waiting_s)
    assert checked > 5 and engine.requests["b"].num_preemptions == 1


def test_evicted_pages_count_every_page_a_step_evicts():
    """The evicted-pages counter grows by every page a step evicts; here one prefill evicts
    several cached pages at once."""
    engine = make_sim_engine(policy="continuous", num_pages=6, max_num_seqs=1)
    worker = EngineWorker(engine)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request([7] * 64, params, request_id="a")  # leaves 4 cached prompt pages
    engine.add_request(list(range(100, 180)), params, request_id="b")  # 5 pages, 2 free
    evicted = [record.pages_evicted for record in drive(engine, worker)]
    assert max(evicted) >= 2 and worker.stats.value("kv_pages_evicted") == sum(evicted)


def test_serve_accepts_every_log_level_uvicorn_knows(capsys):
    """serve's --log-level takes every level uvicorn knows, "trace" included. The port check
    after parsing stops main before any model loads."""
    from uvicorn.config import LOG_LEVELS
    for level in LOG_LEVELS:
        with pytest.raises(SystemExit):
            main(["--log-level", level, "--port", "70000"])
        assert "--port must be in [0, 65535]" in capsys.readouterr().err, level
