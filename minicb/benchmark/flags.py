"""The command-line flags that `bench`, `sweep` and `profile` share (chapter 06): the workload
or trace, the engine options, the SLO, the output path and the threads, each checked before a
model loads."""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from pathlib import Path
from typing import Any

from minicb.benchmark.metrics import (
    check_slo,
    observed_arrivals,
)
from minicb.benchmark.workload import (
    MAX_FIRST_ARRIVAL_S,
    SCENARIOS,
    Workload,
    get_workload,
    load_workload_file,
    make_workload,
    replay_flags,
    save_workload_file,
)
from minicb.cli import add_full_cache_arguments, check_full_cache_flags
from minicb.config import (
    POLICIES,
    PREEMPTIONS,
    QUANTIZATIONS,
    is_finite_number,
)


def parse_policies(values: list[str] | None) -> list[str]:
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


def parse_preemptions(text: str | None) -> list[str]:
    """--preemption: one order, or (sweep) a comma-separated list of them."""
    names = list(dict.fromkeys(n.strip() for n in str(text or "newest").split(",")
                               if n.strip()))
    if not names or any(n not in PREEMPTIONS for n in names):
        raise ValueError(f"--preemption takes {', '.join(PREEMPTIONS)} (sweep: a comma-separated "
                         f"list of them), got {text!r}")
    return names


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag} takes comma-separated positive integers, got {text!r}")
    return list(dict.fromkeys(values))  # a value given twice would run the same setting twice


def rate_list(text: str, flag: str) -> list[float]:
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
    parser.add_argument("--num-pages", type=int, default=None,
                        help="KV pages in the pool (None: the engine's default for the device)")
    parser.add_argument("--page-size", type=int, default=None,
                        help="tokens per KV page (None: the engine's default)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="no prefix index: every prompt is computed in full")
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
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


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
        chosen = parse_preemptions(preemption)
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


def check_max_concurrency(value: int | None) -> None:
    """Refuse a --max-concurrency below 1 before anything runs."""
    if value is not None and value < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {value}")


def command_line(command: str, argv: list[str] | None) -> str:
    import shlex
    argv = sys.argv[1:] if argv is None else argv
    return " ".join(["python -m minicb", command] + [shlex.quote(str(a)) for a in argv])
