"""Running workloads for the benchmark (chapter 06): the executor (real weights loaded once, or
the simulated model), one policy's run on a fresh engine, the greedy-token quality check, the
declaration the benchmark contract asks for, and the results file.

Every result file starts with that declaration (arrival process, burstiness, concurrency,
length distributions, cache state, policy, token budget, memory limit, model, runtime versions,
device and CPU count), and says plainly whether the numbers were measured or simulated."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from minicb.attention import resolve_backend
from minicb.benchmark.metrics import (
    PERCENTILE_METHOD,
    request_records,
    resource_use,
    summarize,
)
from minicb.benchmark.sim import CostModel, make_sim_engine
from minicb.benchmark.workload import (
    Workload,
    run_workload,
)
from minicb.config import (
    cpuinfo,
    torch_dtype,
)

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
            return make_sim_engine(self.cost, **options)
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
    summary = summarize(engine.trace, request_records(engine), slo,
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


def progress_bar(progress: bool, total: int, desc: str) -> Any:
    """A tqdm bar on stderr, or None without `progress`."""
    if not progress:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=f"{desc:>10}", unit="req", leave=False, file=sys.stderr)
