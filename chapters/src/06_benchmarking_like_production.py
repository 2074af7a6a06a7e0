# %% [markdown]
# # 06 · Benchmarking like production
#
# Chapters 02–05 compared schedulers on hand-made scenarios counted in steps. A serving team
# asks different questions: under *our* traffic, how long do users wait for the first token,
# how smooth is the stream, how many requests meet the SLO, and what happens when memory runs
# out? The second seed text is a **基准契约, benchmark contract** for continuous batching. This
# chapter follows it item by item.
#
# **After this chapter you will be able to**
#
# - generate arrivals all at once, as a Poisson process, or bursty (gamma gaps with a
#   burstiness factor), and say why the burstiness changes the result;
# - compute p50/p95/p99 of queue time, TTFT, ITL, TPOT and end-to-end latency, and goodput
#   at an SLO, by hand and with `minicb.benchmark.metrics`;
# - explain what the engine does when the KV cache is full (抢占 preemption and recompute, or
#   swap, reserve, reject) and count what it costs (preemptions, discarded and recomputed
#   tokens, evicted prefix pages, swapped pages, rejections) and who pays it, and bound it per
#   request (`max_preemptions`); show cancellation returning pages at once;
# - measure fairness per prompt-length bucket, show priority scheduling starving (饥饿
#   starvation) a low-priority request, measured as its queue age, and bound it with aging;
# - sweep the token budget and the slot count and pick the setting with the highest goodput
#   within a fairness limit, on the simulated executor, and compare static, continuous and PD
#   batching on one declared workload, checking that they give the same answers;
# - replay a recorded trace from the command line (`--workload-file`) and sweep the priority
#   policy there too.
#
# The rule that opens the contract's 基准契约 (benchmark contract) section governs everything
# below: a result must declare the arrival process, burstiness, concurrency, prompt and output
# length distributions, cache state, scheduler policy, token budget, memory limit, model, runtime
# and hardware. A number without its declaration is not a result.

# %%
# NBVAL_IGNORE_OUTPUT
%matplotlib inline
import time

import matplotlib.pyplot as plt
import numpy as np

from minicb.benchmark import metrics
from minicb.course import viz
from minicb.engine import Engine
from minicb.model.loader import load_model
from minicb.benchmark.sim import make_sim_engine
from minicb.benchmark.workload import Workload, WorkloadRequest, arrival_times, make_workload, run_workload

model = load_model("smollm2-135m")  # (weights, info), loaded once and shared by every engine
viz.use_course_style()  # projector-sized fonts for this chapter's own plots too

# %% [markdown]
# ## 1. Arrival processes and burstiness
#
# Three ways requests can arrive (`minicb.benchmark.workload.arrival_times`):
#
# - **all at once**: an offline batch; every request is in the queue at time 0;
# - **Poisson** at `rate` requests/s: independent users, exponential gaps with mean 1/rate;
# - **gamma** gaps with the same mean and a `burstiness` factor (the gamma shape): 1 is Poisson,
#   below 1 is burstier (clumps of near-simultaneous requests separated by lulls), above 1 is
#   more regular. The coefficient of variation of the gaps is 1/√burstiness.

# %%
# NBVAL_CHECK_OUTPUT
rate = 10.0
processes = {"poisson": ("poisson", 1.0), "gamma, burstiness 0.25": ("gamma", 0.25),
             "gamma, burstiness 4": ("gamma", 4.0)}
arrivals = {}
for name, (process, burstiness) in processes.items():
    times = np.array(arrival_times(2000, process, rate=rate, burstiness=burstiness,
                                   rng=np.random.default_rng(0)))
    arrivals[name] = times
    gaps = np.diff(times)
    print(f"{name:<24} mean gap {gaps.mean():.3f}  CV {gaps.std() / gaps.mean():.2f}  "
          f"busiest second: {np.bincount(times.astype(int)).max()} arrivals (mean {rate:.0f})")

# %%
fig, axes = plt.subplots(2, 3, figsize=(13, 6), layout="constrained",
                         gridspec_kw={"height_ratios": [2, 1]})
for (name, times), ax, ax2 in zip(arrivals.items(), axes[0], axes[1]):
    ax.hist(np.diff(times), bins=np.linspace(0, 0.5, 51), color=viz.OKABE_ITO[4])
    ax.set_title(name)
    ax.set_xlabel("gap between arrivals (s)")
    ax2.eventplot(times[times < 10], lineoffsets=0, linelengths=0.8, color="black")
    ax2.set_xlim(0, 10)
    ax2.set_yticks([])
    ax2.set_xlabel("arrival time, first 10 s")
axes[0, 0].set_ylabel("count")
fig.suptitle(f"the same mean rate ({rate:.0f} requests/s), three arrival processes");

# %% [markdown]
# The same mean rate (the bursty sample's mean gap, 0.092 s, is sampling noise around 0.1 s),
# a different shape. Bursty traffic (burstiness 0.25) has many near-zero gaps: a dozen
# requests land almost together, the queue jumps, and the prompts of all of them want prefill at
# once. A benchmark that sends requests all at once, or at perfectly even intervals, hides that.
# The contract asks for the arrival process and its burstiness in every declaration.
#
# ## 2. Percentiles of queue, TTFT, ITL, TPOT and E2E
#
# Per request (the definitions are in `minicb/benchmark/metrics.py`):
#
# | metric | definition |
# |---|---|
# | queue time | first scheduled − arrival |
# | TTFT, time to first token | first token seen − arrival: when it was computed, for a response that streams; the release, for one a static batch returns whole (its user sees no token before then) |
# | ITL, inter-token latency | the gap between two consecutive deliveries of tokens (pooled over all requests; tokens that arrive together make one gap, as when a step keeps several guessed tokens, chapter 08) |
# | TPOT, time per output token | (finish − first token) / (output tokens − 1) |
# | E2E, end-to-end latency | release − arrival: the release is the finish, except in a static batch, which returns its responses together when its last member finishes (chapter 02) |
#
# A mean hides the users who waited longest, so the contract asks for p50, p95 and p99.
#
# Eight requests on the real model, all at once: prompts of 16–96 tokens, outputs of 8–32,
# `max_num_seqs=4` so half of them queue. We run static batching, continuous batching and PD
# interleaving on exactly the same requests.

# %%
# NBVAL_CHECK_OUTPUT
small = make_workload(8, prompt_lengths="uniform:16:96", output_lengths="uniform:8:32",
                      seed=0, name="small-mixed")
options = dict(max_num_seqs=4, max_num_batched_tokens=256, chunk_size=256)
print([(r.request_id, r.prompt_len, r.max_tokens) for r in small])

# %%
# NBVAL_IGNORE_OUTPUT
runs, wall = {}, {}
for policy in ("static", "continuous", "pd"):
    runs[policy] = Engine(model, policy=policy, **options)
    t0 = time.perf_counter()
    run_workload(runs[policy], small)
    wall[policy] = time.perf_counter() - t0
    print(f"{policy:<10} {len(runs[policy].trace)} steps in {wall[policy]:.1f} s")

# %% [markdown]
# The per-request view of the PD run, in seconds, first:

# %%
# NBVAL_IGNORE_OUTPUT
pd = runs["pd"]
records = pd.request_records()
print(f"{'request':<7}{'prompt':>7}{'out':>5}{'queue':>8}{'TTFT':>8}{'TPOT':>8}{'E2E':>8}")
for row in metrics.per_request(records):
    print(f"{row['request_id']:<7}{row['prompt_tokens']:>7}{row['output_tokens']:>5}"
          f"{row['queue_s']:>8.3f}{row['ttft_s']:>8.3f}{row['tpot_s']:>8.4f}{row['e2e_s']:>8.3f}")

# %% [markdown]
# Percentiles by hand with numpy (linear interpolation between the two nearest ranks, numpy's
# default; with 8 requests p99 is almost the maximum), then `minicb.benchmark.metrics.summarize`, which
# computes every number of the contract from the trace and the request records:

# %%
# NBVAL_IGNORE_OUTPUT
def by_hand(records):
    ttft = [r.first_token_time - r.arrival_time for r in records]
    e2e = [r.finish_time - r.arrival_time for r in records]
    queue = [r.first_scheduled_time - r.arrival_time for r in records]
    tpot = [(e - t) / (r.num_output_tokens - 1) for r, t, e in zip(records, ttft, e2e)]
    itl = [b - a for r in records for a, b in zip(r.token_times, r.token_times[1:])]
    return {name: np.percentile(values, [50, 95, 99]) for name, values in
            (("queue_s", queue), ("ttft_s", ttft), ("itl_s", itl), ("tpot_s", tpot),
             ("e2e_s", e2e))}


mine = by_hand(records)
summary = metrics.summarize(pd.trace, records)
for name, values in mine.items():
    print(f"{name:<7} p50 {values[0]:.4f}  p95 {values[1]:.4f}  p99 {values[2]:.4f}")

# %%
# NBVAL_CHECK_OUTPUT
print("by hand == minicb.benchmark.metrics.summarize:",
      all(np.allclose(mine[k], [summary[k][p] for p in ("p50", "p95", "p99")]) for k in mine))
print("percentile method:", summary["percentile_method"])

# %% [markdown]
# ## 3. Static vs continuous vs PD, declared
#
# The contract: "必须在相同负载和质量下与 Static 或请求级 Dynamic Batching 对比" (compare against
# static or request-level dynamic batching under the same load and the same quality). Same
# requests, same greedy outputs, three policies. First the declaration, then the counts in steps
# (exact on any machine), then the seconds (this machine, this run).

# %%
# NBVAL_IGNORE_OUTPUT
from minicb.benchmark.runs import device_description, runtime_versions

declaration = {
    "workload": small.declaration,
    "concurrency": f"all requests sent at t=0, max_num_seqs={options['max_num_seqs']}",
    "cache_state": "cold: a fresh engine (empty page pool, empty prefix index) per policy",
    "policy": list(runs),
    "token_budget": {k: options[k] for k in ("max_num_batched_tokens", "chunk_size")},
    "memory_limit": f"{pd.pool.num_pages} pages x {pd.pool.page_size} tokens",
    "model": f"{model[1].name}, {model[1].config.num_layers} layers, "
             f"{next(model[0].parameters()).dtype}",
    "sampling": "greedy, ignore_eos, fixed max_tokens (output lengths exact)",
    "runtime": runtime_versions(),
    "hardware": device_description("cpu"),
    "executor": "real (measured, not simulated)",
}
for key, value in declaration.items():
    print(f"{key:>13}: {value}")

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'policy':<11}{'steps':>6}{'tok/step':>9}{'batch':>6}{'dead':>6}"
      f"{'TTFT p50':>9}{'TTFT p99':>9}{'E2E p50':>8}{'E2E p99':>8}{'mixed':>7}"
      "   (latencies in steps)")
for policy, engine in runs.items():
    s = metrics.summarize(engine.trace, engine.request_records())
    print(f"{policy:<11}{s['num_steps']:>6}{s['output_tokens_per_step']:>9.2f}"
          f"{s['mean_batch_size']:>6.2f}{s['dead_slot_steps']:>6}"
          f"{s['ttft_steps']['p50']:>9.1f}{s['ttft_steps']['p99']:>9.1f}"
          f"{s['e2e_steps']['p50']:>8.1f}{s['e2e_steps']['p99']:>8.1f}"
          f"{s['decode_share_in_mixed_steps']:>7.0%}")

# %% [markdown]
# "Same quality" is a claim to check, not to assume: under greedy sampling batching must not
# change a single token (the engine's first rule), so every policy's answers must equal static
# batching's, request by request. `python -m minicb bench` makes the same check after every
# real run and prints it under its table:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.benchmark.runs import output_tokens, same_tokens

reference = output_tokens(runs["static"])
for policy, engine in list(runs.items())[1:]:
    check = same_tokens(reference, output_tokens(engine), "static")
    print(f"{policy:<11} greedy tokens differ from static's on "
          f"{len(check['differing_requests'])} of {check['requests']} requests")

# %% [markdown]
# (`mixed`: the share of decode tokens computed in a step that also ran a prefill, from
# `metrics.token_mix`, which `summarize` includes: the contract asks that the kinds and counts of
# tokens each iteration processed be measured, "实际处理的 Token 类型和数量必须测量".) The seconds,
# with a goodput at an SLO sized for this 2-core machine (TTFT ≤ 1 s, end to end ≤ 2 s; goodput
# is only meaningful with the SLO declared next to it):

# %%
# NBVAL_IGNORE_OUTPUT
cpu_slo = {"ttft": 1.0, "e2e": 2.0}
table = {policy: metrics.summarize(engine.trace, engine.request_records(), slo=cpu_slo)
         for policy, engine in runs.items()}
print(f"SLO {cpu_slo} (seconds)")
print(metrics.format_table(table))
print("SLO attainment:", {p: f"{s['slo_attainment']:.1%}" for p, s in table.items()})
itl_p99 = {p: s["itl_s"]["p99"] for p, s in table.items()}
print("ITL p99 against static's:", {p: f"{v / itl_p99['static']:.1f}x" for p, v in itl_p99.items()
                                    if p != "static"})

# %% [markdown]
# Read the step table first, since it is exact. Static batching holds finished members' slots
# (the `dead` column), so it needs the most steps and its second batch starts late: the
# queued requests' TTFT and E2E grow. Both grow again because a static batch returns whole: a
# short member's answer waits for the batch's slowest (chapter 02), and its user sees no token
# before then, so under static batching a request's TTFT *is* its E2E. (Its tokens were
# computed early, but computing a token is not serving it; only a response that streams shows
# its first token when it is computed.) Continuous and PD refill a
# slot in the step after it frees, with fuller batches and fewer steps. Between continuous and PD there
# is no difference in steps here: these prompts are short, so no prefill is long enough to stall
# anybody (chapter 05 showed where PD matters), and any gap between their rows in seconds is the
# machine's noise. The seconds table moves with the load on the machine, so compare rows of one
# run, never numbers across runs.
#
# One column can go the other way: **ITL p99, higher under continuous batching than under
# static**. A continuous batch admits a new prompt into a step where others decode; that step
# carries a prefill and runs longer, and every decode in it waits that long for its token. A
# static batch prefills once and then runs only decode steps: the step table's `mixed` column
# counts it exactly. No decode token of static batching shares its step with a prefill; 6% of
# continuous batching's and PD's do (the same schedule here: no prompt is long enough for PD's
# budget to change anything). 6% is more than 1%, so ITL's 99th percentile is one of those
# longer gaps. How much longer depends on how much a prompt of at most 256 tokens adds to a step
# against the machine's noise: the ratio printed last above has ranged from 0.9x to 2.5x across
# builds of this notebook. Chapter 05 showed the effect plainly, with one long prompt. (ITL times the engine producing tokens. A static batch's user receives them
# all at once, at the release; its short gaps would reach a client only if it streamed, and
# then its TTFT would be the first token's computation.) The contract's FAQ says as much: "连续批处理一定会降低延迟吗？不会……过度准入或长 Prefill
# 可能增加 Queue Time、TTFT 和 ITL" (does continuous batching always lower latency? No:
# over-admission or long prefills can raise queue time, TTFT and ITL). Continuous batching wins
# on TTFT p50 and E2E p50 here, and on goodput whenever the machine is quick enough for any
# request to meet this SLO (static batching meets it for none of the requests: its users see no
# token before their batch returns), and pays in the inter-token tail; the slowest requests
# finish at about the same step under every policy (E2E p99 in the step table), because the
# longest answers set it. Chunking the prefills (chapter 04) and PD's budget (chapter 05) are
# how engines bound the price in the tail.
#
# On this machine the effect is small and noisy. With longer prompts it is neither, and the
# simulator (section 4 introduces it: the real engine and scheduler, each step's time from a
# cost model) counts it exactly: 200 requests in bursts (gamma arrivals, burstiness 0.5, 8
# requests/s), prompts of 16 to 3,000 tokens, 32 slots:

# %%
# NBVAL_CHECK_OUTPUT
bursty = make_workload(200, prompt_lengths="uniform:16:3000", output_lengths="uniform:16:256",
                       arrival="gamma", rate=8, burstiness=0.5, seed=0, name="bursty-long")
print(f"{'policy':<24}{'queue p99':>10}{'TTFT p50':>9}{'TTFT p99':>9}{'ITL p50':>8}"
      f"{'ITL p99':>8}{'max ITL p99':>12}  (ms, simulated)")
for policy, budget in (("static", {}), ("continuous", {}),
                       ("pd", {"max_num_batched_tokens": 512, "chunk_size": 512})):
    e = make_sim_engine("h100-like", policy=policy, max_num_seqs=32, num_pages=20000, **budget)
    run_workload(e, bursty)
    s = metrics.summarize(e.trace, e.request_records())
    ms = [1000 * v for v in (s["queue_s"]["p99"], s["ttft_s"]["p50"], s["ttft_s"]["p99"],
                             s["itl_s"]["p50"], s["itl_s"]["p99"], s["max_itl_s"]["p99"])]
    print(f"{policy + (' (budget 512)' if budget else ''):<24}{ms[0]:>10.0f}{ms[1]:>9.0f}"
          f"{ms[2]:>9.0f}{ms[3]:>8.1f}{ms[4]:>8.1f}{ms[5]:>12.0f}")

# %% [markdown]
# Continuous batching cuts TTFT p99 from seconds to a few hundred milliseconds, and multiplies
# ITL p99 by ten: a step that prefills a whole 3,000-token prompt holds every decode in it.
# PD keeps most of the first gain and gives back most of the second (a 512-token budget per
# step): ITL p99 23 ms, TTFT p99 522 ms against continuous batching's 333, since a long prompt
# now takes several steps.
# Over-admission is the contract's other cause, and section 5 below shows it: a pool that admits
# more than it can hold to the end pays in preemptions, lost work and a queue wait in the middle
# of a stream.
#
# **Cache state** is in the declaration because it changes the results. Every run here starts
# cold. `python -m minicb bench --cache-state warm` first serves the same traffic with another
# seed, so shared system prompts are already cached when the measured run begins: on the
# `shared-prefix` workload (32 requests behind one 256-token system prompt) that lowered TTFT
# p50 by 28–33% on the course machine, although it saved only 512 prompt tokens of work
# (`bench/README.md`). Two honest benchmarks of the same engine can differ that much if one
# does not say which state it ran in. The same comparison on the simulated executor (section 4
# introduces it: the real engine, scheduler and prefix cache, with a cost model for the
# step's time), warming the cache the way `bench` does (`warm_prefix_cache`):

# %%
# NBVAL_CHECK_OUTPUT
from minicb.benchmark.runs import warm_prefix_cache
from minicb.benchmark.workload import shared_prefix

for state in ("cold", "warm"):
    e = make_sim_engine("h100-like", policy="pd", max_num_seqs=32, num_pages=4000,
                        max_num_batched_tokens=512, chunk_size=512)
    if state == "warm":
        warm_prefix_cache(e, shared_prefix(32, seed=1))  # same system prompt, other questions
    run_workload(e, shared_prefix(32, seed=0))
    s = metrics.summarize(e.trace, e.request_records())
    print(f"{state}: cached prompt tokens {s['cached_prompt_tokens']:>5}, TTFT p50 "
          f"{s['ttft_s']['p50'] * 1000:4.0f} ms, p99 {s['ttft_s']['p99'] * 1000:4.0f} ms  (simulated)")

# %% [markdown]
# ## 4. Goodput at an SLO
#
# Throughput counts every token. Users only count the requests that were fast enough. The
# contract asks for **goodput**: completed requests per second that meet the
# service-level objective (SLO), here TTFT ≤ 0.5 s and TPOT ≤ 25 ms.
#
# To see goodput move we need many requests at several rates, so from here on this chapter uses
# the **simulated executor** (`minicb.benchmark.sim`): the real engine, scheduler, page pool and trace,
# with a fake model whose step time comes from a cost model instead of computation. The
# `h100-like` cost model is an **assumption** (a Llama-3-8B-class model in bf16 on one H100, from
# published peak figures), not a measurement; every number it produces is **simulated**.

# %%
# NBVAL_CHECK_OUTPUT
from minicb.benchmark.sim import CostModel

cost = CostModel.load("h100-like")
print(cost.source)
print(f"step time = {cost.a * 1e3:.1f} ms + {cost.b * 1e6:.0f} us per prefill token "
      f"+ {cost.c * 1e6:.0f} us per decode row + KV reads + attention")

# %% [markdown]
# 200 requests with Poisson arrivals at 20 requests/s; prompts lognormal around 512 tokens (a
# tail to 6,000), outputs 16–256 tokens; PD interleaving with a 512-token budget. Goodput by
# hand: the completed requests meeting both limits, divided by the run's span from the first
# arrival to the last finish.

# %%
# NBVAL_CHECK_OUTPUT
SLO = {"ttft": 0.5, "tpot": 0.025}


def traffic(rate, n=200, burstiness=1.0, seed=2):
    return make_workload(n, prompt_lengths="lognormal:512:1.0:16:6000",
                         output_lengths="uniform:16:256",
                         arrival="poisson" if burstiness == 1.0 else "gamma",
                         rate=rate, burstiness=burstiness, seed=seed)


_runs = {}


def simulate(rate, burstiness=1.0, budget=512):
    """PD on the simulated executor; each setting is run once and remembered."""
    key = (rate, burstiness, budget)
    if key not in _runs:
        engine = make_sim_engine("h100-like", policy="pd", max_num_seqs=64, num_pages=40000,
                                 max_num_batched_tokens=budget, chunk_size=budget)
        run_workload(engine, traffic(rate, burstiness=burstiness))
        _runs[key] = engine
    return _runs[key]


sim = simulate(20)
recs = sim.request_records()
good = [r for r in recs if metrics.ttft(r) <= SLO["ttft"] and metrics.tpot(r) <= SLO["tpot"]]
span = max(r.finish_time for r in recs) - min(r.arrival_time for r in recs)
s = metrics.summarize(sim.trace, recs, slo=SLO)
print(f"SIMULATED: {len(good)} of {len(recs)} requests meet the SLO; span {span:.2f} s")
print(f"goodput by hand {len(good) / span:.2f} req/s, summarize {s['goodput_rps']:.2f} req/s, "
      f"throughput {s['requests_per_s']:.2f} req/s")

# %% [markdown]
# Now raise the rate. Throughput keeps rising until the engine saturates; goodput follows it,
# then falls off a cliff: once the queue grows, TTFT passes 0.5 s for more and more requests.
# A rate is what the arrivals are drawn *from*; 200 draws come out a little off it. The `sent`
# column is what each sample delivers (199 gaps over the first-to-last span, the workload's
# `declaration["observed"]`): these 200 come 14% faster than the rate asked for, the same
# 200 gaps scaled at every rate.

# %%
# NBVAL_CHECK_OUTPUT
rates = [10, 15, 20, 25, 30]
curve = {}
sent_rate = {r: traffic(r).declaration["observed"]["rate_rps"] for r in rates}
print(f"{'rate':>5}{'sent':>7}{'throughput':>11}{'goodput':>9}{'SLO met':>8}{'TTFT p99':>9}"
      "  (simulated)")
for r in rates:
    e = simulate(r)
    s = metrics.summarize(e.trace, e.request_records(), slo=SLO)
    curve[r] = s
    print(f"{r:>5}{sent_rate[r]:>7.1f}{s['requests_per_s']:>11.2f}{s['goodput_rps']:>9.2f}"
          f"{s['slo_attainment']:>8.1%}{s['ttft_s']['p99']:>9.3f}")

# %%
fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
ax.plot(rates, [curve[r]["requests_per_s"] for r in rates], "o-", label="throughput",
        color=viz.OKABE_ITO[4], lw=2.5)
ax.plot(rates, [curve[r]["goodput_rps"] for r in rates], "s-", label="goodput (TTFT ≤ 0.5 s, "
        "TPOT ≤ 25 ms)", color=viz.OKABE_ITO[5], lw=2.5)
ax.plot(rates, [sent_rate[r] for r in rates], ":", color="grey", label="sent (the arrivals drawn)")
ax.set_xlabel("arrival rate (requests/s)")
ax.set_ylabel("requests/s")
ax.set_title("SIMULATED (h100-like cost model): throughput vs goodput")
ax.legend();

# %% [markdown]
# Throughput tops out near 20 requests/s in these 200-request runs (a short run's span includes
# its ramp-up and its drain; the 10,000-request run below delivers 19.6 at 20 offered). Goodput
# follows it up to 20 requests/s offered, then
# collapses: at 30 requests/s the engine still completes 19.9 requests/s, but only 5.5 of them
# within the SLO, because the queue grows and TTFT passes 0.5 s for most requests. The useful
# capacity of this configuration looks like about 20 requests/s, and past it more load only buys
# longer queues. (Looks like: the next two parts test that number and find it too high.) The contract's warning, "只提升聚合 TPS 却破坏交互 SLO，不是生产收益" (raising
# aggregate TPS while breaking the interactive SLO is not a production gain), is this picture.
#
# The contract adds: "必须按真实工作负载评测，不能只看隔离的最大 Batch Size" (evaluate on the real
# workload, never only by the largest batch size in isolation). The isolated number is tempting:
# fill all 64 slots with decodes of the workload's typical context, time one step, divide. The
# same cost model, both ways:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.benchmark.sim import CostModel

typical = traffic(20)
context = round(np.mean([r.prompt_len for r in typical])  # halfway through an answer
                + np.mean([r.max_tokens for r in typical]) / 2)
step = CostModel.load("h100-like").predict(prefill_tokens=0, decode_rows=64,
                                           context_tokens=64 * context)
isolated = 64 / step
print(f"64 decodes of {context} tokens of context, in isolation: {step * 1000:.1f} ms a step, "
      f"{isolated:,.0f} output tokens/s (simulated)")
for r in (20, 30):
    s = curve[r]
    print(f"the workload at {r} req/s: {s['output_tokens_per_s']:,.0f} output tokens/s "
          f"({s['output_tokens_per_s'] / isolated:.0%} of that), mean batch "
          f"{s['mean_batch_size']:.1f} of 64 (simulated)")

# %% [markdown]
# Even saturated, the engine delivers well under half the isolated figure: arrivals are bursty
# and answers end, so batches rarely hold all 64 requests; every step spends part of its time on
# prefill chunks; and a batch is only as full as the queue behind it. A server sized by the
# isolated number would be overbooked about two and a half times.
#
# Burstiness moves the cliff. The same 200 requests at the same mean rate of 20 requests/s,
# only their arrival times drawn smoother (burstiness 4) or burstier (0.25, section 1):

# %%
# NBVAL_CHECK_OUTPUT
for burstiness in (4.0, 1.0, 0.25):
    e = simulate(20, burstiness=burstiness)
    s = metrics.summarize(e.trace, e.request_records(), slo=SLO)
    print(f"burstiness {burstiness:<5} goodput {s['goodput_rps']:6.2f} req/s, SLO met "
          f"{s['slo_attainment']:6.1%}, TTFT p99 {s['ttft_s']['p99']:.3f} s, queue p99 "
          f"{s['queue_s']['p99']:.3f} s   (simulated)")

# %% [markdown]
# Smoother arrivals change little at this rate; bursty ones cost more than a quarter of the
# goodput (18.7 to 13.6 requests/s), and one request in 13 misses the SLO: the same requests,
# the same mean rate, only arriving in clumps. (A workload's seed fixes its requests whatever
# their arrival process: `make_workload` draws arrival times from a stream of their own.)
#
# ### How long must a run be?
#
# Every run above is 200 requests: at 20 requests/s, ten seconds of traffic. That is enough to
# see the shape of the curve, but is it enough to trust the number at 20 requests/s, which sits
# right at the capacity we just read off? A queue that grows slowly needs time to show. The
# simulated executor makes the long run cheap: 10,000 requests, about eight minutes of
# simulated traffic, with the same scheduler and page pool. `trace_snapshots=False` keeps only
# what metrics need in each step record (no copies of the waiting queue and page tables), as
# `python -m minicb bench` does.

# %%
# NBVAL_IGNORE_OUTPUT
t0 = time.perf_counter()
long_run = make_sim_engine("h100-like", policy="pd", max_num_seqs=64, num_pages=40000,
                           max_num_batched_tokens=512, chunk_size=512, trace_snapshots=False)
run_workload(long_run, traffic(20, n=10_000))
print(f"10,000 simulated requests, {len(long_run.trace):,} steps, in "
      f"{time.perf_counter() - t0:.1f} s of wall time")

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'requests':>9}{'sent':>6}{'span (s)':>10}{'throughput':>11}{'goodput':>9}{'SLO met':>8}"
      f"{'TTFT p99':>9}{'queue p99':>10}  (simulated, drawn at 20 req/s)")
for e in (simulate(20), long_run):
    recs = e.request_records()
    s = metrics.summarize(e.trace, recs, slo=SLO)
    arrived = metrics.observed_arrivals([r.arrival_time for r in recs])["rate_rps"]
    print(f"{len(recs):>9,}{arrived:>6.1f}{s['duration_s']:>10.1f}{s['requests_per_s']:>11.2f}"
          f"{s['goodput_rps']:>9.2f}{s['slo_attainment']:>8.1%}{s['ttft_s']['p99']:>9.3f}"
          f"{s['queue_s']['p99']:>10.3f}")

# %% [markdown]
# The short run says 20 requests/s is fine: every request meets the SLO. The long run
# says it is not: more than a quarter of the requests miss it and the queue's p99 is almost 2 s,
# though its 10,000 arrivals came at 19.7 requests/s and the short run's 200 at 22.8. At
# an offered load this close to capacity, every burst leaves a little backlog, and ten seconds
# is not long enough for the backlog to grow. That is why the benchmark contract asks for the
# run's length and arrival process to be declared with its results, and why the load you can
# sustain should come from runs long enough for the queue to settle, or visibly not settle.
#
# ### Sustainable load
#
# The contract asks for the **Sustainable Load**: the highest load that still meets the TTFT,
# ITL *and* end-to-end SLOs together ("同时满足 TTFT、ITL 与端到端 SLO"). The goodput curve
# above used TTFT and TPOT only, on 200 requests. Now all three, on 2,000 requests per rate
# (100–200 s of traffic each): TTFT ≤ 0.5 s, no gap between two tokens longer than 100 ms
# (`"itl"` bounds each request's worst gap, chapter 05), and the whole answer within 5 s. A
# rate is sustained when at least 99% of its requests meet all three, and so do all lower
# rates (`metrics.sustainable_load`). Simulated, as above: 12,000 requests, the chapter's
# slowest cell:

# %%
# NBVAL_CHECK_OUTPUT
FULL_SLO = {"ttft": 0.5, "itl": 0.1, "e2e": 5.0}
attainment = {}
print(f"{'rate':>5}{'SLO met':>9}{'TTFT p99':>9}{'max ITL p99':>12}{'E2E p99':>8}"
      f"{'missed: TTFT':>13}{'ITL':>5}{'E2E':>5}  (simulated, 2,000 requests each)")
for rate in (10, 14, 16, 18, 19, 20):
    e = make_sim_engine("h100-like", policy="pd", max_num_seqs=64, num_pages=40000,
                        max_num_batched_tokens=512, chunk_size=512, trace_snapshots=False)
    run_workload(e, traffic(rate, n=2000))
    recs = e.request_records()
    s = metrics.summarize(e.trace, recs, slo=FULL_SLO)
    attainment[rate] = s["slo_attainment"]
    missed = [sum(not metrics.meets_slo(r, {key: limit}) for r in recs)  # each limit alone
              for key, limit in FULL_SLO.items()]
    print(f"{rate:>5}{s['slo_attainment']:>9.1%}{s['ttft_s']['p99']:>9.3f}"
          f"{s['max_itl_s']['p99']:>12.3f}{s['e2e_s']['p99']:>8.2f}"
          f"{missed[0]:>13}{missed[1]:>5}{missed[2]:>5}")
print(f"sustainable load at 99% within {FULL_SLO}: "
      f"{metrics.sustainable_load(attainment, target=0.99)} requests/s (simulated)")

# %% [markdown]
# About 18 requests/s, not 20. The `missed` columns count the requests that fail each limit
# alone. PD keeps every request's worst gap near 26 ms, so the ITL limit never binds here. TTFT
# sets the answer, before the engine runs out of throughput: from 19 requests/s the queue's
# bursts push more than one request in a hundred past half a second before its first token (40
# of 2,000). The end-to-end limit starts to cost requests at 18 requests/s, where a few of the
# longest answers take more than 5 s (2 at 18, 4 at 19, 33 at 20). The goodput curve's "about
# 20" was the rate at which the engine still *completes* nearly everything in a short run; the
# sustainable load is the rate you can promise, and at 20 requests/s one request in sixteen
# misses it. Which one a benchmark reports changes the answer, so the contract names it, with
# the SLO and the percentage.
#
# **Open or closed loop.** Every run so far sent each request at its arrival time, whatever the
# engine was doing: an *open loop*, like users who do not know about each other. Many load
# generators close the loop instead: N virtual users, each sending its next request only when
# its last answer came back (`--max-concurrency N` in vLLM's `bench serve` and in minicb's
# `bench`, `sweep` and client; `run_workload(..., max_concurrency=N)` here). That is why the
# contract wants **concurrency** declared. The same traffic past saturation, both ways:

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'offered':>8}{'loop':>13}{'sent req/s':>11}{'goodput':>9}{'SLO met':>8}{'TTFT p99':>9}"
      "  (simulated)")
for rate in (20, 30, 40):
    for cap in (None, 32):
        e = make_sim_engine("h100-like", policy="pd", max_num_seqs=64, num_pages=40000,
                            max_num_batched_tokens=512, chunk_size=512)
        run_workload(e, traffic(rate), max_concurrency=cap)
        recs = e.request_records()
        s = metrics.summarize(e.trace, recs, slo=SLO)
        sent = metrics.observed_arrivals([r.arrival_time for r in recs])["rate_rps"]
        loop = "open" if cap is None else f"closed, {cap}"
        print(f"{rate:>8}{loop:>13}{sent:>11.1f}{s['goodput_rps']:>9.2f}"
              f"{s['slo_attainment']:>8.0%}{s['ttft_s']['p99']:>9.3f}")

# %% [markdown]
# The closed loop cannot show overload. Its 32 users send at about 19 requests/s whatever rate
# they were given, because each waits for its answer, so the engine never sees the burst that
# would queue: TTFT p99 stays under half a second and the SLO holds for every request at an
# "offered" 40 requests/s, where the open loop shows what real independent users would get
# (16%). The wait did not vanish; it moved into the client, where no metric counts it (the
# coordinated-omission trap of load testing). A closed loop answers "what do N users see", an
# open loop "what does this arrival rate cost": declare which one ran, and read the achieved
# rate, not the offered one.

# %% [markdown]
# ## 5. When the KV cache is full: preemption and recompute
#
# The contract lists what an engine can do when the cache is full: stop admitting, wait, reject,
# evict cached blocks, swap, or **抢占 preempt** a sequence and recompute it later. minicb
# admits a request only when its first chunk's pages are free, and when a running decode needs a
# new page and none is left, it preempts: the newest running request (or, with
# `preemption="priority"`, the least important one) gives back all its pages and goes back to
# the front of the queue (under `priority`, to its place by priority); when it is admitted again, its tokens are computed again (full prompt
# pages that are still in the prefix index are reused). vLLM's default is the same, its
# "recompute" preemption mode.
#
# Four requests of 32 prompt tokens and 32 output tokens need 4 pages each at the end, 16 in
# all. Give the engine 11 pages (on the real model):

# %%
# NBVAL_IGNORE_OUTPUT
tight_wl = Workload("kv-full", [WorkloadRequest(prompt_len=32, max_tokens=32, arrival_step=1,
                                                request_id=f"r{i}") for i in range(4)])
roomy = Engine(model, policy="pd", max_num_seqs=4)
tight = Engine(model, policy="pd", max_num_seqs=4, num_pages=11)
for engine in (roomy, tight):
    t0 = time.perf_counter()
    run_workload(engine, tight_wl)
    print(f"{engine.pool.num_pages:>5} pages: {len(engine.trace)} steps, "
          f"{time.perf_counter() - t0:.1f} s")

# %%
# NBVAL_CHECK_OUTPUT
for name, engine in (("1024 pages", roomy), ("11 pages", tight)):
    s = metrics.summarize(engine.trace, engine.request_records())
    events = [(rec.step, rid) for rec in engine.trace for rid in rec.preempted]
    print(f"{name:<10} steps {s['num_steps']:>3}, most pages used {max(r.pages_used for r in engine.trace):>2}, "
          f"preemptions {s['preemptions']} {events}, discarded tokens {s['discarded_tokens']} "
          f"({s['recomputed_tokens']} computed again), "
          f"evicted prefix pages {s['evicted_pages']}")
print("same output tokens with and without preemption:",
      all(tight.requests[r].output_token_ids == roomy.requests[r].output_token_ids
          for r in roomy.requests))

# %% [markdown]
# Two preemptions gave up 80 tokens of computed K/V (`discarded_tokens`, the lost work), of
# which 48 were computed again (`recomputed_tokens`, counted as the forward recomputes them): r2
# came back to its two full prompt pages still cached and redid 16 of its 48 tokens, while r3
# found nothing left and redid all 32. They cost 31 extra steps, and the results are unchanged:
# a preempted request produces exactly the tokens it would have. A preempted request's full
# prompt pages stay in the prefix index, reusable when it returns, unless the pool needs the
# room first: here 2 cached pages were evicted (`evicted_pages`), prefix reuse lost to memory
# pressure. The cost is time: the work
# thrown away, plus the wait in the queue. That is why the contract wants preemptions and lost
# work reported next to utilisation.
#
# **Whom to preempt.** By default the newest request is the victim (`preemption="newest"`), since
# it has the least work to lose. The contract says to preempt "低优先级序列" (low-priority
# sequences): with `preemption="priority"` the victim is the least important running request
# (the largest `priority` value, as in vLLM). Make the *oldest* request, r0, a background job at
# priority 1 and run the same 11 pages both ways (simulated executor: schedules are exact):

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'preemption':<11}{'steps':>6}  {'victims (step, request)':<26}finish steps")
for mode in ("newest", "priority"):
    jobs = Workload("kv-full", [WorkloadRequest(prompt_len=32, max_tokens=32, arrival_step=1,
                                                priority=int(i == 0), request_id=f"r{i}")
                                for i in range(4)])
    e = make_sim_engine(policy="pd", max_num_seqs=4, num_pages=11, preemption=mode)
    run_workload(e, jobs)
    victims = [(rec.step, rid) for rec in e.trace for rid in rec.preempted]
    finish = {r.request_id: r.metrics.finish_step for r in e.requests.values()}
    print(f"{mode:<11}{len(e.trace):>6}  {str(victims):<26}{finish}")

# %% [markdown]
# The same two preemptions and the same 63 steps, but different victims: under `priority` the
# background job r0 gives way first (step 2) and finishes last, while the three priority-0
# requests finish at steps 32, 32 and 47 (r3, the newest of them, is the second victim, at step
# 18, once r0 has nothing left to give). The total work is the same; who pays for it is a policy choice.
#
# **Bounding the loss.** Nothing above stops one request from being preempted again and again:
# the newest is the victim each time, and the request that arrived last stays the newest
# however often it comes back (the rank is the arrival order, not the readmission). The
# contract asks for preemption loss to be bounded *explicitly* (quoted in section 7 below). `max_preemptions=N`
# is minicb's bound: a request preempted N times is admitted again only with pages for its
# whole life (prompt + `max_tokens`), so it never needs another page, and it is never chosen as a
# victim again. `max_preemptions=0` reserves every request's whole life when it is admitted: the
# old answer to a full cache, where preemption never happens. Eight requests of 16 prompt tokens
# and 96 output tokens, one every two steps, each growing to 7 pages, in 24 pages (simulated):

# %%
# NBVAL_CHECK_OUTPUT
growing = Workload("kv-growing", [WorkloadRequest(prompt_len=16, max_tokens=96,
                                                  arrival_step=1 + 2 * i, request_id=f"g{i}")
                                  for i in range(8)])
print(f"{'max_preemptions':<16}{'steps':>6}{'preemptions':>12}{'most for one':>13}"
      f"{'discarded':>10}{'recomputed':>11}{'most running':>13}{'E2E p50':>8}{'E2E max':>8}"
      "   (steps)")
for limit in (None, 2, 1, 0):
    e = make_sim_engine(policy="pd", max_num_seqs=8, num_pages=24, max_preemptions=limit)
    run_workload(e, growing)
    rs = e.request_records()
    s = metrics.summarize(e.trace, rs)
    e2e = sorted(r.finish_step - r.arrival_step + 1 for r in rs)
    print(f"{str(limit):<16}{len(e.trace):>6}{s['preemptions']:>12}"
          f"{max(r.num_preemptions for r in rs):>13}{s['discarded_tokens']:>10}"
          f"{s['recomputed_tokens']:>11}"
          f"{max(len(rec.members) for rec in e.trace):>13}{e2e[len(e2e) // 2]:>8}{e2e[-1]:>8}")

# %% [markdown]
# Unbounded, the last arrival is preempted three times, and 403 tokens of K/V are given up, 355
# of them computed again (the other 48 came back from prompt pages still cached). A bound of
# 2 changes little here; a bound of 1 caps everyone at one preemption and 284 discarded tokens
# (268 computed again), but the 37 steps it adds are the price: a request that comes back holds 7 pages from the
# start, pages that other requests could have grown into, so fewer run at a time when it
# matters. With 0, nothing is ever recomputed and only 3 requests fit at once (24 pages / 7),
# and the run takes 290 steps instead of 185. Preemption is what lets a paged engine admit on
# what requests hold *now* instead of what they might need: the bound decides how much of that
# gamble one unlucky request can be made to pay.
#
# **The other answers.** The contract's list has six: stop admitting, wait, reject, evict
# cached blocks, swap, preempt and recompute. minicb runs all of them. **Wait** and **stop
# admitting** are what it does before anything else (a request is admitted only when its first
# chunk's pages are free, chapter 03; `max_preemptions=0` goes further and waits until a
# request's whole life fits, reserving it). **Evict** happens on the way (unreferenced prefix
# pages, least recently used first, `evicted_pages`). **Preempt and recompute** is above. Two
# are switches:
#
# - `preemption_mode="swap"` (vLLM's knob, from before its V1 engine dropped swapping): a
#   victim's K/V is copied to host memory (`num_swap_pages` pages, as many as the pool by
#   default) and copied back into fresh pages when it is admitted again, so nothing is
#   computed twice; the copies cost time instead. Its prompt pages still in the prefix index
#   then are shared, as any admission shares them, not copied back. The policy only plans the copies (page
#   pairs in the `ScheduledBatch`); the engine does them before the forward, out first, then
#   in. When the swap space is full, the victim is recomputed as before.
# - `reject_when_full=True`: a request that arrives when the free pages, less what the
#   waiting prompts will take, cannot hold its prompt (its whole life under
#   `max_preemptions=0`) is turned away at once with `finish_reason="rejected"`; the server
#   answers HTTP 503. It looks at arrivals only: a running request's growth is still met by
#   preemption.
#
# The same eight growing requests in 24 pages, every answer (simulated: the steps are exact;
# the time is the cost model's, once for the H100-like preset, where a page swapped each way
# is assumed to cost 42 µs over PCIe (on an H200, chapter 07's GPU checks measured the copy
# itself at 38.5–40.4 µs, and the engine's whole swap path at 88–143 µs with the host memory work
# around it), and once for this CPU's fitted model, where it costs what `sim.measure_swap_cost`
# measured on this machine when it was fitted, 0.14 ms (the page-by-page copies of 2026-12-04
# take 78–97 µs here); `python -m minicb profile` measures it with the rest of the fit):

# %%
# NBVAL_CHECK_OUTPUT
from minicb.benchmark.sim import CostModel

answers = [("preempt, recompute", {}), ("preempt, swap", {"preemption_mode": "swap"}),
           ("swap, 8 host pages", {"preemption_mode": "swap", "num_swap_pages": 8}),
           ("reserve (wait)", {"max_preemptions": 0}),
           ("reject + recompute", {"reject_when_full": True}),
           ("reserve + reject", {"max_preemptions": 0, "reject_when_full": True})]
cpu_cost = CostModel.load("cpu")
print(f"{'answer':<20}{'steps':>6}{'done':>5}{'rejected':>9}{'preempt':>8}{'discarded':>10}"
      f"{'recomputed':>11}{'swapped':>8}{'E2E p50':>8}{'E2E max':>8}{'h100-like s':>12}"
      f"{'cpu s':>7}")
for name, options in answers:
    runs = [make_sim_engine(cost, policy="pd", max_num_seqs=8, num_pages=24, **options)
            for cost in ("h100-like", cpu_cost)]
    for e in runs:
        run_workload(e, growing)
    e = runs[0]
    s = metrics.summarize(e.trace, e.request_records())
    e2e = sorted(r.finish_step - r.arrival_step + 1 for r in e.request_records()
                 if metrics.is_completed(r))
    print(f"{name:<20}{len(e.trace):>6}{s['completed']:>5}{s['rejected']:>9}"
          f"{s['preemptions']:>8}{s['discarded_tokens']:>10}{s['recomputed_tokens']:>11}"
          f"{s['swapped_out_pages'] + s['swapped_in_pages']:>8}{e2e[len(e2e) // 2]:>8}"
          f"{e2e[-1]:>8}{runs[0].clock():>12.3f}{runs[1].clock():>7.2f}")

# %% [markdown]
# Swap and recompute take the same 185 steps: pages, not compute, decide how many requests
# run at once, and the 355 recomputed tokens ride in steps whose token budget had room. They
# differ in time, and by how much depends on the machine. On the H100-like preset
# recomputing is nearly free (1.146 s against 1.138 s: 355 prefill tokens of compute against
# 53 copies of a 2 MiB page over PCIe); vLLM's V1 engine only recomputes. On this
# CPU, where a prefill token costs a millisecond and a page copy 0.14 ms, swapping saves 0.40
# s of 6.08 (7%). Exercise 6.5 finds the copy cost at which the two break even, and why the
# prefix cache moves it. A swap space of 8 pages holds only some victims; the others are recomputed
# (208 tokens discarded). Reserving never preempts but runs 3 requests at a time: 290 steps.
# Reject alone changes nothing here: each arrival's one-page prompt fits when it comes; it is
# the growth that fills the cache, and preemption still answers that. Reserving and rejecting
# together turn five of the eight away at the door: the three served finish in 96 steps each,
# the best E2E in the table, and five users get an error to retry. How many requests the same
# memory serves, and how fast, is the effective capacity each answer trades.
#
# On the real model, the swapped K/V must give the same tokens as never preempting, and a
# request that is let in must not notice the ones turned away. The 11-page run of four requests
# again, with swap, and with reserve + reject (each request's whole life is 4 pages: two fit):

# %%
# NBVAL_CHECK_OUTPUT
swapped = Engine(model, policy="pd", max_num_seqs=4, num_pages=11, preemption_mode="swap")
guarded = Engine(model, policy="pd", max_num_seqs=4, num_pages=11, max_preemptions=0,
                 reject_when_full=True)
for engine in (swapped, guarded):
    run_workload(engine, tight_wl)
s = metrics.summarize(swapped.trace, swapped.request_records())
print(f"swap: preemptions {s['preemptions']}, pages copied out {s['swapped_out_pages']} and in "
      f"{s['swapped_in_pages']}, discarded tokens {s['discarded_tokens']}, steps "
      f"{s['num_steps']} (recompute: {len(tight.trace)})")
print("reserve + reject:", {r: req.finish_reason for r, req in guarded.requests.items()},
      f"steps {len(guarded.trace)}, pages in use after: {guarded.pool.num_used}")
for name, engine in (("swap", swapped), ("reserve + reject", guarded)):
    served = [r for r, req in engine.requests.items() if req.finish_reason != "rejected"]
    print(f"{name}: the tokens of the {len(served)} served are the 1024-page run's:",
          all(engine.requests[r].output_token_ids == roomy.requests[r].output_token_ids
              for r in served))

# %% [markdown]
# Of the 5 pages copied out, 2 came back without a copy: full prompt pages still in the prefix
# index, shared again as any admission shares them; 3 were copied in. In the swap run's
# timeline a green ▼ marks each victim whose K/V went to host memory: it comes back decoding
# where it stopped. In the recompute run's (the same picture further
# below, with a red ✗ per victim) a victim comes back prefilling its tokens again.

# %%
viz.plot_timeline(swapped, title="11 pages, swap: victims resume decoding")

# %% [markdown]
# **Under overload.** The growing requests were gentle: the cache filled from growth, not from
# arrivals. Now send chat traffic (prompts 16-512 tokens, outputs 8-256) at 1.2 requests/s,
# Poisson, into 96 pages: about twice what this CPU serves in that memory (simulated, this
# CPU's cost model; SLO: TTFT within 2 s and no gap between tokens over 0.5 s):

# %%
# NBVAL_CHECK_OUTPUT
busy = make_workload(200, prompt_lengths="uniform:16:512", output_lengths="uniform:8:256",
                     arrival="poisson", rate=1.2, seed=0, name="overload")
overload_slo = {"ttft": 2.0, "itl": 0.5}
print(f"{'answer':<20}{'done':>5}{'rejected':>9}{'preempt':>8}{'tok/s':>7}{'TTFT p50':>9}"
      f"{'TTFT p99':>9}{'max ITL p99':>12}{'SLO met':>8}{'goodput':>8}")
for name, options in [answers[0], answers[1], answers[3], answers[4], answers[5]]:
    e = make_sim_engine(cpu_cost, policy="pd", num_pages=96, trace_snapshots=False, **options)
    run_workload(e, busy)
    s = metrics.summarize(e.trace, e.request_records(), slo=overload_slo)
    print(f"{name:<20}{s['completed']:>5}{s['rejected']:>9}{s['preemptions']:>8}"
          f"{s['output_tokens_per_s']:>7.1f}{s['ttft_s']['p50']:>9.2f}{s['ttft_s']['p99']:>9.2f}"
          f"{s['max_itl_s']['p99']:>12.2f}{s['slo_attainment']:>8.0%}{s['goodput_rps']:>8.2f}")

# %% [markdown]
# The three answers that keep every request meet the SLO for 4-5% of them: the queue grows for
# the whole run, and the median request waits 114 to 138 s for its first token. Swap helps the
# engine (5% more tokens per second than recompute: nothing is computed twice) but not its
# users. Rejecting turns 116 of the 200 away at the door and starts most of the rest within
# 2 s (TTFT p50 0.48 s, p99 3.64 s), though preemption's stalls still fail a quarter of them (62
# of the 84 meet the SLO): goodput goes from 0.03 to 0.38 requests/s. Reserving as well ends
# those stalls (the worst gap p99 0.45 s instead of 4.52) and rejects three fewer: all 87 it
# serves meet the SLO, the best goodput here, 0.52.
# Under overload the question is not how to serve everyone but whom to refuse, and how fast: a
# 503 with `Retry-After` is an answer a client can act on; two minutes in a queue is not.
#
# Each answer trades latency against effective capacity, which is why the contract wants the
# choice declared with the results: `bench` declares `preemption`, `max_preemptions`,
# `preemption_mode`, `num_swap_pages` and `reject_when_full` under `policy_options`, and
# reports `rejected`, `swapped_out_pages` and `swapped_in_pages` beside the preemptions.
#
# **OOM.** The contract also asks to watch for out-of-memory failures. minicb allocates its whole
# page pool when the engine starts (on CUDA, sized from the free memory, chapter 07), so a full
# cache is never an out-of-memory error: it becomes waiting, preemption, a swap or a rejection,
# counted above. What could never fit is refused at the door, before any work, with the numbers
# (a `ValueError`; HTTP 400 from the server), and the engine stays as it was. A forward that fails anyway (on a
# GPU, activations outgrowing their headroom) fails only that step's requests, counted as
# `errors`, and the engine goes on (the second cell below injects one).
# The 11-page engine holds 176 tokens:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.request import SamplingParams

try:
    tight.add_request([1] * 150, SamplingParams(max_tokens=64))
except ValueError as exc:
    print("refused:", exc)
print(f"after the refusal: {tight.pool.num_used} pages in use, {len(tight.requests)} requests "
      f"(the 4 of the run above), errors so far: "
      f"{metrics.summarize(tight.trace, tight.request_records())['errors']}")

# %% [markdown]
# Now a forward that fails: three requests decode on the simulated executor, and the third step's
# forward raises, standing in for a GPU that ran out of memory in one step (`_failure_hook` is
# the engine's fault-injection point, the one its tests use). A fourth request arrives after it:

# %%
# NBVAL_CHECK_OUTPUT
faulty = make_sim_engine(policy="pd", max_num_seqs=4)
for i in range(3):
    faulty.add_request([1] * 32, SamplingParams(max_tokens=16, ignore_eos=True),
                       request_id=f"f{i}")
faulty.step()
faulty.step()


def out_of_memory_once(items):
    faulty._failure_hook = None
    raise RuntimeError("CUDA out of memory (injected)")


faulty._failure_hook = out_of_memory_once
faulty.step()
faulty.add_request([2] * 32, SamplingParams(max_tokens=16, ignore_eos=True), request_id="after")
faulty.run()
s = metrics.summarize(faulty.trace, faulty.request_records())
print({rid: (req.finish_reason, len(req.output_token_ids)) for rid, req in faulty.requests.items()})
print({k: s[k] for k in ("num_requests", "completed", "errors")}, "| pages in use:",
      faulty.pool.num_used, "| the error:", faulty.requests["f0"].error)

# %% [markdown]
# The three requests of the failed step end with `finish_reason="error"` after the two tokens
# they had, their pages come back, and the engine serves the next request as if nothing had
# happened; `summarize` counts the errors next to the completions, as the contract asks.
#
# The timeline marks each preemption of the real run with an ✗; the pages picture shows the
# used and cached pages together at or within two of the pool's 11 for most of the run: a pool
# this small is always close to full.

# %%
viz.plot_timeline(tight, title="11 pages for 16 pages of demand: preempt, wait, recompute")

# %%
viz.plot_pages(tight, title="KV pages in use (11 in the pool)")

# %% [markdown]
# ## 6. Cancellation frees pages at once
#
# A user closes the tab; the client cancels. A cancelled request must give its KV pages back
# immediately, not at the end of its `max_tokens`. Three requests decode for 6 steps, then one is
# cancelled:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.request import SamplingParams

eng = Engine(model, policy="pd", max_num_seqs=4, num_pages=64)
rng = np.random.default_rng(0)
for i in range(3):
    eng.add_request(rng.integers(100, 10000, 60).tolist(),
                    SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
                    request_id=f"c{i}")
for _ in range(6):
    eng.step()
print("before:", eng.stats(), {r.request_id: len(r.page_table) for r in eng.running})
eng.cancel("c1")
print("after: ", eng.stats(), {r.request_id: len(r.page_table) for r in eng.running})
print("c1:", eng.requests["c1"].finish_reason, "after", len(eng.requests["c1"].output_token_ids),
      "tokens")
for rid in ("c0", "c2"):
    eng.cancel(rid)
eng.check_invariants()
print("all cancelled:", eng.stats())

# %% [markdown]
# c1's 5 pages leave `pages_used` at once. Its 3 full prompt pages stay in the prefix index as
# `pages_cached` (a later request with the same prompt would reuse them; the pool evicts them
# when it needs the room), and its other two pages (one holding the prompt's last 12 tokens and
# the first outputs, one partly filled) go straight back to the free list.
# `check_invariants` confirms that every page is accounted for.
#
# In a workload, `make_workload(..., cancel_fraction=0.2)` has clients cancel a share of the
# requests (each right after its first token: `cancel_after_tokens=1`, the default). Fifty
# requests at 20 per second, simulated:

# %%
# NBVAL_CHECK_OUTPUT
churn = make_workload(50, prompt_lengths="uniform:16:256", output_lengths="uniform:16:128",
                      arrival="poisson", rate=20, cancel_fraction=0.2, seed=0)
e = make_sim_engine("h100-like", policy="pd", max_num_seqs=16)
run_workload(e, churn)
s = metrics.summarize(e.trace, e.request_records(), slo={"ttft": 0.5, "itl": 0.1})
print({k: s[k] for k in ("num_requests", "completed", "cancelled", "errors", "slo_met")})
print(f"SLO attainment {s['slo_attainment']:.0%} of the {s['num_requests'] - s['cancelled']} "
      f"requests not cancelled; pages still in use after the run: {e.pool.num_used}")

# %% [markdown]
# `summarize` counts the cancelled requests and never averages them into the latencies or the
# goodput: a request its user abandoned was neither fast nor slow. Their pages came back the
# step they were cancelled, so the run ends with none in use.
#
# ## 7. Priority and starvation
#
# The contract: "FCFS 本身不保证不同 Prompt 长度、Tenant 或 Priority Class 的公平性，必须显式限制
# Starvation 与 Preemption Loss" (first-come-first-served does not by itself guarantee fairness
# across prompt lengths, tenants or priority classes; starvation and preemption loss must be
# bounded explicitly). Preemption loss has its bound in section 5 (`max_preemptions`); this
# section bounds starvation.
#
# **Prompt length first.** Four hundred requests at 30 per second with lognormal prompts (median
# 256 tokens, a tail to 6,000), PD, first come first served, simulated; TTFT per prompt-length
# bucket, and TTFT per 100 prompt tokens (the wait relative to the request's own work):

# %%
# NBVAL_CHECK_OUTPUT
mixed_lengths = make_workload(400, prompt_lengths="lognormal:256:1.5:16:6000",
                              output_lengths="uniform:16:256", arrival="poisson", rate=30,
                              seed=1)
e = make_sim_engine("h100-like", policy="pd", max_num_seqs=64, max_num_batched_tokens=512,
                    chunk_size=512, num_pages=20000)
run_workload(e, mixed_lengths)
print(f"{'prompt tokens':<14}{'requests':>9}{'TTFT p50':>9}{'TTFT p99':>9}"
      f"{'TTFT per 100 prompt tokens, p50':>33}   (simulated seconds)")
for low, high in ((16, 128), (128, 512), (512, 2048), (2048, 6001)):
    group = [r for r in e.request_records() if low <= r.num_prompt_tokens < high]
    ttfts = [metrics.ttft(r) for r in group]
    relative = [metrics.ttft(r) / r.num_prompt_tokens * 100 for r in group]
    print(f"{f'{low}-{high - 1}':<14}{len(group):>9}{np.percentile(ttfts, 50):>9.3f}"
          f"{np.percentile(ttfts, 99):>9.3f}{np.median(relative):>33.4f}")

# %% [markdown]
# The tail is the same for everyone: about 1.2 s of TTFT p99 whether the prompt has 50 tokens
# or 3,000. A short prompt needs one step, but arriving behind a long prompt's train of chunks,
# it waits for them; relative to its own work it waits about 46 times longer than a long prompt
# does. FCFS is fair to arrival order, not to size. Shortest-prompt-first would fix the
# short requests' tail and starve the long ones instead (measured below, once priorities and
# aging are introduced); whichever order an engine uses, the contract asks to measure its
# fairness per class, as above, and to bound the damage. `python -m minicb bench` prints the same
# table under each policy whenever a run has more than one prompt-length bucket, tenant or
# priority (`metrics.by_class`; the buckets there are 0-127, 128-511, 512-2047 and 2048+).
#
# **Priority classes.** With `preemption="priority"` minicb orders the waiting queue by `priority` (smaller is more
# important, as in vLLM) and preempts the least important request first. Two interactive
# requests (priority 0) start at step 1; a batch job (priority 1) arrives at step 2; more
# interactive requests keep arriving, one every 10 steps; two slots. Simulated executor, counted
# in steps:

# %%
# NBVAL_CHECK_OUTPUT
stream = [WorkloadRequest(prompt_len=32, max_tokens=20, arrival_step=1, request_id=f"chat-{i}")
          for i in range(2)]
stream.append(WorkloadRequest(prompt_len=32, max_tokens=20, arrival_step=2, priority=1,
                              request_id="batch-job"))
stream += [WorkloadRequest(prompt_len=32, max_tokens=20, arrival_step=s,
                           request_id=f"chat-{i + 2}") for i, s in enumerate(range(5, 100, 10))]
fairness = Workload("priority-stream", stream)
print(f"{'order':<22}{'batch-job waits':>16}{'chats wait p50':>15}{'max queue age':>14}")
for label, mode, aging in (("FCFS", "newest", None), ("priority", "priority", None),
                           ("priority, aging 40", "priority", 40),
                           ("priority, aging 20", "priority", 20)):
    e = make_sim_engine(policy="pd", max_num_seqs=2, preemption=mode,
                        priority_aging_steps=aging)
    run_workload(e, fairness)
    job = e.requests["batch-job"].metrics
    chats = [r.metrics.first_scheduled_step - r.metrics.arrival_step
             for r in e.requests.values() if r.request_id.startswith("chat")]
    s = metrics.summarize(e.trace, e.request_records())
    print(f"{label:<22}{job.first_scheduled_step - job.arrival_step:>16}"
          f"{np.median(chats):>15.1f}{s['max_queue_age_steps']:>14}")

# %% [markdown]
# Under FCFS the batch job waits its turn (19 steps) and the chats' median wait is 16 steps. Under
# priority ordering the chats are served sooner, but the stream never lets up, so the batch job
# waits 119 steps, until the stream ends: starvation. In production the stream need not end.
# `max_queue_age` (the oldest wait before first being scheduled) is the metric that exposes it.
#
# The contract asks for starvation to be bounded *explicitly*. One remedy is **aging**:
# `priority_aging_steps=N` improves a waiting request's priority by one for every N steps it has
# waited (`Engine._reorder_waiting_queue` re-sorts the queue each step), so after N steps the batch
# job ranks with the chats, and being older, goes first. Its wait is then at most N plus the time
# until a slot frees: 59 steps with N = 40, 39 with N = 20. The chats pay for it (median wait
# back to 16 steps): a bound on one class's wait is bought with the other's. Another remedy is a
# share of the budget reserved per class; both are policies to declare with the results.
#
# **Back to prompt lengths.** The same two tools give a size-aware order: make the prompt-length
# bucket the priority (short prompts first) and let aging bound how long a long prompt can be
# passed over. The lognormal workload from above, PD, simulated, TTFT p50 / p99 per bucket:

# %%
# NBVAL_CHECK_OUTPUT
import dataclasses

BUCKETS = ((16, 128), (128, 512), (512, 2048), (2048, 6001))


def size_class(prompt_len: int) -> int:
    return next(i for i, (low, high) in enumerate(BUCKETS) if low <= prompt_len < high)


by_size = Workload("by-size", [dataclasses.replace(r, priority=size_class(r.prompt_len))
                               for r in mixed_lengths.requests])
print(f"{'order':<20}" + "".join(f"{f'{low}-{high - 1}':>14}" for low, high in BUCKETS)
      + f"{'all p50':>9}{'max queue age':>15}   (simulated seconds)")
for label, workload, mode, aging in (("FCFS", mixed_lengths, "newest", None),
                                     ("size priority", by_size, "priority", None),
                                     ("size, aging 25", by_size, "priority", 25)):
    e = make_sim_engine("h100-like", policy="pd", max_num_seqs=64, max_num_batched_tokens=512,
                        chunk_size=512, num_pages=20000, preemption=mode,
                        priority_aging_steps=aging)
    run_workload(e, workload)
    cells = []
    for low, high in BUCKETS:
        ttfts = [metrics.ttft(r) for r in e.request_records() if low <= r.num_prompt_tokens < high]
        cells.append(f"{np.percentile(ttfts, 50):.3f}/{np.percentile(ttfts, 99):.3f}")
    s = metrics.summarize(e.trace, e.request_records())
    print(f"{label:<20}" + "".join(f"{c:>14}" for c in cells)
          + f"{s['ttft_s']['p50']:>9.3f}{s['max_queue_age_s']:>15.2f}")

# %% [markdown]
# Short prompts first cuts the short buckets' TTFT p99 by 3.6 to 4.2 times (1.17 s to 0.28 s
# for the shortest) and the median over all requests from 0.57 s to 0.08 s, and the longest
# prompts pay: their p99 nearly triples (1.18 s to 3.29 s) and so does the oldest wait (1.19 s
# to 3.16 s). Aging every 25 steps gives much of it back to them (p99 1.71 s, oldest wait
# 1.50 s) while the shortest bucket keeps two thirds of its gain (p99 0.58 s); the 512–2,047 bucket pays
# most of the rest (p99 1.23 s, FCFS's 1.20 s), since aged long prompts now overtake it. Which
# row is "fair" is a product decision; the contract's point is that it is measured per class and
# declared.
#
# **Deadlines.** The benchmark contract lists Deadline beside Priority and Cancellation among what a production
# scheduler tracks, and "Tenant、Priority 或 Deadline 策略" among the uses. In minicb a request may
# carry a `deadline`, in seconds after its arrival (`add_request(..., deadline=...)`, or
# `WorkloadRequest(deadline=...)`): once the engine clock passes it, the request leaves with
# `finish_reason="deadline"`, waiting or running, and its pages come back at once; `summarize`
# counts them (`deadline_missed`). `preemption="deadline"` orders the waiting queue earliest
# deadline first (EDF) and preempts the request whose deadline is furthest away. On the priority
# stream above, give each chat 0.18 s (about 30 steps of this simulated GPU) and the batch job
# 2 s:

# %%
# NBVAL_CHECK_OUTPUT
with_deadlines = Workload("deadline-stream", [
    dataclasses.replace(r, deadline=2.0 if r.request_id == "batch-job" else 0.18)
    for r in fairness.requests])
print(f"{'order':<10}{'deadlines':>10}{'done':>6}{'missed':>8}{'wasted tokens':>14}"
      f"{'max E2E ms':>11}{'job wait ms':>12}  missed")
for label, mode in (("FCFS", "newest"), ("priority", "priority"), ("deadline", "deadline")):
    for workload in (fairness, with_deadlines):
        e = make_sim_engine(policy="pd", max_num_seqs=2, preemption=mode)
        run_workload(e, workload)
        records = e.request_records()
        done = [r for r in records if metrics.is_completed(r)]
        missed = [r for r in records if r.finish_reason == "deadline"]
        assert metrics.summarize(e.trace, records)["deadline_missed"] == len(missed)
        job = next(r for r in records if r.request_id == "batch-job")
        print(f"{label:<10}{'yes' if workload is with_deadlines else '-':>10}{len(done):>6}"
              f"{len(missed):>8}{sum(r.num_output_tokens for r in missed):>14}"
              f"{max(metrics.e2e(r) for r in done) * 1000:>11.0f}"
              f"{metrics.queue_time(job) * 1000:>12.0f}  {[r.request_id for r in missed]}")

# %% [markdown]
# Without deadlines every request completes, and under priority the batch job waits 729 ms for
# a slot (`job wait ms`, its queue time), against 115 ms under FCFS. With deadlines, first come
# first served misses three chats: the batch job, which arrived
# early, holds a slot while chats queue past their deadlines, and 38 tokens already produced are
# thrown away. Priority and earliest-deadline-first both serve the chats first and let the batch
# job use its slack: one chat misses (the stream is more work than two slots can serve), 14
# tokens are wasted, and the batch job still finishes well inside its 2 s. EDF needs no priority
# classes, only the deadlines; here both pick the same order. What minicb does not do is refuse,
# at admission, a request that can no longer make its deadline, which would waste nothing: a
# project in chapter 08.
#
# **Tenants.** The third kind of fairness the contract names is between tenants: the clients
# that share one engine. A request may carry a `tenant` (`add_request(..., tenant=...)`; the
# OpenAI `user` field on the server), and `preemption="fair"` orders the waiting queue by how
# many tokens each tenant has been served so far, least first, and preempts from the
# most-served tenant. Tenant `batch` sends 48 long requests at once; tenant `chat` sends 20
# short ones, one every 50 ms (simulated, 8 slots):

# %%
# NBVAL_CHECK_OUTPUT
batch_jobs = [WorkloadRequest(prompt_len=256, max_tokens=128, arrival_time=0.0, tenant="batch",
                              request_id=f"batch-{i}") for i in range(48)]
chats = [WorkloadRequest(prompt_len=64, max_tokens=32, arrival_time=0.01 + 0.05 * i,
                         tenant="chat", request_id=f"chat-{i}") for i in range(20)]
two_tenants = Workload("two-tenants", batch_jobs + chats)
print(f"{'order':<8}{'tenant':<8}{'TTFT p50':>9}{'TTFT p99':>9}{'E2E p50':>9}{'tokens served':>15}"
      "   (simulated seconds)")
for mode in ("newest", "fair"):
    e = make_sim_engine(policy="pd", max_num_seqs=8, max_num_batched_tokens=512,
                        chunk_size=512, preemption=mode)
    run_workload(e, two_tenants)
    for tenant in ("batch", "chat"):
        records = [r for r in e.request_records() if r.tenant == tenant]
        ttfts = [metrics.ttft(r) for r in records]
        print(f"{mode:<8}{tenant:<8}{np.percentile(ttfts, 50):>9.3f}"
              f"{np.percentile(ttfts, 99):>9.3f}"
              f"{np.median([metrics.e2e(r) for r in records]):>9.3f}"
              f"{e.tenant_service[tenant]:>15}")

# %% [markdown]
# First come first served gives the engine to whoever arrived first: every chat waits behind
# the batch tenant's burst, about 5 s to its first token. The fair order serves the chat tenant
# first whenever it has had less, so its requests start within a fraction of a second, and the
# batch tenant's median TTFT grows from 2.2 s to 2.9 s: the same tokens, shared differently.
# minicb counts the service of every request the engine still remembers (a long-running
# server forgets its oldest finished requests, and their share with them), with no decay in
# between, so a tenant that was heavy an hour ago may still yield now; production fair-share
# schedulers (virtual-time fair queuing) let old service fade and can weight tenants. As with prompt lengths and priority classes, the
# contract asks for the measurement per tenant, and the policy declared.
#
# ## 8. Tuning by sweeping
#
# The contract's last item: "回放真实 Arrival 与 Length Distribution，再扫描 Token Budget、最大序列数、
# Prefill Chunk 和 Priority Policy。选择同时满足公平性、取消和质量要求的最高 SLO-qualified Goodput"
# (replay the real arrival and length distributions, sweep the token budget, max sequences,
# prefill chunk and priority policy, and pick the highest SLO-qualified goodput), and never copy
# another model's, runtime's or GPU's batch configuration.
#
# Sweep `max_num_batched_tokens` (with `chunk_size` equal to it) on the traffic of section 4, at
# 20 requests/s. **Simulated**, as above:

# %%
# NBVAL_CHECK_OUTPUT
budgets = [128, 256, 512, 1024, 2048]
sweep = {}
print(f"{'budget':>7}{'goodput':>9}{'SLO met':>8}{'tok/s':>7}{'TTFT p99':>9}{'TPOT p99':>9}"
      "  (simulated)")
for budget in budgets:
    e = simulate(20, budget=budget)
    s = metrics.summarize(e.trace, e.request_records(), slo=SLO)
    sweep[budget] = s
    print(f"{budget:>7}{s['goodput_rps']:>9.2f}{s['slo_attainment']:>8.1%}"
          f"{s['output_tokens_per_s']:>7.0f}{s['ttft_s']['p99']:>9.3f}{s['tpot_s']['p99']:>9.4f}")
best = max(budgets, key=lambda b: (sweep[b]["goodput_rps"], sweep[b]["output_tokens_per_s"]))
print(f"best: max_num_batched_tokens={best} "
      f"(goodput {sweep[best]['goodput_rps']:.2f} req/s, simulated)")

# %% [markdown]
# Small budgets starve prefill: at 128 tokens a step, a 2,000-token prompt needs 16 steps, the
# queue builds and TTFT p99 runs to seconds. From 512 up goodput is nearly flat (18.3-18.7
# requests/s): 512 serves every request within the SLO, and the larger budgets buy a little
# more throughput (2,404 tokens/s against 2,371) with longer mixed steps, which push a few
# requests' TPOT past 25 ms: 512 wins.
#
# That answer belongs to the H100-like cost model, not to the workload. "不能直接复制其他模型、Runtime
# 或 GPU 的 Batch 配置" (never copy another model's, runtime's or GPU's batch configuration):
# the same sweep under the cost model fitted on this course's CPU (`bench/cost_model_cpu.json`,
# made by `python -m minicb profile`: SmolLM2-135M on 2 cores), at a rate and an SLO this CPU
# can approach (0.15 requests/s; TTFT ≤ 10 s, TPOT ≤ 0.3 s):

# %%
# NBVAL_CHECK_OUTPUT
slow_slo = {"ttft": 10.0, "tpot": 0.3}
cpu_sweep = {}
print(f"{'budget':>7}{'goodput':>9}{'SLO met':>8}{'TTFT p99':>9}{'TPOT p99':>9}"
      f"{'max ITL p99':>12}  (simulated, cpu cost model)")
for budget in budgets:
    e = make_sim_engine("cpu", policy="pd", max_num_seqs=64, num_pages=40000,
                        max_num_batched_tokens=budget, chunk_size=budget)
    run_workload(e, traffic(0.15))
    s = cpu_sweep[budget] = metrics.summarize(e.trace, e.request_records(), slo=slow_slo)
    print(f"{budget:>7}{s['goodput_rps']:>9.3f}{s['slo_attainment']:>8.1%}"
          f"{s['ttft_s']['p99']:>9.1f}{s['tpot_s']['p99']:>9.3f}{s['max_itl_s']['p99']:>12.2f}")
# the same requests meeting the SLO is a tie (goodput then differs only by when the last, late
# request finished): the shorter worst gap breaks it
cpu_best = max(budgets, key=lambda b: (cpu_sweep[b]["slo_met"],
                                       -cpu_sweep[b]["max_itl_s"]["p99"]))
print(f"best on the CPU: {cpu_best}; the GPU's {best} here: goodput "
      f"{cpu_sweep[best]['goodput_rps']:.3f} instead of {cpu_sweep[cpu_best]['goodput_rps']:.3f}, "
      f"max ITL p99 {cpu_sweep[best]['max_itl_s']['p99']:.2f} s instead of "
      f"{cpu_sweep[cpu_best]['max_itl_s']['p99']:.2f} s (simulated)")

# %% [markdown]
# The CPU picks a smaller budget. 128 and 256 tie on the SLO (the same requests meet it; their
# goodputs differ in the fourth digit, by when the last request, itself late, finished), and the
# shorter worst gap breaks the tie. Here a prefill token costs about 5% of a step's fixed cost
# (1.1 ms against 22 ms) where the H100-like model makes it under 0.5% (27 µs against 6 ms), so
# every extra prompt token in a step delays the decodes sharing it by far more: the worst gap
# grows more than fivefold from 256 to 1,024 tokens while goodput barely moves. Copied from the GPU,
# the budget would be a choice made for another machine. (The CPU's TTFT p99 stays far above the
# SLO at any budget: the longest prompts, up to 6,000 tokens, take seconds to prefill here, so
# the sweep moves the SLO share by ten points at most; that, too, is a result to report.)
#
# The prefill chunk is a knob of its own ("Prefill Chunk" in the contract's list): the budget
# bounds a step's tokens, the chunk bounds one prompt's share of them, so a smaller chunk lets
# several prompts advance in one step and makes every mixed step a little shorter. Keep the
# budget at 1024 and vary the chunk:

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'chunk':>6}{'goodput':>9}{'SLO met':>8}{'TTFT p50':>9}{'TTFT p99':>9}{'TPOT p99':>9}"
      f"{'max ITL p99':>12}  (simulated, budget 1024)")
for chunk in (128, 256, 512, 1024):
    e = make_sim_engine("h100-like", policy="pd", max_num_seqs=64, num_pages=40000,
                        max_num_batched_tokens=1024, chunk_size=chunk)
    run_workload(e, traffic(20))
    s = metrics.summarize(e.trace, e.request_records(), slo=SLO)
    print(f"{chunk:>6}{s['goodput_rps']:>9.2f}{s['slo_attainment']:>8.1%}"
          f"{s['ttft_s']['p50']:>9.3f}{s['ttft_s']['p99']:>9.3f}{s['tpot_s']['p99']:>9.4f}"
          f"{s['max_itl_s']['p99']:>12.3f}")

# %% [markdown]
# Small chunks buy smoother decoding (each mixed step is shorter, so the worst gap drops, max ITL
# p99 from 43 ms to 38 ms; TPOT p99, an average over each request's gaps, from 26 to 24 ms)
# and pay in TTFT: a 2,000-token prompt at 128 tokens a step needs 16 steps before its first
# token. Under this SLO, which a long queue fails through TTFT, chunks of 256 and more win
# (512 by a hair); under an SLO on the worst gap, the ranking could turn. That is why the chunk is swept
# against the SLO you promise, not fixed at a number copied from elsewhere.
#
# The contract sweeps more than one knob, and picks under the fairness limits too. Add
# `max_num_seqs`, and keep only the settings whose oldest wait before first being scheduled (max
# queue age, the starvation metric of section 7) stays within 0.5 s:

# %%
# NBVAL_CHECK_OUTPUT
grid = {}
print(f"{'seqs':>5}{'budget':>7}{'goodput':>9}{'SLO met':>8}{'tok/s':>7}{'max queue age':>14}"
      "  (simulated)")
for seqs in (16, 32, 64, 128):
    for budget in (512, 1024):
        e = make_sim_engine("h100-like", policy="pd", max_num_seqs=seqs, num_pages=40000,
                            max_num_batched_tokens=budget, chunk_size=budget)
        run_workload(e, traffic(20))
        s = metrics.summarize(e.trace, e.request_records(), slo=SLO)
        grid[(seqs, budget)] = s
        print(f"{seqs:>5}{budget:>7}{s['goodput_rps']:>9.2f}{s['slo_attainment']:>8.1%}"
              f"{s['output_tokens_per_s']:>7.0f}{s['max_queue_age_s']:>14.3f}")
fair = [k for k, s in grid.items() if s["max_queue_age_s"] <= 0.5]
best = max(fair, key=lambda k: (grid[k]["goodput_rps"], -k[0]))
print(f"best within the fairness limit: max_num_seqs={best[0]}, max_num_batched_tokens="
      f"{best[1]} (goodput {grid[best]['goodput_rps']:.2f} req/s, simulated)")

# %% [markdown]
# The number of slots matters more than the budget here. With 16 or 32 slots the engine cannot
# keep up with 20 requests/s of this traffic: the queue grows, requests wait seconds before
# their first step (max queue age 2.1-6.6 s), and goodput collapses even though throughput looks
# respectable. From 64 slots goodput is near its top; 128 slots add 1% at budget 512 (18.88
# against 18.72 requests/s) and lose some at 1024, since this load only now and then runs more
# than 64 requests at once. The sweep picks 128 slots at 512; whether 1% is worth the memory the
# extra slots may hold is a decision to declare with it. On real hardware each point would be
# measured, not simulated.
#
# The last axis the contract names is the priority policy. Take section 7's three orders (FCFS,
# prompt-length bucket as priority, the same with aging every 25 steps) at 64 slots and both
# budgets, on the same traffic pushed past what the engine serves, 25 requests/s; the last
# column is the worst prompt-length bucket's TTFT p99:

# %%
# NBVAL_CHECK_OUTPUT
orders = {"FCFS": ("newest", None), "size priority": ("priority", None),
          "size, aging 25": ("priority", 25)}
overload = traffic(25)
overload_by_size = Workload("by-size", [dataclasses.replace(r, priority=size_class(r.prompt_len))
                                        for r in overload.requests])
policy_grid = {}
print(f"{'order':<16}{'budget':>7}{'goodput':>9}{'SLO met':>8}{'max queue age':>14}"
      f"{'worst bucket TTFT p99':>22}  (simulated, 25 req/s)")
for label, (mode, aging) in orders.items():
    for budget in (512, 1024):
        e = make_sim_engine("h100-like", policy="pd", max_num_seqs=64, num_pages=40000,
                            max_num_batched_tokens=budget, chunk_size=budget, preemption=mode,
                            priority_aging_steps=aging)
        run_workload(e, overload if label == "FCFS" else overload_by_size)
        s = metrics.summarize(e.trace, e.request_records(), slo=SLO)
        worst = max(np.percentile([metrics.ttft(r) for r in e.request_records()
                                   if low <= r.num_prompt_tokens < high], 99)
                    for low, high in BUCKETS)
        policy_grid[(label, budget)] = s
        print(f"{label:<16}{budget:>7}{s['goodput_rps']:>9.2f}{s['slo_attainment']:>8.1%}"
              f"{s['max_queue_age_s']:>14.3f}{worst:>22.3f}")
fair = [k for k, s in policy_grid.items() if s["max_queue_age_s"] <= 0.5]
top = max(policy_grid, key=lambda k: policy_grid[k]["goodput_rps"])
print("within the fairness limit (max queue age <= 0.5 s):", fair or "no setting")
print(f"highest goodput without the limit: {top[0]}, budget {top[1]} "
      f"({policy_grid[top]['goodput_rps']:.2f} req/s, simulated)")

# %% [markdown]
# Past saturation the order is the knob that matters most. Short prompts first serves 72–77% of
# the requests within the SLO against 52.5–54.5% under FCFS, and goodput rises from about 10–11 to
# 14–15 requests/s, because each short request that jumps the queue is one more request served
# in time. It gets there by starving the long prompts: the oldest wait passes 3 s and the worst
# bucket's TTFT p99 with it. Aging buys the fairness back (oldest wait 1.5–1.6 s, FCFS's
# 1.4–1.6 s) and gives up most of the gain (11.5–12.2 requests/s). No setting meets the 0.5 s limit: the honest result of this
# sweep is that 25 requests/s of this traffic needs more hardware, or a product decision to
# accept a looser limit for the long prompts, written down next to the number.
#
# The CLI does the same, and writes every result with its declaration: `python -m minicb bench`
# for one setting and several policies, `python -m minicb sweep` for a grid, the priority policy
# included (`--preemption newest,priority`), varying only the settings the policy reads
# (`Scheduler.reads`: `continuous` makes no chunks, so a chunk-size list runs at its first value
# and the output says so). "Replay the real arrival and length distributions"
# is `--workload-file`: a trace, one request per line with its arrival time, lengths and,
# optionally, priority, tenant and deadline (`bench --save-workload` writes the traffic of any
# run in that form), and `--max-queue-age` is the fairness limit of the table above. The sweep
# holds every setting to the rest of "同时满足公平性、取消和质量要求" as well: no failed request,
# every cancellation honoured in the step it came (and no KV page held after the run), and, on
# the real executor, each request's greedy tokens equal to those it gets served alone (one more
# run under `single`); the `fails` column names what a row misses, and such a row is never the
# best. Here the traffic above, priorities included, written out and replayed, on the simulated
# executor (`--executor sim`: the run says it is simulated, and that quality went unchecked):

# %%
# NBVAL_IGNORE_OUTPUT
import json
import sys

from minicb.benchmark.workload import save_workload_file

trace = save_workload_file(overload_by_size, "/tmp/minicb-by-size.jsonl")
first = json.loads(trace.read_text().splitlines()[0])
print("first line:", {k: (v[:5] + ["..."] if isinstance(v, list) else v) for k, v in first.items()})
!{sys.executable} -m minicb sweep --executor sim --workload-file {trace} \
    --preemption newest,priority --max-num-batched-tokens 512,1024 --max-num-seqs 64 \
    --chunk-size 1024 --num-pages 40000 --slo-ttft 0.5 --slo-tpot 0.025 --max-queue-age 0.5 \
    --no-progress --out /tmp/minicb-sweep.json

# %% [markdown]
# The replay gives back the Python table's goodput for both orders and both budgets (a chunk
# size above the budget is cut to the budget):

# %%
# NBVAL_CHECK_OUTPUT
rows = json.loads(open("/tmp/minicb-sweep.json").read())["rows"]
cli = {(row["preemption"], row["max_num_batched_tokens"]): row["goodput_rps"] for row in rows}
print("CLI replay == the table above:",
      all(abs(cli[orders[label][0], budget] - policy_grid[label, budget]["goodput_rps"]) < 1e-9
          for label in ("FCFS", "size priority") for budget in (512, 1024)))

# %% [markdown]
# The queue-age limit judges a setting by its single oldest wait. The contract's sentence on
# fairness names classes: FCFS guarantees no fairness across prompt lengths, tenants or priority
# classes. `--min-class-attainment 0.45` is that limit: every prompt-length bucket, tenant and
# priority class must meet the SLO for at least 45% of its requests, and each row names its
# worst class (`metrics.worst_class` over `by_class`). The same replay, this limit instead of
# the queue age:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.benchmark.sweep import run_sweep, sweep_parser

args = sweep_parser().parse_args([
    "--executor", "sim", "--workload-file", str(trace), "--preemption", "newest,priority",
    "--max-num-batched-tokens", "512,1024", "--max-num-seqs", "64", "--chunk-size", "1024",
    "--num-pages", "40000", "--slo-ttft", "0.5", "--slo-tpot", "0.025",
    "--min-class-attainment", "0.45", "--no-progress"])
class_sweep = run_sweep(args)
print(f"{'order':<10}{'budget':>7}{'goodput':>9}{'worst class':>22}{'its SLO met':>12}  fails")
for row in class_sweep["rows"]:
    print(f"{row['preemption']:<10}{row['max_num_batched_tokens']:>7}{row['goodput_rps']:>9.2f}"
          f"{row['worst_class']:>22}{row['worst_class_attainment']:>12.0%}  "
          f"{', '.join(row['fails']) or '-'}")
pick = class_sweep["best"]
print(f"best: {pick['preemption']}, budget {pick['max_num_batched_tokens']} "
      f"(goodput {pick['goodput_rps']:.2f} req/s, simulated)")

# %% [markdown]
# Short prompts first leaves the longest prompts (2048+ tokens) meeting the SLO for a fifth to
# two fifths of their requests; FCFS keeps every class at 47% or more, and at the larger budget
# is the pick, at 10.9 requests/s of goodput instead of 14.8. This is the product decision named after
# the priority table (accept a looser limit for the long prompts, yet serve at least half of
# every class in time), written as a limit the sweep checks.
#
# On real hardware drop `--executor sim`, and the run uses the real model (`--model` a bundled
# name or a checkpoint directory). On this CPU, keep real benchmarks to a few dozen requests; on
# a GPU, replay a real trace of thousands: your own traffic, exported in the format above.
#
# ## Recap
#
# - Declare the workload and system with every result: arrival process and burstiness,
#   concurrency, length distributions, cache state, policy, token budget, memory, model,
#   runtime, hardware, and whether it was measured or simulated. A closed loop of 32 users
#   met the SLO for every request at an "offered" 40 requests/s by sending only 19: read
#   the achieved rate.
# - Report p50/p95/p99 of queue time, TTFT, ITL/TPOT and E2E, not means; goodput at an SLO, not
#   only throughput. In the simulated sweep, as the offered rate grows past 20 requests/s,
#   throughput stays near 20 while goodput
#   collapses; burstier arrivals at the same mean rate cost goodput too.
# - Report max ITL (each request's worst gap) next to pooled ITL, and include static batching's
#   wait for its batch in E2E; continuous batching can still raise ITL p99, as the contract warns
#   (tenfold with prompts up to 3,000 tokens, simulated; PD's budget gives most of it back).
# - When the KV cache is full minicb preempts and recomputes: 2 preemptions, 80 discarded
#   tokens (48 computed again, the rest found in the prefix index) and 2 evicted prefix pages
#   in the 11-page run, identical outputs, 31 extra steps;
#   `preemption="priority"` makes the low-priority job the victim. `max_preemptions` bounds one
#   request's loss (three preemptions unbounded, one with a bound of 1), paid for in steps (222
#   against 185): a returning request holds its whole life's pages; 0 never preempts and fits 3
#   requests at once. `preemption_mode="swap"` keeps a victim's K/V in host memory instead
#   (nothing discarded, the same tokens; 7% less time on this CPU, nearly nothing on the
#   H100-like preset); `reject_when_full` turns arrivals away, which under overload lifted
#   goodput from 0.03 to 0.38 requests/s (0.52 with reserving). Cancellation returns pages the
#   same step.
# - FCFS is fair to arrival order, not to size: short prompts' TTFT p99 matched long prompts'.
#   Priority without a bound starves: the batch job waited 119 steps against 19 under FCFS;
#   `priority_aging_steps` bounds it (39 steps with 20). Watch max queue age. Prompt length as
#   the priority cuts the short prompts' TTFT p99 about fourfold and nearly triples the
#   longest ones'; aging gives much of that back.
# - Tune by sweeping your own traffic, under the fairness limits too: here the 512–2048 budgets
#   were within about 2% of each other (18.3–18.7 req/s), 128 and 256 far behind, and fewer
#   than 64 slots let the queue (and max queue age) grow without bound. The sustainable load within TTFT, ITL and E2E
#   limits together was 18 requests/s where short runs suggested 20. Never copy the answer from another machine: the
#   CPU's cost model picks a 128-token budget (tied on the SLO with 256, ahead on the worst
#   gap) where the H100-like one picked 512, whose worst gaps on the CPU are five times longer. Past saturation the priority order mattered most:
#   short prompts first beat the best FCFS setting's goodput by 36% (14.8 vs 10.9 requests/s)
#   by starving long prompts, and no setting met the fairness limit. A limit per class
#   (`--min-class-attainment 0.45`: every bucket meets the SLO for 45% of its requests) picks
#   that FCFS setting: the 2048+ bucket got 47% there, 20-40% under size priority.
#
# **Exercises:** [`exercises/06_benchmarking.ipynb`](../exercises/06_benchmarking.ipynb): compute
# one request's queue time, TTFT, E2E and TPOT from its timestamps, then goodput at an SLO
# (cancelled requests never count), and compare the goodput of two policies on this machine;
# then the same latencies per tenant, and two tenants sharing one engine first come first served
# and fair (section 7); last, pick a sweep's setting as the contract's last rule says (the best
# goodput among settings meeting fairness, cancellation and quality, section 8), and predict
# from the cost model the copy cost per page below which swapping a preempted request beats
# recomputing it, then check the prediction in the simulator (section 5). Beyond
# them (not graded): on section 7's priority stream, sweep `priority_aging_steps` from 1 to 120
# and tabulate the batch job's wait against the chats' median and mean waits. The job's wait
# moves in steps of 20 (when do the two slots free?), and the chats' median hardly moves until
# the job waits almost as long as with no aging; which values keep the chats' mean wait under 15
# steps while the job waits at most 60? Then add the priority policy as a third axis of section
# 8's sweep.
