"""`python -m minicb bench` (chapter 06): one workload, one or several policies side by side on
the same requests, optionally beside Hugging Face transformers (`generate` in static batches,
`generate_batch`). The model is loaded once and shared by every policy. A running server is
measured by `python -m minicb bench serve` (`minicb.benchmark.serve`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from minicb.benchmark.flags import (
    add_common_arguments,
    build_workload,
    check_max_concurrency,
    check_wall_clock_span,
    check_writable,
    command_line,
    engine_options,
    parse_policies,
    saved_workload_line,
    set_threads,
    slo_from_args,
    warmup_workload,
)
from minicb.benchmark.hf import hf_generate_batch, hf_model, hf_single_stream, hf_static
from minicb.benchmark.report import plot_results, print_report
from minicb.benchmark.runs import (
    SIMULATED_NOTE,
    declaration,
    executor_from_args,
    finished_ids,
    free_device_memory,
    measure_single_stream,
    output_tokens,
    run_policy,
    same_tokens,
    without_slo,
    write_json,
)
from minicb.cli import parser as make_parser
from minicb.config import (
    EngineConfig,
    resolve_device,
)


def bench_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m minicb bench` (chapter 06)."""
    parser = make_parser(
        "bench",
        "Run one workload under one or several policies (and optionally Hugging "
                    "Face transformers) and report the benchmark contract's metrics.")
    add_common_arguments(parser)
    parser.add_argument("--policy", action="append", default=None,
                        help="policy or comma-separated policies; repeatable (default pd)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="requests in the running batch at most (None: the workload's "
                             "recommendation, else the engine's default)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the token budget of a step (None: the workload's "
                             "recommendation, else the engine's default)")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="chunked and pd: the largest prefill chunk (None: the "
                             "workload's recommendation, else the policy's)")
    parser.add_argument("--min-chunk", type=int, default=None,
                        help="pd: the smallest prefill chunk worth a step (chapter 05)")
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
    policies = parse_policies(args.policy)
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
        hf = hf_model(executor.pair[1].path, device, hf_dtype)
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
    """`python -m minicb bench ...`, or `bench serve ...` (`minicb.benchmark.serve`): returns an
    exit code (chapter 06)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        from minicb.benchmark.serve import main_serve
        return main_serve(argv[1:])
    parser = bench_parser()
    args = parser.parse_args(argv)
    args.command_line = command_line("bench", argv)
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
