"""`python -m minicb sweep` (chapter 06): vary the token budget, max_num_seqs, chunk size and
priority policy (preemption order), optionally the offered rate; report the setting with the
highest goodput, or each setting's sustainable load."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
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
    int_list,
    parse_preemptions,
    rate_list,
    set_threads,
    slo_from_args,
    warmup_workload,
)
from minicb.benchmark.metrics import (
    sustainable_load,
    worst_class,
)
from minicb.benchmark.report import fmt
from minicb.benchmark.runs import (
    NO_SLO_NOTE,
    Executor,
    cancellations_honoured,
    declaration,
    executor_from_args,
    free_device_memory,
    output_tokens,
    progress_bar,
    run_policy,
    write_json,
)
from minicb.benchmark.workload import (
    Workload,
)
from minicb.cli import parser as make_parser
from minicb.config import (
    POLICIES,
    is_finite_number,
    is_positive_int,
    resolve_device,
)

# the batch settings each policy's schedule depends on (what a sweep varies)
POLICY_READS: dict[str, tuple[str, ...]] = {
    "single": (), "static": ("max_num_seqs",), "dynamic": ("max_num_seqs",),
    "continuous": ("max_num_seqs", "max_num_batched_tokens"),
    "chunked": ("max_num_seqs", "max_num_batched_tokens", "chunk_size"),
    "pd": ("max_num_seqs", "max_num_batched_tokens", "chunk_size")}


def sweep_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m minicb sweep` (chapter 06)."""
    parser = make_parser(
        "sweep",
        "Vary the token budget, max_num_seqs, chunk size and priority policy "
                    "(--preemption, a comma list) on a workload; report the setting with the "
                    "highest goodput at the SLO.")
    add_common_arguments(parser)
    parser.add_argument("--policy", default="pd", choices=POLICIES,
                        help="the scheduling policy every setting runs")
    parser.add_argument("--max-num-batched-tokens", default="64,128,256,512",
                        help="token budgets to try, comma-separated")
    parser.add_argument("--max-num-seqs", default="4,8,16",
                        help="batch sizes to try, comma-separated")
    parser.add_argument("--chunk-size", default="64,256",
                        help="prefill chunk sizes to try, comma-separated")
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
    lists = {"max_num_batched_tokens": int_list(args.max_num_batched_tokens,
                                                 "--max-num-batched-tokens"),
             "max_num_seqs": int_list(args.max_num_seqs, "--max-num-seqs"),
             "chunk_size": int_list(args.chunk_size, "--chunk-size")}
    # a setting the policy does not read runs at its first value: varying it would run the
    # same schedule again and rank copies of one row
    lists = {name: values if name in reads else values[:1] for name, values in lists.items()}
    budgets, seqs, chunks = (lists[k] for k in ("max_num_batched_tokens", "max_num_seqs",
                                                "chunk_size"))
    preemptions = parse_preemptions(args.preemption)
    aging = args.priority_aging_steps
    if aging is not None and not is_positive_int(aging):  # or every priority row is skipped
        raise ValueError(f"--priority-aging-steps must be a positive integer, got {aging!r}")
    if aging is not None and "priority" not in preemptions:
        raise ValueError("--priority-aging-steps ages priorities: it needs priority among "
                         "--preemption")
    rates = rate_list(args.rates, "--rates") if getattr(args, "rates", None) else [None]
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
    bar = progress_bar(not args.no_progress, len(grid), "sweep")
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
    """The batch settings `policy`'s schedule depends on (`POLICY_READS`; speculative
    decoding's guesses take the token budget the policy left, so with it every policy reads
    max_num_batched_tokens), chapter 06."""
    reads = POLICY_READS[policy]
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
        return fmt(value)
    if column == "worst_class":
        return f"{value} {100 * row['worst_class_attainment']:.1f}"
    shown = {"slo_attainment": lambda v: f"{100 * v:.0f}", "rate_rps": lambda v: f"{v:g}",
             "fails": lambda v: ",".join(v) or "-"}
    return shown[column](value) if column in shown else fmt(value)


def main_sweep(argv: list[str] | None = None) -> int:
    """`python -m minicb sweep ...`: returns an exit code (chapter 06)."""
    args = sweep_parser().parse_args(argv)
    args.command_line = command_line("sweep", argv)
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
              + (f"goodput={fmt(best['goodput_rps'])} req/s" if data["declaration"]["slo"]
                 else f"completed={fmt(best['requests_per_s'])} req/s"))
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
