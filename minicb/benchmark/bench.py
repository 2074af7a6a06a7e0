"""The benchmark (chapter 06): `python -m minicb bench | sweep | profile`.

    bench    one workload, one or several policies side by side on the same requests, optionally
             beside Hugging Face transformers (`generate` in static batches, `generate_batch`)
    sweep    vary the token budget, max_num_seqs, chunk size and priority policy (preemption
             order); report the highest goodput
    profile  run a short real workload here, fit the simulated executor's cost model, save it

Every result file starts with the declaration the benchmark contract asks for (arrival
process, burstiness, concurrency, length distributions, cache state, policy, token budget,
memory limit, model, runtime versions, device and CPU count), and says plainly whether the
numbers were measured or simulated. The model is loaded once and shared by every policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from minicb.attention import resolve_backend
from minicb.benchmark.metrics import (
    LATENCY_COLUMNS,
    PERCENTILE_METHOD,
    TABLE_COLUMNS,
    check_slo,
    format_table,
    lookup,
    observed_arrivals,
    resource_use,
    summarize,
    sustainable_load,
    worst_class,
)
from minicb.benchmark.sim import (
    DEFAULT_CPU_COST_MODEL,
    CostModel,
    SimClock,
    SimModel,
    fit_cost_model_runs,
    measure_swap_cost,
    sim_model_info,
)
from minicb.benchmark.workload import (
    MAX_FIRST_ARRIVAL_S,
    SCENARIOS,
    Workload,
    get_workload,
    load_workload_file,
    make_workload,
    replay_flags,
    run_workload,
    save_workload_file,
)
from minicb.cli import add_full_cache_arguments, check_full_cache_flags
from minicb.config import (
    POLICIES,
    PREEMPTIONS,
    QUANTIZATIONS,
    EngineConfig,
    cpuinfo,
    is_finite_number,
    is_positive_int,
    resolve_device,
    torch_dtype,
)
from minicb.scheduler import POLICY_CLASSES

RESULT_KEYS = ("output_tokens_per_s", "requests_per_s", "ttft_s", "itl_s", "max_itl_s", "tpot_s",
               "e2e_s", "queue_s", "goodput_rps", "dec_at_p", "short_p_steps", "short_p_s",
               "preemptions", "discarded_tokens", "recomputed_tokens", "evicted_pages",
               "swapped_out_pages", "swapped_in_pages", "rejected",
               "cancelled", "errors", "deadline_missed", "slo_attainment", "max_queue_age_s",
               "host_time_fraction", "decode_tokens_per_s")
CACHE_STATES = {
    "cold": "cold: a fresh engine (empty page pool and prefix index) for each policy; weights "
            "loaded once and warmed up by one short request on a throwaway engine",
    "warm": "warm: a fresh engine for each policy that first served the same scenario with "
            "seed + 1 (shared prompt prefixes cached, each request's own tokens not), then "
            "forgot those requests and their trace; only the run after it is measured"}
NO_SLO_NOTE = ("no SLO given: goodput and SLO attainment need one (--slo-ttft, --slo-itl, "
               "--slo-tpot, --slo-e2e); completed requests/s is requests_per_s")
SIMULATED_NOTE = ("SIMULATED: no model ran; the real scheduler, pages and trace ran, and each "
                  "step's time came from the cost model below")


# ------------------------------------------------------------------------------ arguments
def _policies(values: list[str] | None) -> list[str]:
    out: list[str] = []
    for value in values or ["pd"]:
        for name in value.split(","):
            name = name.strip()
            if not name:
                continue
            if name not in POLICIES:
                raise ValueError(f"--policy must name policies among {POLICIES}, got {name!r}")
            if name not in out:
                out.append(name)
    if not out:
        raise ValueError(f"--policy names no policy (got {values!r}); choose among {POLICIES}")
    return out


def _preemptions(text: str | None) -> list[str]:
    """--preemption: one order, or (sweep) a comma-separated list of them."""
    names = list(dict.fromkeys(n.strip() for n in str(text or "newest").split(",")
                               if n.strip()))
    if not names or any(n not in PREEMPTIONS for n in names):
        raise ValueError(f"--preemption takes {', '.join(PREEMPTIONS)} (sweep: a comma-separated "
                         f"list of them), got {text!r}")
    return names


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag} takes comma-separated positive integers, got {text!r}")
    return list(dict.fromkeys(values))  # a value given twice would run the same setting twice


def _rate_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated rates in requests/s, got {text!r}") \
            from None
    if not values or not all(is_finite_number(v) and v > 0 for v in values):
        raise ValueError(f"{flag} takes comma-separated positive rates, got {text!r}")
    return sorted(set(values))


def add_concurrency_argument(parser: argparse.ArgumentParser) -> None:
    """--max-concurrency: an open or a closed loop of clients (bench, sweep, the client)."""
    parser.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                        help="close the loop, as vLLM's bench serve does: at most N requests "
                             "unfinished at once; one that comes due while N are is sent "
                             "when one finishes, and arrives then (default: open loop)")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by bench and sweep (chapter 06)."""
    parser.add_argument("--model", default="smollm2-135m",
                        help="bundled model name or a Hugging Face checkpoint directory")
    parser.add_argument("--workload", default=None, choices=sorted(SCENARIOS),
                        help="a generated scenario (default mixed-chat)")
    parser.add_argument("--workload-file", default=None, metavar="PATH",
                        help="replay a trace instead: JSON Lines, one request a line, or CSV "
                             "with a header of the same names: arrival_s (seconds from the "
                             "start) or arrival_step, prompt_tokens (a length) or "
                             "prompt_token_ids (a list), output_tokens; optional priority, "
                             "tenant, deadline_s (after arrival), cancel_after_tokens, "
                             "request_id, long_prefill (true on the one request dec@P is "
                             "measured around). bench --save-workload writes this format")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests to generate (with --workload-file: replay the first N)")
    parser.add_argument("--rate", type=float, default=None,
                        help="arrival rate in requests/s (default: the workload's own)")
    parser.add_argument("--burstiness", type=float, default=None,
                        help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier")
    parser.add_argument("--prompt-lengths", default=None,
                        help="N | uniform:LO:HI | lognormal:MEDIAN:SIGMA[:LO:HI] | list:A,B")
    parser.add_argument("--output-lengths", default=None, help="same forms as --prompt-lengths")
    parser.add_argument("--long-prompt-len", type=int, default=None,
                        help="long-prefill: the long prompt's length (default 2000)")
    add_concurrency_argument(parser)
    parser.add_argument("--cancel-fraction", type=float, default=None,
                        help="share of requests the client cancels after their first token")
    parser.add_argument("--seed", type=int, default=None,
                        help="the generated traffic's seed (default 0; a trace has none)")
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--page-size", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run decode-only steps eagerly on CUDA too (use_cuda_graphs=False): "
                             "what the graphs save (chapter 07)")
    parser.add_argument("--preemption", default=None,
                        help="the priority policy: who waits first and who is preempted first "
                             f"when pages run out: {', '.join(PREEMPTIONS)} (default newest: "
                             "first come first served; priority: lowest `priority` value "
                             "first; deadline: earliest deadline first; fair: the tenant "
                             "served least first). sweep takes a comma list. Only "
                             "--workload-file gives requests priorities, tenants and "
                             "deadlines: the generated workloads have none (priority 0, one "
                             "tenant), where every order but newest serves them as newest")
    parser.add_argument("--priority-aging-steps", type=int, default=None,
                        help="with --preemption priority: a waiting request's priority "
                             "improves by one every this many steps (no starvation)")
    parser.add_argument("--max-preemptions", type=int, default=None,
                        help="a bound on preemption loss: a request preempted this many times "
                             "comes back holding its whole life's pages (0: reserve it at once)")
    add_full_cache_arguments(parser)
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="speculative decoding by prompt lookup: up to this many guessed "
                             "tokens per decode step (chapter 08; default 0, off)")
    parser.add_argument("--batch-timeout", type=float, default=None,
                        help="dynamic: how long the oldest waiting request waits for a batch "
                             "to fill: seconds when arrivals are in seconds (default "
                             f"{DYNAMIC_TIMEOUT_S}), steps when they are in steps (default 8)")
    parser.add_argument("--cache-state", choices=["cold", "warm"], default="cold",
                        help="cold: each policy starts on an empty prefix cache; warm: on one "
                             "that served the same traffic with another seed first (shared "
                             "prompts cached, each request's own tokens not)")
    add_slo_arguments(parser)
    parser.add_argument("--executor", choices=("real", "sim"), default="real",
                        help="real: run the model; sim: the cost model decides step times")
    parser.add_argument("--cost-model", default="h100-like",
                        help="sim executor: 'h100-like' (an assumption), 'cpu' "
                             "(bench/cost_model_cpu.json from `profile`) or a JSON path")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto")
    parser.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q], default=None,
                        help="int8: weight-only int8 projections on the CPU (a quarter of the "
                             "bytes per decode step; numbers differ slightly from float32)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="weights and KV cache of the real executor (auto: float32 on the "
                             "CPU; bfloat16 on CUDA); on x86-64 float32 is prepacked, and "
                             "bfloat16 too where oneDNN runs bf16")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's own choice); 1 is often "
                             "fastest on a small shared machine")
    parser.add_argument("--out", default=None, help="write results JSON here")
    parser.add_argument("--no-progress", action="store_true")


def build_workload(args: argparse.Namespace, rate_flag: str = "--rate") -> Workload:
    """The scenario named by --workload with the flags that apply to it, or the trace
    --workload-file replays (chapter 06). A refused flag is named as the user gave it
    (`rate_flag`: sweep's --rates sets the rate)."""
    name = args.workload or "mixed-chat"
    wanted = {"num_requests": args.num_requests, "rate": args.rate,
              "burstiness": args.burstiness, "seed": args.seed,
              "prompt_lengths": args.prompt_lengths, "output_lengths": args.output_lengths,
              "long_prompt_len": getattr(args, "long_prompt_len", None),
              "cancel_fraction": getattr(args, "cancel_fraction", None)}
    if wanted["cancel_fraction"] is not None:
        wanted["cancel_after_tokens"] = 1
    wanted = {k: v for k, v in wanted.items() if v is not None}
    flag = {"rate": rate_flag}
    if getattr(args, "workload_file", None):
        refused = [k for k in wanted if k not in ("num_requests", "cancel_after_tokens")]
        if args.workload:
            refused.insert(0, "workload")
        if refused:
            flags = ", ".join(flag.get(k, "--" + k.replace("_", "-")) for k in refused)
            raise ValueError(f"{flags} do(es) not apply to --workload-file: the trace sets "
                             "arrivals and lengths (edit the file to change them)")
        if args.num_requests is not None and args.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
        return load_workload_file(args.workload_file, args.num_requests)
    func = SCENARIOS[name]
    params = inspect.signature(func).parameters
    accepted = set(params)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):  # forwards to make_workload
        accepted |= set(inspect.signature(make_workload).parameters)
    refused = [k for k in wanted if k not in accepted]
    if refused:
        flags = ", ".join(flag.get(k, "--" + k.replace("_", "-")) for k in refused)
        raise ValueError(f"{flags} do(es) not apply to workload {name!r}")
    return get_workload(name, **wanted)


def check_wall_clock_span(*workloads: Workload | None) -> None:
    """Refuse traffic whose last request arrives more than a day after the first, before a real
    run (or a server measured from the client) waits for it on the wall clock (chapter 06): a
    tiny --rate spreads a few requests over weeks. The simulator skips idle time, so it may.
    Call it before a model loads; None (no warm-up traffic) passes."""
    for workload in workloads:
        times = [r.arrival_time for r in (workload.requests if workload else [])
                 if r.arrival_time is not None]
        span = observed_arrivals(times)["arrival_span_s"] if times else 0.0
        if span > MAX_FIRST_ARRIVAL_S:
            raise ValueError(f"the last request arrives {span:,.0f} s ({span / 86400:.1f} days) "
                             "after the first, and a real run waits for it: raise the rate, "
                             "send fewer requests, or use --executor sim (it skips idle time)")


def check_writable(path: str | os.PathLike | None, flag: str) -> None:
    """Refuse an output path that cannot be written, before a run spends minutes and loses its
    results at the end (chapter 06): the file is opened for appending (and removed again if
    this made it)."""
    if path is None:
        return
    target = Path(path)
    existed = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a"):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None
    if not existed:
        target.unlink()


def saved_workload_line(workload: Workload, path: str) -> str:
    """Write `workload` as a trace (--save-workload) and say where, with the flags its
    scenario's recommended options need when it is replayed (chapter 06)."""
    check_writable(path, "--save-workload")
    line = f"wrote workload {save_workload_file(workload, path)}"
    flags = replay_flags(workload)
    return line + (f" (replay it with {flags}: the scenario's recommended options, which a "
                   "trace does not keep)" if flags else "")


def warmup_workload(args: argparse.Namespace) -> Workload | None:
    """With --cache-state warm, the traffic that warms each engine first: the same scenario
    with the next seed (chapter 06); None when cold."""
    if getattr(args, "cache_state", "cold") != "warm":
        return None
    if getattr(args, "workload_file", None):
        raise ValueError("--cache-state warm serves the same scenario with another seed first; "
                         "a replayed trace has no other seed: use --cache-state cold")
    if getattr(args, "no_prefix_caching", False):
        raise ValueError("--cache-state warm fills the prefix cache before the run; with "
                         "--no-prefix-caching there is none, so the run would start cold")
    warmup = build_workload(argparse.Namespace(**{**vars(args), "seed": (args.seed or 0) + 1}))
    if any(r.arrival_step is not None for r in warmup.requests):
        raise ValueError("--cache-state warm needs arrivals in seconds (or all at once), not "
                         "in steps: the measured run would start mid-way")
    return warmup


def add_slo_arguments(parser: argparse.ArgumentParser) -> None:
    """--slo-ttft, --slo-itl, --slo-tpot, --slo-e2e: the limits goodput counts against
    (chapter 06)."""
    parser.add_argument("--slo-ttft", type=float, default=None, help="seconds to first token")
    parser.add_argument("--slo-itl", type=float, default=None,
                        help="seconds: a request's worst gap between two tokens")
    parser.add_argument("--slo-tpot", type=float, default=None, help="seconds per output token")
    parser.add_argument("--slo-e2e", type=float, default=None, help="seconds, end to end")


# what a replayed trace adds to each request it sends a server (chapter 06); not
# workload.TRACE_FIELDS, the columns of a trace file
SENT_FIELDS = ("user", "priority", "deadline")


def add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """--vocab-size and --omit-field: how requests are sent to a server (chapter 06)."""
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="with --endpoint: fold prompt ids below this (tiny test models)")
    parser.add_argument("--omit-field", action="append", default=[], choices=SENT_FIELDS,
                        help="with --endpoint: do not send this field of a replayed trace "
                             "(repeatable; 'priority' for a vLLM server without "
                             "--scheduling-policy priority, which refuses a non-zero one)")


def slo_from_args(args: argparse.Namespace) -> dict[str, float]:
    """The SLO dict from --slo-ttft/--slo-itl/--slo-tpot/--slo-e2e (chapter 06)."""
    return check_slo({"ttft": args.slo_ttft, "itl": args.slo_itl, "tpot": args.slo_tpot,
                      "e2e": args.slo_e2e}, label="--slo-{key}")


def set_threads(threads: int | None) -> None:
    """Apply --threads (torch intra-op threads) before anything runs (chapter 06)."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    import torch
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ executors
class Executor:
    """Makes engines for one model: real weights loaded once, or the simulated model
    (chapter 06)."""

    def __init__(self, kind: str, model: str = "smollm2-135m", device: str = "cpu",
                 cost: CostModel | str = "h100-like", quantization: str | None = None,
                 dtype: str = "auto") -> None:
        self.kind = kind
        self.quantization = quantization
        self.device = device
        self.model_name = model
        self.cost: CostModel | None = None
        self.pair: tuple[Any, Any] | None = None
        if kind == "sim":
            self.cost = CostModel.load(cost) if isinstance(cost, str) else cost
        elif kind == "real":
            from minicb.model.loader import load_model
            self.pair = load_model(model, device=device, dtype=torch_dtype(dtype, device),
                                   quantization=quantization)
        else:
            raise ValueError(f"executor must be 'real' or 'sim', got {kind!r}")

    @property
    def simulated(self) -> bool:
        return self.kind == "sim"

    def engine(self, **options: Any) -> Any:
        from minicb.engine import Engine
        options.setdefault("device", "cpu" if self.simulated else self.device)
        if self.simulated:
            clock = SimClock()
            info = sim_model_info()
            return Engine((SimModel(self.cost, clock, info.config.vocab_size), info),
                          clock=clock, **options)
        return Engine(self.pair, **options)

    def warm_up(self) -> None:
        """One short request on a throwaway engine, so first-call costs stay out of results."""
        if self.simulated:
            return
        from minicb.request import SamplingParams
        engine = self.engine(policy="continuous", num_pages=64)
        engine.add_request([101, 102, 103, 104] * 8, SamplingParams(max_tokens=4,
                                                                    temperature=0.0))
        engine.run()

    def describe(self) -> dict[str, Any]:
        if self.simulated:
            return {"name": "simulated (no weights)", "cost_model": self.cost.to_dict()}
        model, info = self.pair
        cfg = info.config
        params = None
        if hasattr(model, "state_dict"):  # int8 projections are buffers, not parameters
            tensors = model.state_dict()
            params = sum(t.numel() for name, t in tensors.items() if not name.endswith(".scale"))
            if "lm_head.qweight" in tensors and cfg.tie_word_embeddings:
                params -= tensors["lm_head.qweight"].numel()  # an int8 copy of the embedding
        return {"name": info.name, "path": str(info.path), "architecture": cfg.architecture,
                "num_layers": cfg.num_layers, "hidden_size": getattr(cfg, "hidden_size", None),
                "vocab_size": cfg.vocab_size, "parameters": params,
                "dtype": str(next(model.parameters()).dtype) if params else None,
                "quantization": self.quantization,
                "prepacked": bool(getattr(model, "prepacked", False))}


def executor_from_args(args: argparse.Namespace, device: str) -> Executor:
    """The executor bench and sweep run on, from their common flags (chapter 06)."""
    for flag, value in (("--quantization", args.quantization),
                        ("--dtype", args.dtype != "auto" and args.dtype)):
        if value and args.executor == "sim":
            raise ValueError(f"{flag} needs --executor real: the simulated executor has no "
                             "weights (its cost model sets the step times)")
    if args.quantization and args.dtype != "auto":
        raise ValueError("--quantization int8 keeps float32 activations: leave --dtype auto")
    if args.executor == "sim" and args.num_speculative_tokens:
        raise ValueError("--num-speculative-tokens needs --executor real: the simulated model "
                         "predicts one token forever, so every guess would be kept")
    return Executor(args.executor, args.model, device, args.cost_model, args.quantization,
                    args.dtype)


def runtime_versions() -> dict[str, str]:
    """Versions of python, torch, numpy, transformers and minicb for a declaration (chapter 06)."""
    import numpy
    import torch

    import minicb
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "numpy": numpy.__version__, "minicb": getattr(minicb, "__version__", "?")}
    try:
        import transformers
        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = "not installed"
    return out


def device_description(device: str) -> dict[str, Any]:
    """Device, CPU count and torch threads for a declaration (chapter 06)."""
    import torch
    out: dict[str, Any] = {"device": device, "cpu_count": os.cpu_count(),
                           "torch_threads": torch.get_num_threads(),
                           "platform": platform.platform(),
                           "processor": platform.processor() or platform.machine()}
    # the machine behind a course VM changes between sessions: name it
    out["cpu_model"] = cpuinfo("model name") or out["processor"]
    if device.startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))  # cuda:N, not always 0
    return out


DYNAMIC_TIMEOUT_S = 0.05  # dynamic batching's wait on an idle engine, arrivals in seconds


def engine_options(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    """EngineConfig options from the flags; the workload's recommendations fill gaps
    (chapter 06). Dynamic batching's timeout runs on the workload's clock: seconds when
    arrivals are in seconds (counted in steps, an idle engine's empty steps take no time, and
    dynamic would form its batches as soon as static does), steps when they are in steps."""
    # results come from request records and step counts: per-step snapshots of queues and page
    # tables (for pictures) would cost more than a simulated step and grow with the run
    options: dict[str, Any] = {"trace_snapshots": False, **workload.recommended}
    for key in ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "min_chunk",
                "num_pages", "page_size", "num_speculative_tokens",
                "max_preemptions", "preemption_mode", "num_swap_pages"):  # flags named as options
        value = getattr(args, key, None)
        if value is not None:
            options[key] = value
    check_full_cache_flags(getattr(args, "preemption_mode", None),
                           getattr(args, "num_swap_pages", None))
    if getattr(args, "no_prefix_caching", False):
        options["enable_prefix_caching"] = False
    if getattr(args, "no_cuda_graphs", False):
        options["use_cuda_graphs"] = False
    if getattr(args, "reject_when_full", False):
        options["reject_when_full"] = True
    preemption = getattr(args, "preemption", None)
    if preemption is not None:
        chosen = _preemptions(preemption)
        if len(chosen) > 1:
            raise ValueError("bench runs one --preemption order; sweep takes a comma list")
        options["preemption"] = chosen[0]
    aging = getattr(args, "priority_aging_steps", None)
    if aging is not None:
        if options.get("preemption") != "priority":
            raise ValueError("--priority-aging-steps ages priorities: it needs --preemption "
                             "priority")
        options["priority_aging_steps"] = aging
    timeout = getattr(args, "batch_timeout", None)
    if any(r.arrival_step is not None for r in workload.requests):
        if timeout is not None:
            options["batch_timeout"] = timeout
    else:
        options.update(batch_timeout=DYNAMIC_TIMEOUT_S if timeout is None else timeout,
                       batch_timeout_in_seconds=True)
    return options  # quantization belongs to the weights: the Executor that loads them


def concurrency_declaration(max_concurrency: int | None,
                            max_num_seqs: int | None = None) -> dict[str, Any]:
    """How the client sent the requests (chapter 06): an open loop, or a closed one of
    `max_concurrency` requests in flight (`run_workload`, `run_client`)."""
    if max_concurrency is None:
        client = "open loop: each request is sent at its arrival time, whatever the engine is doing"
    else:
        client = (f"closed loop: at most {max_concurrency} requests unfinished at once; one that "
                  "comes due while they are is sent when one finishes, and its arrival, queue "
                  "time, TTFT and E2E count from then (the offered rate may not be reached)")
    out: dict[str, Any] = {"client": client, "max_concurrency": max_concurrency}
    if max_num_seqs is not None:
        out["max_num_seqs"] = max_num_seqs
    return out


def check_max_concurrency(value: int | None) -> None:
    """Refuse a --max-concurrency below 1 before anything runs."""
    if value is not None and value < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {value}")


def declaration(args: argparse.Namespace, workload: Workload, executor: Executor,
                policies: list[str], options: dict[str, Any], slo: dict[str, float],
                engine: Any | None = None) -> dict[str, Any]:
    """The workload and system declaration of the benchmark contract (chapter 06)."""
    from minicb.config import EngineConfig
    cfg = EngineConfig.from_kwargs(**{k: v for k, v in options.items()})
    num_pages = engine.pool.num_pages if engine is not None else cfg.num_pages
    kv_tokens = num_pages * cfg.page_size if num_pages else None
    decl: dict[str, Any] = {
        "command": getattr(args, "command_line", None),
        # timezone.utc: datetime.UTC needs Python 3.11, and a GPU image may have 3.10
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(  # noqa: UP017
            timespec="seconds"),
        "executor": "simulated" if executor.simulated else "real",
        "simulated": executor.simulated,
        "workload": workload.declaration,
        "arrival_process": workload.declaration.get("arrival_process"),
        "burstiness": workload.declaration.get("burstiness"),
        "rate_rps": workload.declaration.get("rate_rps"),
        "prompt_lengths": workload.declaration.get("prompt_lengths"),
        "output_lengths": workload.declaration.get("output_lengths"),
        "concurrency": concurrency_declaration(getattr(args, "max_concurrency", None),
                                               cfg.max_num_seqs),
        "cache_state": {"prefix_caching": cfg.enable_prefix_caching,
                        "start": CACHE_STATES[getattr(args, "cache_state", "cold")]},
        "policy": policies,
        "policy_options": {
            "preemption": cfg.preemption, "priority_aging_steps": cfg.priority_aging_steps,
            "max_preemptions": cfg.max_preemptions,
            "preemption_mode": cfg.preemption_mode,
            # the engine's default swap space is as many pages as its pool
            "num_swap_pages": (cfg.num_swap_pages or num_pages
                               if cfg.preemption_mode == "swap" else None),
            "reject_when_full": cfg.reject_when_full,
            "num_speculative_tokens": cfg.num_speculative_tokens,
            "batch_timeout": f"{cfg.batch_timeout} "
                             f"{'s' if cfg.batch_timeout_in_seconds else 'steps'} (dynamic)"},
        "token_budget": {"max_num_batched_tokens": cfg.max_num_batched_tokens,
                         "chunk_size": cfg.chunk_size, "min_chunk": cfg.min_chunk},
        "memory_limit": {"num_pages": num_pages or "engine default (1024 on the CPU; on CUDA "
                                                   "sized from free memory, at most max_num_seqs "
                                                   "full contexts)",
                         "page_size": cfg.page_size, "kv_tokens": kv_tokens},
        "model": executor.describe(),
        "attention_backend": ("simulated" if executor.simulated
                              else engine.attention_backend if engine is not None
                              else resolve_backend(cfg.attention_backend, executor.device)),
        "cuda_graphs": cfg.use_cuda_graphs,  # decode-only steps, CUDA + Triton only (chapter 07)
        "runtime": runtime_versions(),
        "device": device_description(executor.device),
        "sampling": "greedy, ignore_eos=True, max_tokens fixed: output lengths are exact",
        "slo": slo,
        "percentiles": PERCENTILE_METHOD,
        "seed": None if getattr(args, "workload_file", None) else args.seed or 0,
    }
    if executor.simulated:
        decl["note"] = SIMULATED_NOTE
        decl["cost_model"] = executor.cost.to_dict()
    return decl


# ------------------------------------------------------------------------------ runs
def warm_prefix_cache(engine: Any, warmup: Workload) -> None:
    """Cache state "warm" (chapter 06): serve `warmup` (the same traffic, another seed), then
    forget its requests (and with them their tenants' service) and its trace, so a measured
    run starts with the shared prefixes cached and nothing else carried over."""
    run_workload(engine, warmup)
    for request_id in list(engine.requests):
        engine.forget(request_id)
    engine.trace.clear()


def run_policy(executor: Executor, policy: str, workload: Workload, options: dict[str, Any],
               slo: dict[str, float] | None = None, progress: bool = True,
               warmup: Workload | None = None,
               max_concurrency: int | None = None) -> tuple[dict, Any]:
    """Run `workload` under `policy` on a fresh engine, after `warmup` if given (a warm cache),
    in an open loop or with `max_concurrency` requests in flight; return (summary, engine)
    (chapter 06)."""
    engine = executor.engine(policy=policy, **options)
    if warmup is not None:
        warm_prefix_cache(engine, warmup)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(workload), desc=f"{policy:>10}", unit="req", leave=False,
                   file=sys.stderr)
    try:
        run_workload(engine, workload, progress=bar if bar is not None else False,
                     max_concurrency=max_concurrency)
    finally:
        if bar is not None:
            bar.close()
    summary = summarize(engine.trace, engine.request_records(), slo,
                        workload.long_request_id)
    summary.update(resource_use(engine.trace, engine.pool.num_pages,
                                engine.config.max_num_batched_tokens))
    if executor.simulated:
        summary["host_time_fraction"] = None  # nothing but the modelled forward takes time
    return summary, engine


def without_slo(summary: dict[str, Any], slo: dict[str, float]) -> dict[str, Any]:
    """With no SLO, goodput would be every completed request: say so instead of a number
    (chapter 06)."""
    if not slo:
        summary.update(goodput_rps=None, slo_attainment=None, goodput_note=NO_SLO_NOTE)
    return summary


def output_tokens(engine: Any) -> dict[str, list[int]]:
    """Each request's output token ids after a run: what the quality check compares
    (chapter 06)."""
    return {rid: list(req.output_token_ids) for rid, req in engine.requests.items()}


def same_tokens(reference: dict[str, list[int]], tokens: dict[str, list[int]] | None,
                name: str, rejected: set[str] | frozenset[str] = frozenset(),
                cut: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """Compare greedy outputs request by request with `reference` (those of run `name`); with
    `tokens` None (a simulated run, which makes no real tokens) say it was not checked
    (chapter 06). Requests in `rejected` (turned away by either run, `reject_when_full`) have
    no tokens to compare: they are listed, not compared; any other missing request differs.
    Requests in `cut` (ended by their deadline in either run, at a point that depends on the
    run's timing) are compared on the tokens both runs gave them."""
    if tokens is None:
        return {"policy": name, "checked": False,
                "note": "not checked (simulated: no model ran, so no real tokens)"}
    compared = [rid for rid in reference if rid not in rejected]

    def differs(rid: str) -> bool:
        ours, theirs = tokens.get(rid), reference[rid]
        if ours is None or rid not in cut:
            return ours != theirs
        common = min(len(ours), len(theirs))
        return ours[:common] != theirs[:common]

    out = {"policy": name, "checked": True, "requests": len(compared),
           "differing_requests": [rid for rid in compared if differs(rid)]}
    if rejected:
        out["rejected_not_compared"] = sorted(rejected)
    if cut & set(compared):
        out["deadline_cut_compared_on_common_tokens"] = sorted(cut & set(compared))
    return out


def finished_ids(engine: Any, reason: str) -> set[str]:
    """Requests that ended with `reason`: "rejected" (turned away, `reject_when_full`) or
    "deadline" (expired), chapter 06."""
    return {rid for rid, req in engine.requests.items() if req.finish_reason == reason}


def cancellations_honoured(engine: Any, workload: Workload) -> bool:
    """The contract's cancellation requirement, after a run (chapter 06): every request the
    client cancelled finished in the step that gave it its cancel point's token (nothing was
    computed for it after), and no request holds KV pages (a cancelled one's came back at
    once, before its output limit)."""
    for i, request in enumerate(workload.requests):
        limit = request.cancel_after_tokens
        req = engine.requests.get(request.request_id or f"req-{i}")
        if limit is None or req is None or len(req.output_token_ids) < limit:
            continue  # never cancelled: it finished on its own first
        if req.metrics.finish_step != req.metrics.token_steps[limit - 1]:
            return False
    return engine.pool.num_used == 0


def quality_lines(results: dict[str, Any]) -> list[str]:
    """The lines under the table on greedy tokens: minicb's policies against the first, then
    transformers' runs against it (informative); none when nothing was compared (chapter 06)."""
    lines = []
    for hf in (False, True):
        checks = {name: s["same_tokens_as"] for name, s in results.items()
                  if "same_tokens_as" in s and name.startswith("hf-") == hf}
        if not checks:
            continue
        first = next(iter(checks.values()))
        if not first["checked"]:
            lines.append(f"greedy tokens: {first['note']}")
            continue
        ref = first["policy"]
        both = " both served" if any("rejected_not_compared" in c for c in checks.values()) \
            else ""
        same: dict[int, list[str]] = {}  # policies that turn different requests away
        for name, check in checks.items():  # compare different numbers of requests
            if not check["differing_requests"]:
                same.setdefault(check["requests"], []).append(name)
        parts = [f"{', '.join(names)} identical to {ref} on all {total} requests{both}"
                 for total, names in same.items()]
        for name, check in checks.items():
            ids, total = check["differing_requests"], check["requests"]
            if ids:
                parts.append(f"{name} differs from {ref} on {len(ids)} of {total} "
                             f"({', '.join(ids[:5])}{', ...' if len(ids) > 5 else ''})")
        if any("deadline_cut_compared_on_common_tokens" in c for c in checks.values()):
            parts.append("requests a deadline cut short compared on the tokens both got")
        note = " (informative: other kernels can break near-ties)" if hf else ""
        lines.append(f"greedy tokens{' of transformers' if hf else ''}: "
                     + "; ".join(parts) + note)
    return lines


def free_device_memory(device: str) -> None:
    """Give dropped engines' page pools back to the GPU (chapter 06). On CUDA a pool takes
    `gpu_memory_utilization` of the free memory, so the next engine, or transformers' baseline,
    would otherwise size itself from what the last one left. Drop every reference first."""
    if not str(device).startswith("cuda"):
        return
    import gc

    import torch
    gc.collect()  # reference cycles would keep a pool alive until the next sweep
    torch.cuda.empty_cache()


def measure_single_stream(executor: Executor, num_prompts: int = 3, prompt_len: int = 128,
                          max_tokens: int = 32) -> dict[str, Any]:
    """Batch-1 speed (chapter 01): each prompt alone under `single`; prefill tokens/s from its
    first step (whole prompt + first token), decode tokens/s from the steps after."""
    import numpy as np

    from minicb.request import SamplingParams
    rng = np.random.default_rng(1234)
    prefill_tokens = prefill_s = decode_tokens = decode_s = 0.0
    for _ in range(num_prompts):
        engine = executor.engine(policy="single")
        vocab = engine.info.config.vocab_size
        prompt = (rng.integers(100, 10000, prompt_len) % vocab).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                  ignore_eos=True))
        engine.run()
        first, rest = engine.trace[0], engine.trace[1:]
        prefill_tokens += first.num_prefill_tokens
        prefill_s += first.duration
        decode_tokens += sum(r.num_decode_tokens for r in rest)
        decode_s += sum(r.duration for r in rest)
    return {"prompts": num_prompts, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "prefill_tokens_per_s": prefill_tokens / prefill_s if prefill_s else None,
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s else None}


# ------------------------------------------------------------------------------ HF baselines
def _hf_model(path: str | Path, device: str, dtype: Any) -> Any:
    """transformers' model of the same checkpoint, in minicb's dtype: same precision, same
    quality (the contract's condition for a comparison), warmed up (`hf_warm_up`)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model = model.to(device).eval()
    hf_warm_up(model, device)
    return model


def hf_warm_up(model: Any, device: str) -> None:
    """One untimed short `generate`, so first-use costs (kernel selection, allocator growth)
    fall outside the timed baseline, as they do for minicb's warmed-up engine (chapter 06)."""
    import torch
    ids = torch.ones((1, 8), dtype=torch.long, device=device)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                       do_sample=False, pad_token_id=0)


def _hf_prompts(workload: Workload, vocab: int) -> list[list[int]]:
    prompts = []
    for i, req in enumerate(workload.requests):
        ids = req.token_ids(i)
        prompts.append([t % vocab for t in ids] if max(ids) >= vocab else ids)
    return prompts


def _arrivals(workload: Workload) -> list[float]:
    """Arrival seconds for the HF baselines; step arrivals have no meaning there: time 0."""
    return [r.arrival_time or 0.0 for r in workload.requests]


def hf_static(model: Any, workload: Workload, batch_size: int, device: str = "cpu",
              progress: bool = True, tokens: dict[str, list[int]] | None = None) -> list[Any]:
    """The same requests through transformers' `model.generate` in static batches (chapter
    06): a batch forms from the requests that have arrived (up to `batch_size`), runs, with
    left padding, until its longest output is done, then the next forms. Greedy; EOS neither
    stops a row nor is kept from being chosen (eos_token_id=None: minicb's ignore_eos; the
    min_new_tokens of earlier versions banned it, and a request whose greedy answer holds an EOS
    then took another path). A logits processor stamps each step's time,
    so every request gets its token times, and its release time is the batch's end (E2E counts
    to it, as for minicb's static policy). Returns RequestRecords; `tokens`, if given, receives
    each request's output token ids."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from minicb.trace import RequestRecord

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):  # noqa: D401
            self.times.append(time.perf_counter())
            return scores

    vocab = model.config.vocab_size
    prompts = _hf_prompts(workload, vocab)
    arrivals = _arrivals(workload)
    order = sorted(range(len(prompts)), key=lambda i: (arrivals[i], i))
    pad = model.generation_config.pad_token_id
    pad = pad if isinstance(pad, int) else 0
    records = []
    bar = _bar(progress, len(prompts), "hf-static")
    t0 = time.perf_counter()
    pos = 0
    while pos < len(order):
        now = time.perf_counter() - t0
        if arrivals[order[pos]] > now:
            time.sleep(arrivals[order[pos]] - now)
            now = time.perf_counter() - t0
        batch = []
        while pos < len(order) and len(batch) < batch_size and arrivals[order[pos]] <= now:
            batch.append(order[pos])
            pos += 1
        width = max(len(prompts[i]) for i in batch)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch],
                           device=device)
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i])
                             for i in batch], device=device)
        new = max(workload.requests[i].max_tokens for i in batch)
        stamp = Stamp()
        start = time.perf_counter() - t0
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                 eos_token_id=None, do_sample=False, pad_token_id=pad,
                                 logits_processor=LogitsProcessorList([stamp]))
        times = [t - t0 for t in stamp.times]
        for row, i in enumerate(batch):
            n = workload.requests[i].max_tokens
            rid = workload.requests[i].request_id or f"req-{i}"
            if tokens is not None:
                tokens[rid] = out[row, width:width + n].tolist()
            records.append(RequestRecord(  # generate returns the batch whole, at its end
                rid, len(prompts[i]), n, "length", arrivals[i], start, times[0],
                times[n - 1], times[:n], None, None, None, None, [],
                released_time=times[-1], returned_whole=True))
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    return records


def hf_generate_batch(model: Any, workload: Workload, max_num_seqs: int,
                      max_batch_tokens: int, device: str = "cpu",
                      progress: bool = True, setup: dict | None = None,
                      tokens: dict[str, list[int]] | None = None,
                      cb_options: dict[str, Any] | None = None) -> list[Any]:
    """The same requests through transformers' own continuous batching (chapter 06), the
    engine behind `model.generate_batch`: its manager, so each request keeps its own
    max_new_tokens and is sent at its arrival time. Greedy, no EOS (eos_token_id=-1).
    Token times come from the manager's `record_timestamps`. Returns RequestRecords; `setup`,
    if given, receives what transformers chose (attention, CUDA graphs, async batching);
    `tokens`, each request's output token ids; `cb_options`, more ContinuousBatchingConfig
    fields (`use_cuda_graph=True` for `--hf-cuda-graphs`), refused if this transformers
    has no such field."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    from minicb.trace import RequestRecord

    vocab = model.config.vocab_size
    prompts = _hf_prompts(workload, vocab)
    arrivals = _arrivals(workload)
    order = sorted(range(len(prompts)), key=lambda i: (arrivals[i], i))
    longest = max(r.max_tokens for r in workload.requests)
    gen = GenerationConfig(do_sample=False, max_new_tokens=longest, eos_token_id=-1,
                           pad_token_id=0)
    total_tokens = sum(len(p) + r.max_tokens for p, r in zip(prompts, workload.requests))
    page = 16
    # transformers renamed block_size to page_size after 5.17 (a GPU image may hold the older)
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    unknown = sorted(set(cb_options or {}) - names)
    if unknown:
        raise ValueError(f"this transformers' ContinuousBatchingConfig has no {unknown}")
    cb = ContinuousBatchingConfig(**{"page_size" if "page_size" in names else "block_size": page},
                                  num_blocks=total_tokens // page + 2 * len(prompts) + 8,
                                  max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=max_num_seqs, **(cb_options or {}))
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                          max_generated_length=longest, num_requests=len(prompts))
    ids_of = {}
    results: dict[str, Any] = {}
    bar = _bar(progress, len(prompts), "hf-generate-batch")
    with model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, workload_hints=hints,
            block=True, timeout=5) as manager:
        if setup is not None:  # without flash-attn: paged|sdpa, no CUDA graphs, no async
            chosen = getattr(manager, "continuous_batching_config", None)
            setup.update(attn_implementation=getattr(model.config, "_attn_implementation", None),
                         use_cuda_graph=getattr(chosen, "use_cuda_graph", None),
                         use_async_batching=getattr(chosen, "use_async_batching", None))
        t0 = time.perf_counter()
        pos = 0
        while len(results) < len(prompts):
            now = time.perf_counter() - t0
            while pos < len(order) and arrivals[order[pos]] <= now:
                i = order[pos]
                rid = workload.requests[i].request_id or f"req-{i}"
                ids_of[rid] = i
                manager.add_request(prompts[i], request_id=rid,
                                    max_new_tokens=workload.requests[i].max_tokens,
                                    record_timestamps=True, eos_token_id=-1)
                pos += 1
            wait = 0.05 if pos >= len(order) else max(0.0, arrivals[order[pos]] - now)
            result = manager.get_result(timeout=min(wait, 0.05) or 0.001)
            if result is not None and result.is_finished():
                results[result.request_id] = result
                if bar is not None:
                    bar.update(1)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped early")
    if bar is not None:
        bar.close()
    records = []
    for rid, out in results.items():
        i = ids_of[rid]
        if tokens is not None:
            tokens[rid] = list(out.generated_tokens)
        times = [t - t0 for t in (out.timestamps or [])]
        reason = "error" if out.error else "length"
        start = out.lifespan[0] - t0 if out.lifespan[0] > 0 else None
        end = out.lifespan[1] - t0 if out.lifespan[1] > 0 else (times[-1] if times else None)
        records.append(RequestRecord(
            rid, len(prompts[i]), len(out.generated_tokens), reason, arrivals[i], start,
            times[0] if times else None, end, times, None, None, None, None, []))
    return records


def hf_single_stream(model: Any, num_prompts: int = 3, prompt_len: int = 128,
                     max_tokens: int = 32, device: str = "cpu") -> dict[str, Any]:
    """HF `generate` at batch 1 (chapter 01 baseline): prefill tokens/s from a one-token
    generate, decode tokens/s from the rest of a `max_tokens` generate."""
    import numpy as np
    import torch
    rng = np.random.default_rng(1234)
    vocab = model.config.vocab_size
    prefill_s = full_s = 0.0
    kw = dict(do_sample=False, pad_token_id=0)
    for _ in range(num_prompts):
        ids = torch.tensor([(rng.integers(100, 10000, prompt_len) % vocab).tolist()],
                           device=device)
        with torch.inference_mode():
            t = time.perf_counter()
            model.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, **kw)
            prefill_s += time.perf_counter() - t
            t = time.perf_counter()
            model.generate(input_ids=ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           **kw)
            full_s += time.perf_counter() - t
    decode_s = full_s - prefill_s
    return {"prompts": num_prompts, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "prefill_tokens_per_s": num_prompts * prompt_len / prefill_s,
            "decode_tokens_per_s": num_prompts * (max_tokens - 1) / decode_s
            if decode_s > 0 else None}


def _bar(progress: bool, total: int, desc: str) -> Any:
    if not progress:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=f"{desc:>10}", unit="req", leave=False, file=sys.stderr)


# ------------------------------------------------------------------------------ output
def results_schema_ok(results: dict[str, Any]) -> list[str]:
    """Missing keys of the results schema, per policy; empty when complete (chapter 06)."""
    missing = []
    if "declaration" not in results or "results" not in results:
        return ["declaration/results"]
    for name, summary in results["results"].items():
        for key in RESULT_KEYS:
            if key not in summary:
                missing.append(f"{name}.{key}")
        for key in ("ttft_s", "itl_s", "max_itl_s", "tpot_s", "e2e_s", "queue_s"):
            if isinstance(summary.get(key), dict) and \
                    set(summary[key]) != {"p50", "p95", "p99"}:
                missing.append(f"{name}.{key}.p50/p95/p99")
    return missing


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def write_json(data: dict[str, Any], path: str | Path) -> Path:
    """Write a results dict as indented JSON (numpy numbers become plain ones) (chapter 06).
    The file appears whole or not at all: a run stopped while writing (a time limit) leaves
    the previous file, never a truncated one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2, default=_json_default) + "\n"
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")  # one per writing process
    try:
        partial.write_text(text)  # with the umask's permissions, unlike tempfile's 0600
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def plot_results(data: dict[str, Any], path: str | Path) -> Path:
    """A simple figure (chapter 06): latency percentiles and throughput per policy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    results = data["results"]
    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    x = np.arange(len(names))
    for ax, metric, title in ((axes[0], "ttft_s", "TTFT (s)"), (axes[1], "e2e_s", "E2E (s)")):
        for k, p in enumerate(("p50", "p95", "p99")):
            values = [lookup(results[n], f"{metric}.{p}") or 0.0 for n in names]
            ax.bar(x + (k - 1) * 0.27, values, 0.27, label=p)
        ax.set_xticks(x, names, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend()
    tput = [results[n].get("output_tokens_per_s") or 0.0 for n in names]
    good = [results[n].get("goodput_rps") or 0.0 for n in names]
    axes[2].bar(x - 0.2, tput, 0.4, label="output tokens/s")
    ax2 = axes[2].twinx()
    ax2.bar(x + 0.2, good, 0.4, color="tab:green", label="goodput (req/s)")
    axes[2].set_xticks(x, names, rotation=30, ha="right")
    axes[2].set_title("throughput (bars: tokens/s, green: goodput req/s)")
    decl = data.get("declaration", {})
    sim = " [SIMULATED]" if decl.get("simulated") else ""
    fig.suptitle(f"{lookup(decl, 'workload.workload')} on {lookup(decl, 'model.name')}{sim}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _print_extra(name: str, summary: dict[str, Any]) -> None:
    parts = []
    if summary.get("total_tokens_per_s") is not None:
        parts.append(f"token throughput {_fmt(summary['total_tokens_per_s'])} tok/s = prompts "
                     f"{_fmt(summary['prompt_tokens_per_s'])} + outputs "
                     f"{_fmt(summary['output_tokens_per_s'])}")
    if summary.get("num_steps"):  # what the steps processed (transformers' runs have none)
        parts.append(f"tokens: {summary['prefill_tokens']} prefill + "
                     f"{summary['decode_tokens']} decode, "
                     f"{summary['mean_tokens_per_step']:.1f}/step, "
                     f"mixed steps {summary['mixed_steps']} "
                     f"({summary['mixed_step_share']:.0%})")
    if summary.get("dec_at_p") is not None:
        parts.append(f"dec@P={summary['dec_at_p']} tokens")
        parts.append(f"short_P={summary['short_p_steps']} steps / "
                     f"{_fmt(summary['short_p_s'])} s")
    if summary.get("dead_slot_steps"):
        parts.append(f"dead slot-steps={summary['dead_slot_steps']}")
    if summary.get("draft_tokens"):
        parts.append(f"guessed tokens={summary['draft_tokens']}, kept "
                     f"{summary['draft_acceptance_rate']:.0%}")
    if summary.get("cancelled") or summary.get("errors"):
        parts.append(f"cancelled={summary['cancelled']} errors={summary['errors']}")
    if summary.get("deadline_missed"):
        parts.append(f"deadline missed={summary['deadline_missed']}")
    if summary.get("discarded_tokens") or summary.get("evicted_pages"):  # memory pressure
        parts.append(f"work lost to preemption={summary['discarded_tokens']} tokens "
                     f"({summary['recomputed_tokens']} computed again), "
                     f"cached pages evicted={summary['evicted_pages']}")
    if summary.get("swapped_out_pages") or summary.get("swapped_in_pages"):
        parts.append(f"pages swapped to host memory={summary['swapped_out_pages']}, "
                     f"back={summary['swapped_in_pages']}")
    if summary.get("rejected"):
        parts.append(f"rejected when full={summary['rejected']}")
    if summary.get("kv_pool_use_peak") is not None:
        parts.append(f"KV pool use mean {summary['kv_pool_use_mean']:.0%} peak "
                     f"{summary['kv_pool_use_peak']:.0%}, token budget use mean "
                     f"{summary['token_budget_use_mean']:.0%}")
    if summary.get("slo") and summary.get("slo_attainment") is not None:
        parts.append(f"SLO met by {summary['slo_attainment']:.0%}")
    if summary.get("max_queue_age_s") is not None:
        parts.append(f"oldest queue age={_fmt(summary['max_queue_age_s'])} s")
    single = summary.get("single_stream")
    if single:
        parts.append(f"batch-1 decode {_fmt(single['decode_tokens_per_s'])} tok/s, prefill "
                     f"{_fmt(single['prefill_tokens_per_s'])} tok/s")
    if parts:
        print(f"  {name}: " + "; ".join(parts))


def class_lines(name: str, summary: dict[str, Any]) -> list[str]:
    """The per-class fairness of one result (`metrics.by_class`): a small table per grouping
    with more than one class (chapter 06)."""
    lines = []
    for grouping, rows in (summary.get("by_class") or {}).items():
        slo = any(row["slo_attainment"] is not None for row in rows.values())
        lines.append(f"  {name} by {grouping.replace('_', ' ')}: done/requests, TTFT p50 and "
                     "p99, E2E p99 (s)" + (", SLO met" if slo else ""))
        width = max(len(label) for label in rows)
        for label, row in rows.items():
            lines.append(f"    {label:>{width}}  {row['completed']:>4}/{row['requests']:<4} "
                         f"{_fmt(row['ttft_p50_s']):>7} {_fmt(row['ttft_p99_s']):>7} "
                         f"{_fmt(row['e2e_p99_s']):>7}"
                         + (f" {row['slo_attainment']:>5.0%}" if slo else ""))
    return lines


def _command_line(command: str, argv: list[str] | None) -> str:
    import shlex
    argv = sys.argv[1:] if argv is None else argv
    return " ".join(["python -m minicb", command] + [shlex.quote(str(a)) for a in argv])


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


# ------------------------------------------------------------------------------ bench
def bench_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m minicb bench` (chapter 06)."""
    parser = argparse.ArgumentParser(
        prog="python -m minicb bench",
        description="Run one workload under one or several policies (and optionally Hugging "
                    "Face transformers) and report the benchmark contract's metrics.")
    add_common_arguments(parser)
    parser.add_argument("--policy", action="append", default=None,
                        help="policy or comma-separated policies; repeatable (default pd)")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--min-chunk", type=int, default=None,
                        help="pd: the smallest prefill chunk worth a step (chapter 05)")
    parser.add_argument("--endpoint", default=None,
                        help="measure a running OpenAI-compatible server (URL) from the client "
                             "side instead of running an engine")
    add_endpoint_arguments(parser)
    parser.add_argument("--compare", choices=("hf",), default=None,
                        help="hf: also run the requests through transformers' generate "
                             "(static batches) and generate_batch")
    parser.add_argument("--hf-cuda-graphs", action="store_true",
                        help="with --compare hf: ask generate_batch's manager for CUDA graphs "
                             "on both its paths (transformers turns them off without "
                             "flash-attn; this forces them on, as a stronger baseline)")
    parser.add_argument("--plot", default=None, help="write a PNG figure here")
    parser.add_argument("--save-workload", default=None, metavar="PATH",
                        help="write the requests this run sends as a trace (JSON Lines; CSV if "
                             "PATH ends in .csv) that --workload-file replays")
    return parser


# bench flags that set up minicb's own engine: a server measured with --endpoint has its own
ENGINE_FLAGS = {"policy": "--policy", "max_num_seqs": "--max-num-seqs",
                "max_num_batched_tokens": "--max-num-batched-tokens", "chunk_size": "--chunk-size",
                "min_chunk": "--min-chunk", "num_pages": "--num-pages", "page_size": "--page-size",
                "no_prefix_caching": "--no-prefix-caching", "no_cuda_graphs": "--no-cuda-graphs",
                "preemption": "--preemption",
                "priority_aging_steps": "--priority-aging-steps",
                "max_preemptions": "--max-preemptions",
                "preemption_mode": "--preemption-mode", "num_swap_pages": "--num-swap-pages",
                "reject_when_full": "--reject-when-full",
                "num_speculative_tokens": "--num-speculative-tokens",
                "batch_timeout": "--batch-timeout", "cache_state": "--cache-state",
                "executor": "--executor", "cost_model": "--cost-model", "device": "--device",
                "quantization": "--quantization", "dtype": "--dtype", "threads": "--threads",
                "compare": "--compare", "hf_cuda_graphs": "--hf-cuda-graphs", "plot": "--plot"}


def refuse_engine_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """With --endpoint the server runs the engine: refuse the flags that would configure
    minicb's own, rather than accept and ignore them (chapter 06)."""
    given = [flag for dest, flag in ENGINE_FLAGS.items()
             if getattr(args, dest) != parser.get_default(dest)]
    if given:
        raise ValueError(f"--endpoint measures a running server, which has its own engine "
                         f"settings: drop {', '.join(given)} (set them where the server starts, "
                         "e.g. python -m minicb serve --max-num-seqs 32)")


def refuse_unequal_hf_comparison(args: argparse.Namespace, workload: Any) -> None:
    """--compare hf runs transformers on the same requests at the same precision: refuse what
    would make the two sides do different work (chapter 06)."""
    if args.executor == "sim":
        raise ValueError("--compare hf needs --executor real (transformers cannot be simulated)")
    if args.quantization:
        raise ValueError("--compare hf with --quantization: transformers would run the float "
                         "weights, not the same quality; compare without --quantization")
    if getattr(args, "cancel_fraction", None):
        raise ValueError("--compare hf with --cancel-fraction: transformers' baselines cannot "
                         "cancel, so every request would run to its full length there")
    if getattr(args, "cache_state", "cold") == "warm":
        raise ValueError("--compare hf with --cache-state warm: transformers' baselines start "
                         "cold; compare with --cache-state cold")
    if getattr(args, "max_concurrency", None) is not None:
        raise ValueError("--compare hf with --max-concurrency: transformers' baselines send "
                         "every request at its arrival time; compare in an open loop")
    if getattr(args, "reject_when_full", False):
        raise ValueError("--compare hf with --reject-when-full: transformers' baselines turn "
                         "nobody away, so the two sides would serve different requests")
    cut = [r.request_id or f"#{i}" for i, r in enumerate(workload.requests)
           if r.cancel_after_tokens is not None or r.deadline is not None]
    if cut:
        raise ValueError(f"--compare hf on a workload whose requests are cancelled or have "
                         f"deadlines ({', '.join(map(str, cut[:3]))}"
                         f"{', ...' if len(cut) > 3 else ''}): transformers' baselines run "
                         "every request to its full length; compare without them")


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Everything `bench` does, returning the results dict (chapter 06)."""
    policies = _policies(args.policy)
    check_writable(args.out, "--out")
    check_writable(args.plot, "--plot")
    set_threads(args.threads)
    check_max_concurrency(args.max_concurrency)
    workload, warmup = build_workload(args), warmup_workload(args)
    if args.compare == "hf":
        refuse_unequal_hf_comparison(args, workload)
    elif getattr(args, "hf_cuda_graphs", False):
        raise ValueError("--hf-cuda-graphs sets up transformers' generate_batch: it needs "
                         "--compare hf")
    slo = slo_from_args(args)
    options = engine_options(args, workload)
    for policy in policies:  # a bad flag fails now, not after the policies before it ran
        EngineConfig(policy=policy, **options)
    if getattr(args, "save_workload", None):
        print(saved_workload_line(workload, args.save_workload))
    device = resolve_device(args.device, args.quantization)
    progress = not args.no_progress
    if args.executor != "sim":  # before the model loads
        check_wall_clock_span(workload, warmup)
    executor = executor_from_args(args, device)
    executor.warm_up()
    if executor.simulated:
        print(f"[{SIMULATED_NOTE}: {executor.cost.name}]", file=sys.stderr)
    results: dict[str, Any] = {}
    reference: dict[str, list[int]] = {}  # the first policy's greedy tokens, for the others
    reference_rejected: set[str] = set()  # and the requests it turned away (none to compare)
    reference_cut: set[str] = set()  # and those its deadlines cut short
    for policy in policies:
        engine = None  # the last policy's engine and its pool, before the next is sized
        free_device_memory(device)
        summary, engine = run_policy(executor, policy, workload, options, slo, progress,
                                     warmup, args.max_concurrency)
        tokens = None if executor.simulated else output_tokens(engine)
        if policy == policies[0]:
            reference = tokens or {}
            reference_rejected = finished_ids(engine, "rejected")
            reference_cut = finished_ids(engine, "deadline")
        else:
            summary["same_tokens_as"] = same_tokens(
                reference, tokens, policies[0],
                rejected=reference_rejected | finished_ids(engine, "rejected"),
                cut=reference_cut | finished_ids(engine, "deadline"))
        if policy == "single" and not executor.simulated:
            summary["single_stream"] = measure_single_stream(executor)
        results[policy] = without_slo(summary, slo)
    data = {"declaration": declaration(args, workload, executor, policies, options, slo,
                                       engine), "results": results}
    engine = None
    free_device_memory(device)
    if args.compare == "hf":
        from minicb.benchmark.metrics import summarize as summarize_records
        if getattr(args, "out", None):  # minicb's results survive a baseline that is killed
            data["declaration"]["compare"] = "hf: running (this file is rewritten when done)"
            write_json(data, args.out)
        hf_dtype = next(executor.pair[0].parameters()).dtype  # what minicb's weights run in
        hf = _hf_model(executor.pair[1].path, device, hf_dtype)
        batch = options.get("max_num_seqs", 16)
        budget = options.get("max_num_batched_tokens", 256)
        hf_setup: dict[str, Any] = {}
        hf_tokens: dict[str, dict[str, list[int]]] = {"hf-static": {}, "hf-generate-batch": {}}
        for name, fn in (("hf-static", lambda: hf_static(hf, workload, batch, device,
                                                         progress, hf_tokens["hf-static"])),
                         ("hf-generate-batch", lambda: hf_generate_batch(
                             hf, workload, batch, budget, device, progress, hf_setup,
                             hf_tokens["hf-generate-batch"],
                             {"use_cuda_graph": True} if args.hf_cuda_graphs else None))):
            try:
                results[name] = without_slo(summarize_records([], fn(), slo), slo)
                results[name]["same_tokens_as"] = same_tokens(reference, hf_tokens[name],
                                                              policies[0], reference_rejected)
            except Exception as exc:  # report, keep the other results
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        if "single" in policies:
            results["single"]["hf_single_stream"] = hf_single_stream(hf, device=device)
        data["declaration"]["compare"] = {
            "hf-static": "transformers model.generate, static batches of max_num_seqs, left "
                         "padding, greedy, runs to the batch's longest output",
            "hf-generate-batch": "transformers continuous batching manager (generate_batch's "
                                 "engine), per-request max_new_tokens, eos disabled",
            "hf-generate-batch setup": hf_setup,
            "dtype": str(hf_dtype).removeprefix("torch."),
            "memory": "hf-generate-batch: KV blocks for every request at once (transformers "
                      "sizes its own cache); hf-static: what generate allocates",
            "step_arrivals": "requests with an arrival step arrive at time 0 for HF",
            "warm_up": "one untimed short generate before the timed runs (minicb's engine is "
                       "warmed up the same way)"}
    return data


def main_bench(argv: list[str] | None = None) -> int:
    """`python -m minicb bench ...`: returns an exit code (chapter 06)."""
    parser = bench_parser()
    args = parser.parse_args(argv)
    args.command_line = _command_line("bench", argv)
    if args.endpoint:  # any OpenAI-compatible server, measured from the client side
        from minicb.serving.client import bench_endpoint, print_errors, report
        try:
            refuse_engine_flags(parser, args)
            check_writable(args.out, "--out")
            workload, slo = build_workload(args), slo_from_args(args)
            check_wall_clock_span(workload)
            if args.save_workload:
                print(saved_workload_line(workload, args.save_workload))
            model = None if args.model == parser.get_default("model") else args.model
            check_max_concurrency(args.max_concurrency)
            data = bench_endpoint(args.endpoint, workload, label=args.endpoint, model=model,
                                  vocab_size=args.vocab_size, progress=not args.no_progress,
                                  slo=slo, omit=args.omit_field,
                                  max_concurrency=args.max_concurrency)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        decl = data["declaration"]
        decl["command"] = args.command_line
        print(workload_line(decl))
        print(f"concurrency: {concurrency_text(decl.get('concurrency') or {})}; endpoint "
              f"{decl.get('endpoint')}, model {decl.get('model') or 'the server default'}, "
              f"measured at the {decl.get('measured_at')}; SLO {slo or 'none'}\n")
        print(report(data["results"]))
        print_errors(data["results"])
        if args.out:
            print(f"wrote {write_json(data, args.out)}")
        return 0
    try:
        data = run_bench(args)
    except (ValueError, NotImplementedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_report(data)
    if args.out:
        print(f"wrote {write_json(data, args.out)}")
    if args.plot:
        print(f"wrote {plot_results(data, args.plot)}")
    return 0


def weights_label(decl: dict[str, Any]) -> str:
    """What the real executor's weights were: "int8", "torch.float32 prepacked", ..."""
    label = lookup(decl, "model.quantization") or lookup(decl, "model.dtype")
    return f"{label} prepacked" if lookup(decl, "model.prepacked") else str(label)


def _lengths(spec: Any) -> str:
    """`{'kind': 'uniform', 'low': 16, 'high': 512}` -> `uniform 16-512`; a lognormal adds its
    median and sigma; other forms as given."""
    if isinstance(spec, dict) and {"low", "high"} <= spec.keys():
        shape = "".join(f" {k} {spec[k]:g}" for k in ("median", "sigma") if k in spec)
        shape += "," if shape else ""
        return f"{spec.get('kind', '')}{shape} {spec['low']}-{spec['high']}".strip()
    if isinstance(spec, dict):
        return " ".join(f"{k}={v}" for k, v in spec.items())
    return str(spec)


def _head(text: Any) -> str:
    """The words before a declaration entry's explanation: `open loop: each...` -> `open loop`."""
    return str(text).split(":")[0]


def workload_line(wl: dict[str, Any]) -> str:
    """A workload's declaration in one printed line (chapter 06): requests, arrival process,
    rate and burstiness (and what a generated sample delivered), prompt and output lengths."""
    rate = wl.get("rate_rps")
    arrivals = str(wl.get("arrival_process"))
    if rate is not None:
        arrivals += f" at {rate:g} req/s"
    if wl.get("burstiness") is not None:
        arrivals += f" (burstiness {wl['burstiness']:g})"
    observed = wl.get("observed")  # a generated sample: what its arrivals deliver
    if rate is not None and observed:
        drawn = observed["rate_rps"]
        arrivals += (f", drawn {drawn:.3g} req/s over {observed['arrival_span_s']:.3g} s"
                     if drawn else ", drawn all at t=0")
    return (f"workload {wl.get('workload')}: {wl.get('num_requests')} requests, arrivals "
            f"{arrivals}, prompts {_lengths(wl.get('prompt_lengths'))}, outputs "
            f"{_lengths(wl.get('output_lengths'))}")


def concurrency_text(concurrency: dict[str, Any]) -> str:
    """The declared loop (open, or closed with its number of users), chapter 06."""
    loop = _head(concurrency.get("client"))
    if concurrency.get("max_concurrency"):
        loop += f" of {concurrency['max_concurrency']}"
    return loop


def declaration_lines(decl: dict[str, Any]) -> list[str]:
    """The benchmark contract's declaration in a few printed lines (chapter 06): arrival process,
    burstiness and rate, lengths, concurrency, cache state, policy and its options, token
    budget, memory limit, model, runtime and hardware, SLO. The JSON holds all of it in full."""
    cache = decl.get("cache_state") or {}
    concurrency = decl.get("concurrency") or {}
    options = {k: v for k, v in (decl.get("policy_options") or {}).items()
               if v not in (None, 0) and k != "batch_timeout"}
    runtime = ", ".join(f"{k} {v}" for k, v in (decl.get("runtime") or {}).items())
    cpu_model = lookup(decl, "device.cpu_model")
    hardware = (f"{lookup(decl, 'device.device')} ({lookup(decl, 'device.cpu_count')} CPUs"
                + (f", {cpu_model})" if cpu_model else ")"))
    policies = ", ".join(decl.get("policy") or [])
    if options:
        policies += f" ({', '.join(f'{k}={v}' for k, v in options.items())})"
    caching = "on" if cache.get("prefix_caching") else "off"
    executor = ("SIMULATED, not measured" if decl.get("simulated")
                else f"{weights_label(decl)} weights, attention "
                     f"{decl.get('attention_backend', '?')}"
                     + (", CUDA graphs off" if decl.get("cuda_graphs") is False else ""))
    return [
        # the run's own declaration of arrivals and lengths, else its workload's
        workload_line({**decl["workload"], **{k: decl[k] for k in (
            "arrival_process", "rate_rps", "burstiness", "prompt_lengths", "output_lengths")
            if k in decl}}),
        f"concurrency: {concurrency_text(concurrency)}, max_num_seqs "
        f"{concurrency.get('max_num_seqs')}; cache: prefix "
        f"caching {caching}, {_head(cache.get('start'))} start; policies {policies}",
        f"model {lookup(decl, 'model.name')}; executor {decl['executor']}"
        + (" -- " if decl.get("simulated") else ", ") + f"{executor}; on {hardware}",
        f"runtime {runtime}" if runtime else "runtime ?",
        f"token budget {decl['token_budget']}, memory {decl['memory_limit']}, "
        f"SLO {decl.get('slo') or 'none'}",
    ]


def print_report(data: dict[str, Any]) -> None:
    """Print the declaration summary, the table and the per-policy extras (chapter 06)."""
    decl = data["declaration"]
    print()
    for line in declaration_lines(decl):
        print(line)
    print()
    ok = {k: v for k, v in data["results"].items() if "error" not in v}
    print(format_table(ok, TABLE_COLUMNS))
    for line in quality_lines(ok):
        print(line)
    if not decl.get("slo"):
        print(f"goodput: - ({NO_SLO_NOTE})")
    if not {"static", "dynamic", "hf-static"} & set(data["results"]):
        print("note: no static or dynamic batching row; the contract compares continuous "
              "batching with one at the same load and quality (e.g. --policy static,pd)")
    for name, summary in data["results"].items():
        if "error" in summary:
            print(f"  {name}: failed: {summary['error']}")
        else:
            _print_extra(name, summary)
            for line in class_lines(name, summary):
                print(line)
        hf1, own = summary.get("hf_single_stream"), summary.get("single_stream")
        if hf1:
            print(f"  hf generate batch-1: decode {_fmt(hf1['decode_tokens_per_s'])} tok/s, "
                  f"prefill {_fmt(hf1['prefill_tokens_per_s'])} tok/s")
        if hf1 and own and hf1["decode_tokens_per_s"] and own["decode_tokens_per_s"]:
            ratio = own["decode_tokens_per_s"] / hf1["decode_tokens_per_s"]
            print(f"  batch-1 decode: minicb ({weights_label(decl)} weights) / hf generate "
                  f"(its float weights) = {ratio:.2f}x")
    print("\nlatency percentiles (s)")
    print(format_table(ok, LATENCY_COLUMNS))


# ------------------------------------------------------------------------------ sweep
def sweep_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m minicb sweep` (chapter 06)."""
    parser = argparse.ArgumentParser(
        prog="python -m minicb sweep",
        description="Vary the token budget, max_num_seqs, chunk size and priority policy "
                    "(--preemption, a comma list) on a workload; report the setting with the "
                    "highest goodput at the SLO.")
    add_common_arguments(parser)
    parser.add_argument("--policy", default="pd", choices=POLICIES)
    parser.add_argument("--max-num-batched-tokens", default="64,128,256,512")
    parser.add_argument("--max-num-seqs", default="4,8,16")
    parser.add_argument("--chunk-size", default="64,256")
    parser.add_argument("--rates", default=None,
                        help="comma-separated arrival rates (requests/s): sweep the offered load "
                             "too and report each setting's sustainable load, the highest rate "
                             "meeting the SLO for --slo-target of the requests (needs an SLO)")
    parser.add_argument("--slo-target", type=float, default=0.99,
                        help="with --rates: the fraction of requests that must meet the SLO")
    parser.add_argument("--max-queue-age", type=float, default=None, metavar="SECONDS",
                        help="a fairness limit: a setting whose oldest request waited longer "
                             "than this before its first step is not chosen as best")
    parser.add_argument("--min-class-attainment", type=float, default=None, metavar="FRACTION",
                        help="a fairness limit across classes (needs an SLO): a setting in "
                             "which some prompt-length bucket, tenant or priority class met "
                             "the SLO for less than this fraction of its requests is not "
                             "chosen as best")
    return parser


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Every combination of the four lists (budget, max_num_seqs, chunk size, preemption; and
    of --rates); rows sorted by goodput, then tokens/s. With --rates, each setting's
    sustainable load too (chapter 06). --priority-aging-steps applies to the priority rows."""
    check_writable(args.out, "--out")
    set_threads(args.threads)
    reads = settings_read(args.policy, bool(args.num_speculative_tokens))
    lists = {"max_num_batched_tokens": _int_list(args.max_num_batched_tokens,
                                                 "--max-num-batched-tokens"),
             "max_num_seqs": _int_list(args.max_num_seqs, "--max-num-seqs"),
             "chunk_size": _int_list(args.chunk_size, "--chunk-size")}
    # a setting the policy does not read runs at its first value: varying it would run the
    # same schedule again and rank copies of one row
    lists = {name: values if name in reads else values[:1] for name, values in lists.items()}
    budgets, seqs, chunks = (lists[k] for k in ("max_num_batched_tokens", "max_num_seqs",
                                                "chunk_size"))
    preemptions = _preemptions(args.preemption)
    aging = args.priority_aging_steps
    if aging is not None and not is_positive_int(aging):  # or every priority row is skipped
        raise ValueError(f"--priority-aging-steps must be a positive integer, got {aging!r}")
    if aging is not None and "priority" not in preemptions:
        raise ValueError("--priority-aging-steps ages priorities: it needs priority among "
                         "--preemption")
    rates = _rate_list(args.rates, "--rates") if getattr(args, "rates", None) else [None]
    slo = slo_from_args(args)
    check_max_concurrency(args.max_concurrency)
    fairness = getattr(args, "max_queue_age", None)
    if fairness is not None and (not is_finite_number(fairness) or fairness <= 0):
        raise ValueError(f"--max-queue-age must be a number of seconds > 0, got {fairness!r}")
    class_floor = getattr(args, "min_class_attainment", None)
    if class_floor is not None:
        if not is_finite_number(class_floor) or not 0 < class_floor <= 1:
            raise ValueError(f"--min-class-attainment must be a fraction in (0, 1], got "
                             f"{class_floor!r}")
        if not slo:
            raise ValueError("--min-class-attainment limits each class's share of requests "
                             "meeting the SLO: give one (--slo-ttft, --slo-itl, --slo-tpot, "
                             "--slo-e2e)")
    target = getattr(args, "slo_target", 0.99)
    if rates != [None]:
        if args.rate is not None:
            raise ValueError("give --rate or --rates, not both")
        if args.max_concurrency is not None:
            raise ValueError("--rates with --max-concurrency: a closed loop sends no faster "
                             "than its users get answers, so every offered rate past that "
                             "would look sustainable; find the sustainable load in an open "
                             "loop (drop --max-concurrency)")
        if not slo:
            raise ValueError("--rates reports the sustainable load, the highest rate that meets "
                             "an SLO: give one (--slo-ttft, --slo-itl, --slo-tpot, --slo-e2e)")
        if not is_finite_number(target) or not 0 < target <= 1:
            raise ValueError(f"--slo-target must be a fraction in (0, 1], got {target!r}")
    elif target != 0.99:
        raise ValueError("--slo-target is the share of requests a sustainable rate must serve "
                         "within the SLO: it needs --rates")
    traffic = {}
    for rate in rates:
        at_rate = args if rate is None else argparse.Namespace(**{**vars(args), "rate": rate})
        traffic[rate] = (build_workload(at_rate, "--rate" if rate is None else "--rates"),
                         warmup_workload(at_rate))
    workload = traffic[rates[-1]][0]
    base = engine_options(argparse.Namespace(**{**vars(args), "preemption": None,
                                                "priority_aging_steps": None}), workload)
    for key in ("max_num_seqs", "max_num_batched_tokens", "chunk_size"):
        base.pop(key, None)
    if args.executor != "sim":  # before the model loads
        check_wall_clock_span(*(w for pair in traffic.values() for w in pair))
    device = resolve_device(args.device, args.quantization)
    executor = executor_from_args(args, device)
    executor.warm_up()
    rows = []
    skipped = []
    references: dict[float | None, dict[str, list[int]]] = {}  # by rate: the quality reference
    grid = list(itertools.product(budgets, seqs, chunks, preemptions, rates))
    bar = _bar(not args.no_progress, len(grid), "sweep")
    refused: set[tuple] = set()  # a setting refused at one rate is refused at every rate
    for budget, num_seqs, chunk, preemption, rate in grid:
        setting = {"max_num_batched_tokens": budget, "max_num_seqs": num_seqs,
                   "chunk_size": chunk, "preemption": preemption}
        if tuple(setting.values()) in refused:
            if bar is not None:
                bar.update(1)
            continue
        options = dict(base, **setting)
        if preemption == "priority" and aging is not None:
            options["priority_aging_steps"] = aging
        free_device_memory(device)  # the last setting's engine is gone: give its pool back
        try:
            summary, engine = run_policy(executor, args.policy, traffic[rate][0], options, slo,
                                         progress=False, warmup=traffic[rate][1],
                                         max_concurrency=args.max_concurrency)
        except ValueError as exc:  # e.g. pd with a budget below max_num_seqs
            refused.add(tuple(setting.values()))
            skipped.append({"setting": setting, "reason": str(exc)})
        else:
            row = {**({} if rate is None else {"rate_rps": rate}),
                   **setting, "goodput_rps": summary["goodput_rps"] if slo else None,
                   "requests_per_s": summary["requests_per_s"],
                   "output_tokens_per_s": summary["output_tokens_per_s"],
                   "ttft_p99_s": summary["ttft_s"]["p99"],
                   "tpot_p99_s": summary["tpot_s"]["p99"],
                   "e2e_p99_s": summary["e2e_s"]["p99"],
                   "slo_attainment": summary["slo_attainment"] if slo else None,
                   "max_queue_age_s": summary["max_queue_age_s"],
                   **worst_class_fields(summary),
                   "preemptions": summary["preemptions"],
                   "swapped_out_pages": summary["swapped_out_pages"],
                   "swapped_in_pages": summary["swapped_in_pages"],
                   "rejected": summary["rejected"],
                   "cancelled": summary["cancelled"], "errors": summary["errors"],
                   "cancellations_honoured": cancellations_honoured(engine,
                                                                    traffic[rate][0]),
                   "same_tokens": None}
            if not executor.simulated:
                tokens = output_tokens(engine)
                engine = None  # its pool goes before the reference's is sized
                if rate not in references:
                    free_device_memory(device)
                    references[rate] = reference_tokens(executor, traffic[rate][0], base)
                row.update(quality_check(references[rate], tokens))
            row["fails"] = requirement_failures(row, fairness, class_floor)
            rows.append(row)
        engine = None
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    sustainable = sustainable_rows(rows, target) if rates != [None] else []
    ranked_by = "goodput_rps" if slo else "requests_per_s"
    rows[:] = ranked(rows, ranked_by)
    decl = declaration(args, workload, executor, [args.policy], base, slo)
    decl["token_budget"].update(max_num_batched_tokens=budgets, chunk_size=chunks,
                                varied="per row: every combination of the lists")
    decl["concurrency"]["max_num_seqs"] = seqs
    decl["policy_options"].update(preemption=preemptions, priority_aging_steps=aging)
    unread = [k for k in lists if k not in reads]
    if unread:
        decl["not_varied"] = (f"{args.policy} does not read {', '.join(unread)}: each runs at "
                              "the first value given only (other values give the same rows)")
    if rates != [None]:
        decl["rate_rps"] = rates
        decl["slo_target"] = target
    decl["fairness"] = {key: value for key, value in (("max_queue_age_s", fairness),
                        ("min_class_attainment", class_floor)) if value is not None} or None
    decl["requirements"] = sweep_requirements(fairness, executor.simulated, class_floor)
    if rates == [None]:
        best = best_setting(rows, fairness, ranked_by, class_floor)
    else:  # rows at different offered loads do not compare: the pick is the load sustained
        best = next((r for r in sustainable[:1] if r["sustainable_load_rps"] is not None), None)
    return {"declaration": decl, "rows": rows, "skipped": skipped,
            "best": best, "sustainable": sustainable,
            "note": None if slo else f"{NO_SLO_NOTE}; the best setting is then the one with "
                                     "the most completed requests/s"}


def settings_read(policy: str, speculating: bool) -> tuple[str, ...]:
    """The batch settings `policy`'s schedule depends on (`Scheduler.reads`; speculative
    decoding's guesses take the token budget the policy left, so with it every policy reads
    max_num_batched_tokens), chapter 06."""
    reads = POLICY_CLASSES[policy].reads
    if speculating and "max_num_batched_tokens" not in reads:
        reads = (*reads, "max_num_batched_tokens")
    return reads


def ranked(rows: list[dict[str, Any]], by: str = "goodput_rps") -> list[dict[str, Any]]:
    """Sweep rows best first (chapter 06): by `by` (goodput at the SLO; completed requests/s
    without one), ties to the most output tokens/s, then grid order."""
    return sorted(rows, key=lambda r: (-(r[by] or 0.0), -(r["output_tokens_per_s"] or 0.0)))


def best_setting(rows: list[dict[str, Any]], max_queue_age: float | None = None,
                 by: str = "goodput_rps", min_class_attainment: float | None = None
                 ) -> dict[str, Any] | None:
    """The contract's pick ("选择同时满足公平性、取消和质量要求的最高 SLO-qualified Goodput";
    chapter 06, exercise 6.4): the first of `ranked(rows, by)` that fails no requirement
    (`requirement_failures`, fairness against `max_queue_age` and `min_class_attainment`);
    None if every row fails one."""
    fit = [r for r in rows if not requirement_failures(r, max_queue_age, min_class_attainment)]
    return ranked(fit, by)[0] if fit else None


def reference_tokens(executor: Executor, workload: Workload,
                     options: dict[str, Any]) -> dict[str, list[int]]:
    """A sweep's quality reference (chapter 06): each request's greedy tokens served alone
    (policy single: nothing batched with it, no prefix cache, no speculation), all at once and
    to its full length (no arrival times, deadlines or cancellations)."""
    alone = Workload(workload.name, [dataclasses.replace(
        r, arrival_time=None, arrival_step=None, deadline=None, cancel_after_tokens=None)
        for r in workload.requests])
    # served alone, none is turned away: reject_when_full would leave some without a reference
    options = dict(options, enable_prefix_caching=False, num_speculative_tokens=0,
                   reject_when_full=False)
    return output_tokens(run_policy(executor, "single", alone, options, progress=False)[1])


def quality_check(reference: dict[str, list[int]],
                  tokens: dict[str, list[int]]) -> dict[str, Any]:
    """The contract's quality requirement for one sweep setting (chapter 06): every token a
    request got equals the one it gets served alone (a cancelled or expired request got a
    prefix of them)."""
    differing = [rid for rid, ids in tokens.items() if reference.get(rid, [])[:len(ids)] != ids]
    return {"same_tokens": not differing, "differing_requests": differing}


def worst_class_fields(summary: dict[str, Any]) -> dict[str, Any]:
    """A sweep row's class fairness (chapter 06): the class that met the SLO least often
    (`metrics.worst_class`; "all requests" when the workload holds one class) and its share."""
    if not summary["slo"] or summary["slo_attainment"] is None:  # no SLO: nothing to meet
        return {"worst_class": None, "worst_class_attainment": None}
    name, attained = (worst_class(summary["by_class"])
                      or ("all requests", summary["slo_attainment"]))
    return {"worst_class": name, "worst_class_attainment": attained}


def requirement_failures(row: dict[str, Any], fairness: float | None,
                         min_class_attainment: float | None = None) -> list[str]:
    """The contract's requirements beside the SLO that a sweep row fails; a row failing any is
    never the best (chapter 06): fairness (its oldest request waited longer than
    --max-queue-age), class fairness (a prompt-length bucket, tenant or priority class met the
    SLO for less than --min-class-attainment of its requests), errors (a request failed),
    cancellation (`cancellations_honoured`), quality (`quality_check`; not checked on the
    simulator)."""
    age = row["max_queue_age_s"]
    worst = row.get("worst_class_attainment")
    failed = {"fairness": fairness is not None and (age is None or age > fairness),
              "class fairness": min_class_attainment is not None and (
                  worst is None or worst < min_class_attainment),
              "errors": bool(row["errors"]),
              "cancellation": not row["cancellations_honoured"],
              "quality": row["same_tokens"] is False}
    return [name for name, fails in failed.items() if fails]


def sweep_requirements(fairness: float | None, simulated: bool,
                       min_class_attainment: float | None = None) -> dict[str, str]:
    """What `requirement_failures` holds each setting to, in words, for the declaration
    (chapter 06)."""
    return {"fairness": "none given (--max-queue-age)" if fairness is None else
            f"oldest queue age <= {fairness:g} s",
            "class fairness": "none given (--min-class-attainment)"
            if min_class_attainment is None else
            f"every prompt-length bucket, tenant and priority class meets the SLO for at least "
            f"{min_class_attainment:.0%} of its requests",
            "errors": "no request failed",
            "cancellation": "each cancelled request stopped in the step of its cancel point "
                            "and no request holds KV pages after the run",
            "quality": "not checked (simulated: no model ran, so no real tokens)" if simulated
            else "every request's greedy tokens equal those it gets served alone (policy "
                 "single, no prefix cache); a cancelled or expired one's are a prefix"}


def sustainable_rows(rows: list[dict[str, Any]], target: float) -> list[dict[str, Any]]:
    """Each setting's sustainable load over the swept rates (`metrics.sustainable_load`),
    highest first, ties to the higher goodput at that load (then output tokens/s); a rate at
    which the setting fails a requirement (`fails`) is not sustained (chapter 06)."""
    names = ("max_num_batched_tokens", "max_num_seqs", "chunk_size", "preemption")
    by_setting: dict[tuple, dict[float, dict[str, Any]]] = {}
    for row in rows:
        by_setting.setdefault(tuple(row[n] for n in names), {})[row["rate_rps"]] = row
    found = []
    for key, at_rate in by_setting.items():
        load = sustainable_load({rate: None if row["fails"] else row["slo_attainment"]
                                 for rate, row in at_rate.items()}, target)
        there = at_rate.get(load, {}) if load is not None else {}
        found.append(({**dict(zip(names, key)), "sustainable_load_rps": load,
                       # every swept rate passed: the setting may sustain more than was offered
                       "sustainable_load_is_lower_bound": load is not None
                       and load == max(at_rate)},
                      (-(load or 0.0), -(there.get("goodput_rps") or 0.0),
                       -(there.get("output_tokens_per_s") or 0.0))))
    return [setting for setting, _ in sorted(found, key=lambda pair: pair[1])]


def _sweep_cell(row: dict[str, Any], column: str) -> str:
    """One cell of the printed sweep table (chapter 06)."""
    value = row[column]
    if value is None:
        return _fmt(value)
    if column == "worst_class":
        return f"{value} {100 * row['worst_class_attainment']:.1f}"
    shown = {"slo_attainment": lambda v: f"{100 * v:.0f}", "rate_rps": lambda v: f"{v:g}",
             "fails": lambda v: ",".join(v) or "-"}
    return shown[column](value) if column in shown else _fmt(value)


def main_sweep(argv: list[str] | None = None) -> int:
    """`python -m minicb sweep ...`: returns an exit code (chapter 06)."""
    args = sweep_parser().parse_args(argv)
    args.command_line = _command_line("sweep", argv)
    try:
        data = run_sweep(args)
    except (ValueError, NotImplementedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    columns = ("max_num_batched_tokens", "max_num_seqs", "chunk_size", "preemption",
               "goodput_rps", "requests_per_s", "output_tokens_per_s", "ttft_p99_s",
               "tpot_p99_s", "slo_attainment", "max_queue_age_s", "worst_class", "fails")
    header = ["budget", "seqs", "chunk", "preemption", "goodput", "req/s", "tok/s", "TTFT p99",
              "TPOT p99", "SLO %", "queue age", "worst class SLO %", "fails"]
    if data["sustainable"]:
        columns, header = ("rate_rps", *columns), ["rate", *header]
    lines = [header] + [[_sweep_cell(r, c) for c in columns] for r in data["rows"]]
    widths = [max(len(str(x[i])) for x in lines) for i in range(len(header))]
    sim = " (SIMULATED)" if data["declaration"]["simulated"] else ""
    print(f"\nsweep of {args.policy} on {data['declaration']['workload']['workload']}{sim}, SLO "
          f"{data['declaration']['slo'] or 'none'}")
    for line in lines:
        print("  ".join(str(c).rjust(w) for c, w in zip(line, widths)))
    for item in data["skipped"]:
        print("skipped " + " ".join(f"{k}={v}" for k, v in item["setting"].items())
              + f": {item['reason']}")
    for note in (data["declaration"].get("not_varied"), data["note"]):
        if note:
            print(f"note: {note}")
    best = data["best"]
    print("\nrequirements beside the SLO (a row failing one is not chosen; 'fails' names it):")
    for name, rule in data["declaration"]["requirements"].items():
        print(f"  {name}: {rule}")
    if not data["rows"]:
        print("\nerror: every setting was skipped (the reasons above): none ran",
              file=sys.stderr)
        return 2
    if not best and not data["sustainable"]:
        print("\nno setting meets them all")
    if best and not data["sustainable"] and data["declaration"]["slo"] \
            and not best["goodput_rps"]:
        print("\nno setting met the SLO for a single request (goodput 0 in every row): the "
              "best below is only the fastest; loosen the SLO or lower the rate")
    if best and not data["sustainable"]:
        print(f"\nbest: max_num_batched_tokens={best['max_num_batched_tokens']} "
              f"max_num_seqs={best['max_num_seqs']} chunk_size={best['chunk_size']} "
              f"preemption={best['preemption']} "
              + (f"goodput={_fmt(best['goodput_rps'])} req/s" if data["declaration"]["slo"]
                 else f"completed={_fmt(best['requests_per_s'])} req/s"))
    if data["sustainable"]:
        target = data["declaration"]["slo_target"]
        print(f"\nsustainable load (the highest rate at which at least {target:.0%} of the "
              "requests met the SLO, every lower rate too):")
        for r in data["sustainable"]:
            load = r["sustainable_load_rps"]
            bound = " or more (every swept rate passed: sweep higher rates to find the limit)" \
                if r["sustainable_load_is_lower_bound"] else ""
            print(f"  max_num_batched_tokens={r['max_num_batched_tokens']} "
                  f"max_num_seqs={r['max_num_seqs']} chunk_size={r['chunk_size']} "
                  f"preemption={r['preemption']}: "
                  + (f"{load:g} req/s{bound}" if load is not None
                     else "not even the lowest rate"))
    if args.out:
        print(f"wrote {write_json(data, args.out)}")
    return 0


# ------------------------------------------------------------------------------ profile
def profile_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m minicb profile` (chapter 06)."""
    parser = argparse.ArgumentParser(
        prog="python -m minicb profile",
        description="Run a short real workload on this machine, fit the simulated executor's "
                    "cost model to its steps, and save the coefficients as JSON.")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--num-requests", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", choices=("duration", "forward"), default="duration")
    parser.add_argument("--out", default=str(DEFAULT_CPU_COST_MODEL),
                        help="where the fit goes (default: the file --cost-model cpu reads, "
                             f"{DEFAULT_CPU_COST_MODEL})")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def run_profile(model: str = "smollm2-135m", device: str = "cpu", num_requests: int = 16,
                seed: int = 0, target: str = "duration", progress: bool = True,
                executor: Executor | None = None) -> CostModel:
    """Three short real runs (pd with mixed prefill/decode steps, continuous with whole
    prompts, and continuous with 4x the batch so decode rows span 1 to 32), then a
    least-squares fit of the cost model to every step (chapter 06)."""
    executor = executor or Executor("real", model, device)
    executor.warm_up()
    runs = []
    for policy, budget, prompts, seqs in (("pd", 128, "uniform:16:256", 8),
                                          ("continuous", 512, "uniform:8:192", 8),
                                          ("continuous", 512, "uniform:8:64", 32)):
        workload = make_workload(num_requests * seqs // 8, prompt_lengths=prompts,
                                 output_lengths="uniform:4:32", seed=seed, name="profile")
        options = {"max_num_seqs": seqs, "max_num_batched_tokens": budget, "chunk_size": budget}
        _, engine = run_policy(executor, policy, workload, options, None, progress)
        runs.append((engine.trace, engine.request_records()))
        engine = None
        free_device_memory(device)
    name = f"{executor.describe()['name']} on {platform.node() or 'this machine'} ({device})"
    cost = fit_cost_model_runs(runs, target=target, name=name)
    model, info = executor.pair  # the K/V pages are in the activations' dtype
    cost.s = measure_swap_cost(info.config.num_layers, info.config.num_kv_heads,
                               info.config.head_dim, dtype=model.embed_tokens.weight.dtype,
                               device=device)
    cost.fit["swap"] = ("s: sim.measure_swap_cost, 32 scattered pages out and in, median of 9, "
                        f"{datetime.date.today().isoformat()}")
    cpu = platform.processor() or platform.machine()
    cost.source = (f"fitted by `python -m minicb profile` on {cpu}, {os.cpu_count()} CPUs, "
                   f"torch threads {_threads()}, device {device}, "
                   f"{datetime.date.today().isoformat()}")
    cost.fit["model"] = executor.describe()
    cost.fit["runtime"] = runtime_versions()
    return cost


def _threads() -> int:
    import torch
    return torch.get_num_threads()


def main_profile(argv: list[str] | None = None) -> int:
    """`python -m minicb profile ...`: returns an exit code (chapter 06)."""
    args = profile_parser().parse_args(argv)
    try:
        check_writable(args.out, "--out")
        set_threads(args.threads)
        cost = run_profile(args.model, resolve_device(args.device), args.num_requests,
                           args.seed, args.target, not args.no_progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"cost model ({cost.fit['target']}), fitted on {cost.fit['num_steps']} steps, "
          f"R^2 = {cost.fit['r2']:.3f}, mean |error| = {1e3 * cost.fit['mean_abs_error_s']:.2f} "
          f"ms of a mean step of {1e3 * cost.fit['mean_step_s']:.2f} ms")
    for key in ("a", "b", "c", "d", "e", "s"):
        print(f"  {key} = {getattr(cost, key):.3e}")
    print(f"wrote {cost.save(args.out)}")
    return 0
