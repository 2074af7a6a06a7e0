"""`python -m minicb bench serve` (chapters 06 and 08): measure a running OpenAI-compatible
server from the client side, with the command line of vLLM's `vllm bench serve`.

    python -m minicb serve --port 8000 &
    python -m minicb bench serve --backend openai --base-url http://127.0.0.1:8000 \\
        --dataset-name random --random-input-len 256 --random-output-len 64 --num-prompts 100 \\
        --request-rate inf --save-result

The flags the two share mean what they mean in vLLM; the summary block is vLLM's (milliseconds;
mean, median and P99 by default); the result file has vLLM's keys, so a script that reads a
vLLM result reads minicb's, and under "minicb" the benchmark contract's declaration and summary
(p50/p95/p99 of every latency, max ITL, goodput), in `python -m minicb bench`'s schema. Beside
vLLM's random dataset, `--workload` and `--workload-file` send minicb's scenarios and traces.
The random dataset's prompts are token ids (the `openai` backend); the `openai-chat` backend
sends their text, from the server's `/detokenize` (vLLM's and minicb's). As in vLLM, the random
dataset runs every request to its output length (`ignore_eos`); so do minicb's workloads."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from minicb.benchmark.flags import build_workload, check_wall_clock_span, check_writable
from minicb.benchmark.runs import write_json
from minicb.benchmark.workload import SCENARIOS, Lengths, Workload, make_workload
from minicb.cli import parser as make_parser

METRICS = {"ttft": ("TTFT", "Time to First Token"),  # vLLM's names and headers
           "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"),
           "e2el": ("E2EL", "End-to-end Latency"),
           "max_itl": ("max ITL", "Worst Inter-token Gap per Request")}  # minicb's own
GOODPUT_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e"}  # vLLM's -> minicb's SLO keys


def serve_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m minicb bench serve`."""
    p = make_parser("bench serve", __doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("openai", "openai-chat"), default="openai",
                   help="openai: /v1/completions with token-id prompts; openai-chat: "
                        "/v1/chat/completions with the prompts' text")
    p.add_argument("--base-url", default=None, help="the server's URL (None: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1", help="the server's host, without --base-url")
    p.add_argument("--port", type=int, default=8000, help="the server's port, without --base-url")
    p.add_argument("--endpoint", default=None, help="the API path (None: /v1/completions, or "
                   "/v1/chat/completions for openai-chat)")
    p.add_argument("--model", default=None, help="the model name to send (None: the server's "
                   "first in /v1/models)")
    p.add_argument("--label", default=None, help="the result's label and file name prefix "
                   "(None: --backend)")
    p.add_argument("--dataset-name", choices=("random",), default="random",
                   help="random: prompts of random token ids (vLLM's)")
    p.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens")
    p.add_argument("--random-output-len", type=int, default=128, help="output tokens")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)], r in [0, 1)")
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens every prompt starts with, before its random ones")
    p.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    p.add_argument("--output-len", type=int, default=None, help="sets --random-output-len")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests to send (None: 1000 of the random dataset, or the workload's "
                        "own number)")
    p.add_argument("--workload", choices=sorted(SCENARIOS), default=None,
                   help="minicb: send one of minicb's scenarios instead of the random dataset")
    p.add_argument("--workload-file", default=None, metavar="PATH",
                   help="minicb: replay a trace (bench --workload-file's format) instead")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s: Poisson (or gamma) arrivals; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="at most N requests unfinished at once (a closed loop; None: open)")
    p.add_argument("--seed", type=int, default=0, help="the random dataset's and arrivals' seed")
    p.add_argument("--ignore-eos", action="store_true",
                   help="run each request to its output length (always on here, as vLLM "
                        "sets it for the random dataset)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature to send (None: the server's default)")
    p.add_argument("--top-p", type=float, default=None, help="top_p to send (None: not sent)")
    p.add_argument("--top-k", type=int, default=None, help="top_k to send (None: not sent)")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help=f"comma-separated, among {','.join(METRICS)}")
    p.add_argument("--metric-percentiles", default="99",
                   help="comma-separated percentiles of each metric, e.g. 50,90,99")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs a request must meet to count in goodput: ttft, tpot, e2el in "
                        "milliseconds, e.g. ttft:500 tpot:50")
    p.add_argument("--save-result", action="store_true", help="write the result JSON")
    p.add_argument("--save-detailed", action="store_true",
                   help="with it, every request's lengths, TTFT, ITLs, start time and error")
    p.add_argument("--result-dir", default=None, help="where the result goes (None: here)")
    p.add_argument("--result-filename", default=None,
                   help="its name (None: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="minicb: fold prompt token ids below this (a tiny test model)")
    p.add_argument("--omit-field", action="append", default=[],
                   choices=("user", "priority", "deadline"),
                   help="minicb: a replayed trace's field not to send (repeatable)")
    return p


def goodput_slo(pairs: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` (vLLM's --goodput, milliseconds) -> minicb's SLO in seconds."""
    slo = {}
    for pair in pairs or ():
        key, colon, value = pair.partition(":")
        if key not in GOODPUT_KEYS or not colon:
            raise ValueError(f"--goodput takes KEY:MILLISECONDS with KEY among "
                             f"{', '.join(GOODPUT_KEYS)}, got {pair!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: {value!r} is not a number of ms") from None
        if not ms >= 0 or math.isinf(ms):
            raise ValueError(f"--goodput {pair!r}: the limit must be a finite number >= 0")
        slo[GOODPUT_KEYS[key]] = ms / 1000
    return slo


def random_workload(args: argparse.Namespace) -> Workload:
    """vLLM's random dataset: lengths uniform within the range ratio around the asked ones,
    arrivals all at once (rate inf), Poisson, or gamma with the burstiness."""
    r = args.random_range_ratio
    if not 0 <= r < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {r}")

    def lengths(n: int, flag: str) -> Lengths:
        if n < 1:
            raise ValueError(f"{flag} must be >= 1, got {n}")
        low, high = max(1, math.floor(n * (1 - r))), max(1, math.ceil(n * (1 + r)))
        return Lengths.fixed(n) if low == high else Lengths.uniform(low, high)

    rate = args.request_rate
    arrival = "all-at-once" if math.isinf(rate) else \
        "poisson" if args.burstiness == 1 else "gamma"
    return make_workload(args.num_prompts or 1000,
                         lengths(args.random_input_len, "--random-input-len"),
                         lengths(args.random_output_len, "--random-output-len"), arrival,
                         None if math.isinf(rate) else rate, args.burstiness, args.seed,
                         shared_prefix_len=args.random_prefix_len, name="random")


def workload_of(args: argparse.Namespace) -> Workload:
    """The requests to send: the random dataset, or minicb's scenario or trace."""
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.output_len
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got "
                         f"{args.request_rate}")
    if not args.burstiness > 0 or math.isinf(args.burstiness):
        raise ValueError(f"--burstiness must be a finite number > 0, got {args.burstiness}")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.workload is None and args.workload_file is None:
        return random_workload(args)
    if args.workload and args.workload_file:
        raise ValueError("give --workload or --workload-file, not both")
    rate = None if math.isinf(args.request_rate) else args.request_rate
    return build_workload(argparse.Namespace(
        workload=args.workload, workload_file=args.workload_file, num_requests=args.num_prompts,
        rate=rate, burstiness=args.burstiness if rate and args.burstiness != 1 else None,
        seed=args.seed if args.workload else None, prompt_lengths=None, output_lengths=None),
        rate_flag="--request-rate")


def texts_of(base_url: str, workload: Workload, vocab_size: int | None,
             headers: dict[str, str]) -> list[str]:
    """Each prompt's text, from the server's /detokenize (for the chat backend)."""
    import httpx

    from minicb.serving.client import _prompt
    out = []
    with httpx.Client(timeout=60.0, headers=headers) as http:
        for i, req in enumerate(workload.requests):
            r = http.post(base_url + "/detokenize", json={"tokens": _prompt(req, i, vocab_size)})
            if r.status_code != 200:
                raise ValueError(f"the chat backend needs the prompts' text, from the server's "
                                 f"/detokenize, which answered {r.status_code}: {r.text[:200]}")
            out.append(r.json()["prompt"])
    return out


def vllm_metrics(records: list[dict[str, Any]], slo: dict[str, float],
                 percentiles: list[float], selected: list[str]) -> dict[str, Any]:
    """vLLM's result keys from the client's request records (times in seconds since the
    start): counts, throughputs, and for each selected metric its mean, median, std and
    percentiles in milliseconds."""
    ok = [r for r in records if r["finish_reason"] in ("stop", "length")
          and r["first_token_time"] is not None]
    duration = max((r["finish_time"] for r in records if r["finish_time"] is not None),
                   default=0.0)
    values: dict[str, list[float]] = {name: [] for name in METRICS}
    good = 0
    for r in ok:
        times, start = r["token_times"], r["arrival_time"]
        latency = times[-1] - start
        n = r["num_output_tokens"]
        gaps = list(np.diff(times))
        values["ttft"].append(times[0] - start)
        values["e2el"].append(latency)
        values["itl"] += gaps
        values["max_itl"].append(max(gaps, default=0.0))
        tpot = (latency - (times[0] - start)) / (n - 1) if n > 1 else None
        if tpot is not None:
            values["tpot"].append(tpot)
        seen = {"ttft": times[0] - start, "tpot": tpot or 0.0, "e2e": latency}
        good += all(seen[key] <= limit for key, limit in slo.items())
    total_in = sum(r["num_prompt_tokens"] for r in ok)
    total_out = sum(r["num_output_tokens"] for r in ok)
    out: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "request_goodput": good / duration if slo and duration else None,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        **peak_output(ok)}
    for name in selected:
        v = np.array(values[name] or [0.0]) * 1000
        out.update({f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
                    f"std_{name}_ms": float(v.std())})
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = float(np.percentile(v, p))
    return out


def peak_output(records: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's peak: the most output chunks delivered within one second of the run, and how
    many requests were under way in that second."""
    stamps = [t for r in records for t in r["token_times"]]
    if not stamps:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    per_second = np.bincount(np.floor(stamps).astype(int))
    second = int(per_second.argmax())
    busy = sum(1 for r in records if r["arrival_time"] < second + 1
               and r["token_times"][-1] >= second)
    return {"max_output_tokens_per_s": float(per_second[second]),
            "max_concurrent_requests": busy}


def summary_block(result: dict[str, Any], args: argparse.Namespace, selected: list[str],
                  percentiles: list[float]) -> str:
    """vLLM's printed summary of a run."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40} {value:<10.2f}" if isinstance(value, float)
                     else f"{label:<40} {value:<10}")
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if args.max_concurrency is not None:
        row("Maximum request concurrency:", args.max_concurrency)
    if not math.isinf(args.request_rate):
        row("Request rate configured (RPS):", float(args.request_rate))
    row("Benchmark duration (s):", float(result["duration"]))
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", float(result["request_throughput"]))
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", float(result["request_goodput"]))
    row("Output token throughput (tok/s):", float(result["output_throughput"]))
    row("Peak output token throughput (tok/s):", float(result["max_output_tokens_per_s"]))
    row("Peak concurrent requests:", float(result["max_concurrent_requests"]))
    row("Total token throughput (tok/s):", float(result["total_token_throughput"]))
    for name in selected:
        short, header = METRICS[name]
        lines.append(f"{header:-^50}")
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", result[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", result[f"p{p:g}_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def result_path(args: argparse.Namespace, model: str, date: str) -> Path:
    """vLLM's file name: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json, in --result-dir."""
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = args.result_filename or (f"{args.label or args.backend}-{args.request_rate}qps"
                                    f"{concurrency}-{model.split('/')[-1]}-{date}.json")
    return Path(args.result_dir or ".") / name


def main_serve(argv: list[str] | None = None) -> int:
    """`python -m minicb bench serve ...`: returns an exit code."""
    from minicb.serving.client import bench_endpoint, describe_errors
    parser = serve_parser()
    args = parser.parse_args(argv)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    chat = args.backend == "openai-chat"
    endpoint = args.endpoint or ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"} \
        if os.environ.get("OPENAI_API_KEY") else {}  # as vLLM's client sends it
    try:
        if not endpoint.endswith("chat/completions" if chat else "completions") or \
                (not chat and endpoint.endswith("chat/completions")):
            raise ValueError(f"--backend {args.backend} sends to an endpoint ending in "
                             f"{'chat/completions' if chat else '/completions'}, got {endpoint}")
        selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
        if not selected or set(selected) - set(METRICS):
            raise ValueError(f"--percentile-metrics takes names among {', '.join(METRICS)}, "
                             f"got {args.percentile_metrics!r}")
        try:
            percentiles = [float(p) for p in args.metric_percentiles.split(",")]
        except ValueError:
            raise ValueError(f"--metric-percentiles takes comma-separated numbers, got "
                             f"{args.metric_percentiles!r}") from None
        if not percentiles or not all(0 <= p <= 100 for p in percentiles):
            raise ValueError(f"--metric-percentiles must lie in [0, 100], got "
                             f"{args.metric_percentiles!r}")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
        slo = goodput_slo(args.goodput)
        workload = workload_of(args)
        check_wall_clock_span(workload)
        date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        if args.save_result and args.model:
            check_writable(result_path(args, args.model, date), "--result-filename")
        texts = texts_of(base_url, workload, args.vocab_size, headers) if chat else None
        extra = {k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k))
                 if v is not None}
        print(f"Traffic request rate: {args.request_rate}")
        print(f"Burstiness factor: {args.burstiness} "
              f"({'Poisson process' if args.burstiness == 1 else 'Gamma distribution'})")
        print(f"Maximum request concurrency: {args.max_concurrency}")
        label = args.label or args.backend
        data = bench_endpoint(base_url + endpoint, workload, label, args.model, args.vocab_size,
                              args.temperature, progress=not args.disable_tqdm, slo=slo,
                              omit=args.omit_field, max_concurrency=args.max_concurrency,
                              texts=texts, extra=extra, headers=headers)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    records = data.pop("records")
    model = data["declaration"]["model"]
    result: dict[str, Any] = {
        "date": date, "endpoint_type": args.backend, "backend": args.backend, "label": label,
        "model_id": model, "tokenizer_id": None, "num_prompts": len(workload),
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        **vllm_metrics(records, slo, percentiles, [*selected, *(
            ["max_itl"] if "max_itl" not in selected else [])])}
    print(summary_block(result, args, selected, percentiles))
    if problems := describe_errors(data["results"][label]):
        print(problems, file=sys.stderr)
    if args.save_detailed:
        result.update(input_lens=[r["num_prompt_tokens"] for r in records],
                      output_lens=[r["num_output_tokens"] for r in records],
                      ttfts=[(r["first_token_time"] or r["arrival_time"]) - r["arrival_time"]
                             for r in records],
                      itls=[list(np.diff(r["token_times"])) for r in records],
                      start_times=[r["arrival_time"] for r in records],
                      errors=[r["error"] or "" for r in records])
    data["declaration"]["command"] = " ".join(["python -m minicb bench serve",
                                               *(sys.argv[1:] if argv is None else argv)])
    result["minicb"] = data  # the contract's declaration and summary, bench's schema
    if args.save_result:
        path = result_path(args, model, date)
        write_json(json.loads(json.dumps(result, default=float)), path)
        print(f"wrote {path}")
    return 0
