"""`python -m minicb profile` (chapter 06): run a short real workload on this machine, fit the
simulated executor's cost model to its steps, and save the coefficients as JSON."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

from minicb.benchmark.flags import check_writable, set_threads
from minicb.benchmark.metrics import request_records
from minicb.benchmark.runs import Executor, free_device_memory, run_policy, runtime_versions
from minicb.benchmark.sim import (
    DEFAULT_CPU_COST_MODEL,
    CostModel,
    fit_cost_model_runs,
    measure_swap_cost,
)
from minicb.benchmark.workload import (
    make_workload,
)
from minicb.cli import parser as make_parser
from minicb.config import (
    resolve_device,
)


def profile_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m minicb profile` (chapter 06)."""
    parser = make_parser(
        "profile",
        "Run a short real workload on this machine, fit the simulated executor's "
                    "cost model to its steps, and save the coefficients as JSON.")
    parser.add_argument("--model", default="smollm2-135m",
                        help="bundled model name or a Hugging Face checkpoint directory")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (None: torch's own choice)")
    parser.add_argument("--num-requests", type=int, default=12,
                        help="requests of the first run (the others scale with their batch)")
    parser.add_argument("--seed", type=int, default=0, help="the workloads' seed")
    parser.add_argument("--target", choices=("duration", "forward"), default="duration",
                        help="what the fit predicts: a whole step's time, or its forward's")
    parser.add_argument("--out", default=str(DEFAULT_CPU_COST_MODEL),
                        help="where the fit goes (default: the file --cost-model cpu reads, "
                             f"{DEFAULT_CPU_COST_MODEL})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
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
        runs.append((engine.trace, request_records(engine)))
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
