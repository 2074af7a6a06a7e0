"""How `bench` prints a result (chapter 06): the declaration in a few lines, the table, the
extras of each policy, the per-class fairness, the greedy-token check, and a figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minicb.benchmark.metrics import (
    LATENCY_COLUMNS,
    TABLE_COLUMNS,
    format_table,
    lookup,
)
from minicb.benchmark.runs import NO_SLO_NOTE


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
        parts.append(f"token throughput {fmt(summary['total_tokens_per_s'])} tok/s = prompts "
                     f"{fmt(summary['prompt_tokens_per_s'])} + outputs "
                     f"{fmt(summary['output_tokens_per_s'])}")
    if summary.get("num_steps"):  # what the steps processed (transformers' runs have none)
        parts.append(f"tokens: {summary['prefill_tokens']} prefill + "
                     f"{summary['decode_tokens']} decode, "
                     f"{summary['mean_tokens_per_step']:.1f}/step, "
                     f"mixed steps {summary['mixed_steps']} "
                     f"({summary['mixed_step_share']:.0%})")
    if summary.get("dec_at_p") is not None:
        parts.append(f"dec@P={summary['dec_at_p']} tokens")
        parts.append(f"short_P={summary['short_p_steps']} steps / "
                     f"{fmt(summary['short_p_s'])} s")
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
        parts.append(f"oldest queue age={fmt(summary['max_queue_age_s'])} s")
    single = summary.get("single_stream")
    if single:
        parts.append(f"batch-1 decode {fmt(single['decode_tokens_per_s'])} tok/s, prefill "
                     f"{fmt(single['prefill_tokens_per_s'])} tok/s")
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
                         f"{fmt(row['ttft_p50_s']):>7} {fmt(row['ttft_p99_s']):>7} "
                         f"{fmt(row['e2e_p99_s']):>7}"
                         + (f" {row['slo_attainment']:>5.0%}" if slo else ""))
    return lines


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


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
            print(f"  hf generate batch-1: decode {fmt(hf1['decode_tokens_per_s'])} tok/s, "
                  f"prefill {fmt(hf1['prefill_tokens_per_s'])} tok/s")
        if hf1 and own and hf1["decode_tokens_per_s"] and own["decode_tokens_per_s"]:
            ratio = own["decode_tokens_per_s"] / hf1["decode_tokens_per_s"]
            print(f"  batch-1 decode: minicb ({weights_label(decl)} weights) / hf generate "
                  f"(its float weights) = {ratio:.2f}x")
    print("\nlatency percentiles (s)")
    print(format_table(ok, LATENCY_COLUMNS))
