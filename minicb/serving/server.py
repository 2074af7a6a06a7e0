"""An OpenAI-compatible HTTP server in front of one running engine (chapter 08).

    python -m minicb serve --model smollm2-135m --policy pd --port 8000

Endpoints: POST /v1/completions and /v1/chat/completions (streamed as server-sent events or
not; request schema in `minicb.serving.protocol`), GET /v1/models and /v1/models/{id}, POST
/tokenize and /detokenize (vLLM's), GET /health, GET /metrics (Prometheus). Each choice carries
the generated `token_ids` as an extra field (vLLM's `return_token_ids`), so a checkpoint without a
tokenizer can still be checked token for token. The engine runs on its own thread
(`minicb.serving.worker`). A body larger than `max_request_bytes` is refused (413) before it is
read whole; with `api_key`, every /v1 call needs `Authorization: Bearer <key>` (401)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, StrictInt
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from minicb.cli import add_full_cache_arguments, check_full_cache_flags
from minicb.cli import parser as make_parser
from minicb.config import QUANTIZATIONS
from minicb.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Sampling,
    Text,
    error_body,
    logprobs_wanted,
    sampling_params,
    stop_text,
    validation_error,
)
from minicb.serving.worker import CacheFull, EngineWorker, Event, InvalidRequest, Job, QueueFull

MAX_REQUEST_BYTES = 4 * 2**20  # a 128k-token prompt as JSON token ids is about 1 MB


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           kind: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param, code, kind), status_code=status,
                        headers=headers)


class Gate:
    """ASGI middleware in front of the app: with `api_key`, a /v1 call without
    `Authorization: Bearer <api_key>` is refused (401); a request body over `max_bytes` is
    refused (413), by its Content-Length before reading it, or by the bytes received so far
    when it streams without one; a body under the limit is handed on as it came."""

    def __init__(self, app: Any, max_bytes: int, api_key: str | None = None) -> None:
        self.app, self.max_bytes, self.api_key = app, max_bytes, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"].startswith("/v1") and \
                headers.get(b"authorization") != f"Bearer {self.api_key}".encode():
            return await _error(401, "invalid or missing API key (send the header "
                                "Authorization: Bearer <key>)",
                                code="invalid_api_key")(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length", b"").decode(errors="replace")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # a disconnect: the app hears it
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(scope, send)
            if not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()
        await self.app(scope, replay, send)

    async def _refuse(self, scope, send) -> None:
        response = _error(413, f"the request body is larger than the server's limit of "
                               f"{self.max_bytes} bytes (--max-request-bytes)",
                          code="request_too_large")
        await response(scope, None, send)


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


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's)."""

    model: str | None = None
    prompt: Text
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's)."""

    model: str | None = None
    tokens: list[StrictInt] = Field(max_length=1 << 20)


class Formatter:
    """Turns a choice's tokens and logprobs into OpenAI's response shapes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        """A token as text; `token_id:N` without a tokenizer (vLLM's form)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]],
                            offset: int) -> dict[str, Any]:
        """The completions format: parallel lists; `offset`: characters of text before."""
        tokens = [self.token(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lp.get(t) for t, lp in
                                                     zip(token_ids, logprobs)],
                "top_logprobs": [{self.token(k): v for k, v in lp.items()} for lp in logprobs],
                "text_offset": offsets}

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]],
                      top: int) -> dict[str, Any]:
        """The chat format: one entry per token, with its `top` likeliest alternatives."""
        def entry(token_id: int, value: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}
        return {"content": [
            {**entry(t, lp.get(t)), "top_logprobs": [
                entry(k, v) for k, v in sorted(lp.items(), key=lambda kv: -kv[1])[:top]]}
            for t, lp in zip(token_ids, logprobs)]}


def create_app(engine_or_llm: Any, model_name: str = "minicb", max_queue: int | None = 256,
               max_trace: int = 10_000, max_finished: int = 10_000,
               default_max_tokens: int | None = None, api_key: str | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app around one engine (chapter 08). `engine_or_llm`: an Engine or an LLM.
    The worker is `app.state.worker`; it starts with the app (or at the first request)."""
    engine = getattr(engine_or_llm, "engine", engine_or_llm)
    worker = EngineWorker(engine, model_name, max_queue=max_queue, max_trace=max_trace,
                          max_finished=max_finished, default_max_tokens=default_max_tokens)
    fmt = Formatter(worker.tokenizer)

    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.stop()

    # strict_content_type off: a JSON body sent without its Content-Type is still read
    app = FastAPI(title="minicb", lifespan=lifespan, strict_content_type=False)
    app.add_middleware(Gate, max_bytes=max_request_bytes, api_key=api_key)
    app.state.worker = worker
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message, param = validation_error(list(exc.errors()))
        return _error(400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        cause = exc.__cause__
        if isinstance(cause, ClientDisconnect):  # hung up while sending the body
            return _error(400, "the client disconnected before its request was read")
        if isinstance(cause, RecursionError):
            return _error(400, "the request body is nested too deeply")
        if isinstance(cause, ValueError):  # UnicodeDecodeError, an int of 4301+ digits
            return _error(400, f"the request body is not valid JSON: {cause}")
        return _error(exc.status_code, str(exc.detail), headers=exc.headers)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "minicb",
                "root": model_name, "max_model_len": worker.max_model_len}

    @app.get("/health")
    async def health():
        if not worker.alive and worker._thread is not None:
            return _error(503, "the engine thread has stopped", kind="server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            return _error(404, f"the model `{model_id}` does not exist; this server serves "
                          f"`{model_name}`", "model", "model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics():
        return Response(worker.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        try:
            ids = await asyncio.to_thread(worker.engine.tokenize, body.prompt,
                                          body.add_special_tokens)
        except ValueError as exc:
            return _error(400, str(exc), "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": worker.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        try:
            return {"prompt": await asyncio.to_thread(worker.detokenize, body.tokens)}
        except InvalidRequest as exc:
            return _error(400, str(exc), exc.param)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _generate(body, request, chat=True)

    async def _generate(req: Sampling, request: Request, chat: bool):
        if req.model not in (None, model_name):
            return _error(404, f"the model `{req.model}` does not exist; this server serves "
                          f"`{model_name}`", "model", "model_not_found")
        echo = not chat and req.echo
        if echo and req.logprobs is not None:
            return _error(400, "echo with logprobs needs the prompt's logprobs, which minicb "
                          "does not compute", "echo")
        messages = [m.as_template_input() for m in req.messages] if chat else None
        try:
            job = await worker.submit(
                None if chat else req.prompt, sampling_params(req, chat), messages,
                stop_text(req), request.headers.get("x-request-id"), req.user, req.priority,
                req.deadline, req.n)
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
        prompt_text = ""
        if echo:
            prompt_text = req.prompt if isinstance(req.prompt, str) else \
                "" if worker.tokenizer is None else worker.tokenizer.decode(req.prompt)
        response = Answer(job, chat, req, model_name, fmt, prompt_text)
        if req.stream:
            return _EventStream(response.events(), lambda: response.close(worker))
        return await response.whole(request, worker)

    return app


class Answer:
    """One request's answer, whole or streamed, in the completions or the chat format."""

    def __init__(self, job: Job, chat: bool, req: Sampling, model_name: str, fmt: Formatter,
                 prompt_text: str) -> None:
        self.job, self.chat, self.fmt = job, chat, fmt
        self.top = logprobs_wanted(req, chat)
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        kind = ("chat.completion.chunk" if req.stream else "chat.completion") if chat \
            else "text_completion"
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{job.request_id}",
                     "object": kind, "created": int(time.time()), "model": model_name}
        self.prompt_text = prompt_text  # echo: before each choice's text
        self.text_so_far = [0] * len(job.request_ids)  # characters, for text_offset

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = self.job.num_prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    def choice(self, ev: Event, streaming: bool, first: bool = False) -> dict[str, Any]:
        text = self.prompt_text + ev.text if first else ev.text
        out: dict[str, Any] = {"index": ev.index}
        if self.chat and streaming:
            out["delta"] = {"content": text} if text else {}
        elif self.chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["text"] = text
        logprobs = None
        if self.top is not None and ev.logprobs is not None:
            logprobs = self.fmt.chat_logprobs(ev.token_ids, ev.logprobs, self.top) if self.chat \
                else self.fmt.completion_logprobs(ev.token_ids, ev.logprobs,
                                                  self.text_so_far[ev.index])
        self.text_so_far[ev.index] += len(text)
        reason = ev.finish_reason if ev.finish_reason != "cancelled" else "abort"
        return {**out, "token_ids": ev.token_ids, "logprobs": logprobs, "finish_reason": reason}

    def close(self, worker: EngineWorker) -> None:
        if not self.job.done:
            worker.cancel(self.job)

    async def events(self) -> AsyncIterator[str]:
        job, n_tokens, started = self.job, 0, set()
        if self.chat:
            for i in range(len(job.request_ids)):
                yield _sse({**self.head, "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}]})
        while not job.done:
            ev = await job.events.get()
            if ev.finish_reason is not None:
                job.finished.add(ev.index)
            n_tokens += len(ev.token_ids)
            if ev.error:
                yield _sse(error_body(ev.error, kind="server_error"))
            chunk = {**self.head, "choices": [self.choice(ev, True, ev.index not in started)]}
            started.add(ev.index)
            if self.include_usage:
                chunk["usage"] = None
            yield _sse(chunk)
        if self.include_usage:
            yield _sse({**self.head, "choices": [], "usage": self.usage(n_tokens)})
        yield _sse("[DONE]")

    async def whole(self, request: Request, worker: EngineWorker) -> Any:
        job = self.job
        n = len(job.request_ids)
        token_ids: list[list[int]] = [[] for _ in range(n)]
        texts, logprobs = [""] * n, [[] for _ in range(n)]
        last: list[Event | None] = [None] * n
        loop = asyncio.get_running_loop()
        check_at = loop.time() + 0.25
        try:
            while not job.done:
                try:  # wait for the next tokens, and look for a client gone every 0.25 s
                    ev = await asyncio.wait_for(job.events.get(), max(0, check_at - loop.time()))
                    token_ids[ev.index] += ev.token_ids
                    texts[ev.index] += ev.text
                    logprobs[ev.index] += ev.logprobs or []
                    last[ev.index] = ev
                    if ev.finish_reason is not None:
                        job.finished.add(ev.index)
                except TimeoutError:
                    pass
                if loop.time() >= check_at:
                    if await request.is_disconnected():
                        break
                    check_at = loop.time() + 0.25
        finally:
            self.close(worker)
        if not job.done:
            return _error(499, "the client closed the connection", kind="client_closed")
        failed = [ev for ev in last if ev is not None and ev.finish_reason == "error"]
        if failed:
            return _error(500, failed[0].error or "the engine failed this request",
                          kind="server_error")
        choices = [self.choice(Event(i, token_ids[i], texts[i], last[i].finish_reason,
                                     logprobs=logprobs[i] if self.top is not None else None),
                               False, first=True) for i in range(n)]
        return {**self.head, "choices": choices,
                "usage": self.usage(sum(map(len, token_ids)))}


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


def serve_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m minicb serve`."""
    parser = make_parser("serve", main.__doc__)
    parser.add_argument("--model", default="smollm2-135m",
                        help="the bundled model's name, or a Hugging Face checkpoint directory")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as `model` (None: --model)")
    parser.add_argument("--policy", default="pd", help="the scheduling policy: single, static, "
                        "dynamic, continuous, chunked or pd")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` "
                        "on every /v1 call (401 otherwise; None: no key)")
    parser.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                        help="refuse (413) a request body larger than this, before reading it")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests allowed to wait before the server answers 429 (0: no "
                        "limit)")
    parser.add_argument("--max-num-seqs", type=int, default=16,
                        help="requests in the running batch at most")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256,
                        help="tokens one step computes at most (the token budget)")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="chunked and pd: the largest prefill chunk (None: the policy's)")
    parser.add_argument("--num-pages", type=int, default=None,
                        help="KV pages in the pool (None: the engine's choice for the device)")
    parser.add_argument("--preemption", default="newest",
                        choices=["newest", "priority", "deadline", "fair"],
                        help="queue order and preemption: newest (first come first served), "
                             "priority (the requests' `priority`, smaller first, as vLLM's), "
                             "deadline (the requests' `deadline`, earliest first) or fair "
                             "(between the requests' `user`s)")
    parser.add_argument("--max-preemptions", type=int, default=None,
                        help="a bound on preemption loss: a request preempted this many times "
                             "comes back holding pages for its whole life and is never "
                             "preempted again (0: reserve every request's whole life; None: "
                             "no bound)")
    parser.add_argument("--default-max-tokens", type=int, default=None,
                        help="the max_tokens of a chat request that sets none (None: all the "
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
                             "tokens per decode step (None: off)")
    parser.add_argument("--log-level", default="info",  # uvicorn's names (a KeyError else)
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="what the server logs; info: a line per finished request")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m minicb serve`: load a model, start the engine thread, serve HTTP."""
    parser = serve_parser()
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
    if args.max_request_bytes < 1:
        parser.error(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
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
                     default_max_tokens=args.default_max_tokens, api_key=args.api_key,
                     max_request_bytes=args.max_request_bytes)
    logging.basicConfig(format="%(levelname)s: %(message)s")
    logging.getLogger("minicb.serving").setLevel(args.log_level.upper().replace("TRACE", "DEBUG"))
    if args.max_preemptions is not None and args.default_max_tokens is None:
        print("minicb: note: with --max-preemptions, a chat request without max_tokens may hold "
              "pages for the whole context; --default-max-tokens bounds it", flush=True)
    print(f"minicb: serving {name} (policy {args.policy}) on http://{args.host}:{args.port}/v1",
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
