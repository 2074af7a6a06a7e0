# %% [markdown]
# # 03 · Continuous batching: scheduling every step
#
# Static batching fixed the batch for its whole life.
# **连续批处理 Continuous Batching**, also called **Iteration-level Scheduling** (the Orca paper, OSDI 2022), decides the batch again before *every* forward.
# A finished request leaves at once; a new one takes its place at the next step.
# vLLM and SGLang build online serving on it.
#
# Names blur: some products call this "dynamic batching".
# What matters is the **scheduling boundary**: does the batch change between iterations (continuous) or only between whole batches (static)?
#
# **After this chapter you will be able to**
#
# - name the four phases of one engine step, find them in `Engine.step`, and read a `StepRecord`;
# - reproduce the seed's R1/R2/R3/R4 table from a real trace: R4 joins at step 31 in R1's slot;
# - show concurrency floating with the queue and with the free pages;
# - measure which workloads gain from continuous batching, in steps (exact) and in seconds (this machine).

# %%
# NBVAL_IGNORE_OUTPUT
%matplotlib inline
import time

import numpy as np

from minicb import LLM, SamplingParams
from minicb.benchmark import metrics
from minicb.course import viz
from minicb.model.loader import load_model
from minicb.benchmark.workload import Workload, WorkloadRequest, random_prompt, run_workload, seed_r1_r4

model = load_model("smollm2-135m")  # loaded once, shared by every engine below


def run(policy, requests, **options):
    """Run `requests` = [(id, prompt_len, output_len, arrival_step)] under `policy`, greedy with
    ignore_eos (exact output lengths). Returns the engine and the wall-clock seconds."""
    llm = LLM(model, policy=policy, **options)
    rng = np.random.default_rng(0)
    for rid, prompt_len, output_len, arrival in requests:
        llm.engine.add_request(random_prompt(prompt_len, rng),
                               SamplingParams(max_tokens=output_len, temperature=0.0,
                                              ignore_eos=True),
                               request_id=rid, arrival_step=arrival)
    t0 = time.perf_counter()
    llm.engine.run()
    return llm.engine, time.perf_counter() - t0

# %% [markdown]
# ## 1. From the batch to the step (seed §1.3, §2.3)
#
# Static batching schedules a *whole batch's life* at once, while decode advances step by step.
# After every step some requests may have finished and new ones may be waiting.
# Continuous batching lets the scheduler act on that at every step: 让调度决策跟上解码的处理速度 (keep scheduling decisions up with the pace of decoding).
#
# ## 2. The four phases of one step
#
# Each iteration has four phases (seed §2.3):
#
# 1. **schedule (调度)**: choose this step's members and how many tokens each advances (1 for a decode, the whole prompt for a prefill here).
# 2. **forward (模型前向计算)**: flatten the members into one token batch and run the model once. Prefills and decodes share the forward.
# 3. **sample (采样)**: one new token for every member whose prompt is now fully in the cache.
# 4. **reclaim (资源回收)**: a member that produced EOS or reached `max_tokens` leaves, and its pages and slot go back.
#
# In minicb that is `Engine.step()` in `minicb/engine.py`:

# %%
# NBVAL_CHECK_OUTPUT
import inspect

from minicb import Engine

print(inspect.getsource(Engine.step))

# %% [markdown]
# The scheduler is `ContinuousScheduler` in `minicb/scheduler.py`.
# Every running decode gets one token. Then waiting requests are admitted with their whole prompt, while a slot and its pages are free.
# Now the seed's example on the real model: R1, R2, R3 want 30, 200 and 80 tokens; R4 arrives at step 31 wanting 60. Three slots.

# %%
# NBVAL_IGNORE_OUTPUT
workload = seed_r1_r4(r4_output=60)
cont = LLM(model, policy="continuous", max_num_seqs=3).engine
t0 = time.perf_counter()
run_workload(cont, workload)
t_cont = time.perf_counter() - t0
print(f"continuous: {len(cont.trace)} steps in {t_cont:.1f} s")

# %% [markdown]
# Each step left a `StepRecord`. Here is step 31, without its wall-clock fields:

# %%
# NBVAL_CHECK_OUTPUT
rec = cont.trace[30]
for name in ("step", "arrived", "members", "sampled", "finished", "waiting", "pages_used",
             "pages_cached", "page_tables"):
    print(f"{name:>13}: {getattr(rec, name)}")

# %% [markdown]
# Read it phase by phase.
# **Schedule**: R4 `arrived`. R2 and R3 each advance 1 token past the 37 in their cache (`start`); R4 is admitted into free slot 0 with its 8-token prompt.
# **Forward**: one pass over 1 + 1 + 8 = 10 tokens.
# **Sample**: all three members got a token (`sampled`), R4 its first.
# **Reclaim**: nobody `finished`, nobody is `waiting`.
#
# The forward's attention keeps the three members apart. Drawn as a mask: each row is one query token, each column one key.
# Each request's rows read only its own keys, and a prompt's rows read only earlier positions:

# %%
viz.plot_attention_mask(cont, step=31)

# %% [markdown]
# ## 3. R4 takes R1's slot at step 31
#
# The seed tabulates the batch's members step by step. The same table, computed from the trace.
# (minicb's step 1 is the prefill, which also samples the first token, so a request of n tokens finishes at step n, as in the seed.)

# %%
# NBVAL_CHECK_OUTPUT
def batch_table(trace):
    """Group consecutive steps with the same members; list joins and finishes."""
    groups = []
    for rec in trace:
        members = "{" + ", ".join(sorted(m.request_id for m in rec.members if m.num_tokens)) + "}"
        joins = [f"{m.request_id} joins in slot {m.slot}" for m in rec.members
                 if m.kind == "prefill"]
        if not groups or groups[-1]["members"] != members or joins or groups[-1]["joins"]:
            groups.append({"first": rec.step, "members": members, "joins": joins,
                           "events": list(joins)})
        group = groups[-1]
        group["last"] = rec.step
        slots = {m.request_id: m.slot for m in rec.members}
        group["events"] += [f"{r} finishes at {rec.step}, frees slot {slots[r]}"
                            for r in rec.finished]
    print(f"{'steps':<12}{'batch members':<16}what happens")
    print("-" * 72)
    for g in groups:
        steps = str(g["first"]) if g["first"] == g["last"] else f"{g['first']} … {g['last']}"
        print(f"{steps:<12}{g['members']:<16}{'; '.join(g['events']) or 'each advances 1 token'}")


batch_table(cont.trace)

# %% [markdown]
# Compare it with the seed's table:
#
# ```
# 步序（Decode）     本步 batch 成员              本步发生的事
#   1 … 30           {R1, R2, R3}               三人各前进一步
#   31               {R2, R3, R4}               R1 释放槽位, R4 占用空位
#   32 … 80          {R2, R3, R4}               Go On
#   81               {R2, R4, …}                R3 释放槽位
#   …                {R2, …}                    R2 一直跑到 200
# ```
#
# Same story, with the bookkeeping explicit. R1's last token comes out of step 30, and step 30's reclaim frees slot 0.
# Step 31's schedule hands it to R4. R2 is never disturbed, and the run ends at step 200 instead of 260.
#
# At R3's exit the seed writes 再招新的请求 (recruit a new request). Here nobody waits at step 81.
# Add an R5 (100 tokens) arriving at step 50, while all slots are busy: it takes R3's slot the step after R3 finishes.

# %%
# NBVAL_IGNORE_OUTPUT
r5 = WorkloadRequest(prompt_token_ids=workload.requests[0].prompt_token_ids, max_tokens=100,
                     arrival_step=50, request_id="R5")
refill = LLM(model, policy="continuous", max_num_seqs=3).engine
_ = run_workload(refill, Workload("seed-r1-r5", [*workload.requests, r5]))

# %%
# NBVAL_CHECK_OUTPUT
batch_table(refill.trace)
print()
print(viz.render_text(refill.trace, width=80))

# %% [markdown]
# Now both policies side by side. The static run repeats chapter 02's:

# %%
# NBVAL_IGNORE_OUTPUT
static = LLM(model, policy="static", max_num_seqs=3).engine
t0 = time.perf_counter()
run_workload(static, seed_r1_r4(r4_output=60))
t_static = time.perf_counter() - t0
print(f"static: {len(static.trace)} steps in {t_static:.1f} s")

# %%
viz.compare({"static": static, "continuous": cont})

# %% [markdown]
# These are the seed's two timelines (静态批处理 above, 连续批处理 below), drawn from the two runs.
# Static batching leaves idle slots behind R1 and R3 and keeps R4 waiting until step 201.
# Continuous batching fills R1's slot at step 31 and finishes 60 steps sooner.

# %%
viz.plot_slots(cont, title="continuous batching: R4 takes slot 0 at step 31")

# %%
# NBVAL_CHECK_OUTPUT
for name, eng in (("static", static), ("continuous", cont)):
    r = {x.request_id: x for x in metrics.request_records(eng)}
    print(f"{name:<11} last step {eng.trace[-1].step:>3}, dead slot-steps "
          f"{metrics.dead_slot_steps(eng.trace):>3}, R4 starts at step "
          f"{r['R4'].first_scheduled_step:>3} and finishes at {r['R4'].finish_step:>3}, "
          f"R1 frees its slot after step {max(k.step for k in eng.trace for m in k.members if m.request_id == 'R1')}")
    e2e = {row["request_id"]: row["e2e_steps"] for row in metrics.per_request(metrics.request_records(eng))}
    print(f"{'':<11} end-to-end latency in steps (until the response is returned): {e2e}")

# %% [markdown]
# The last line is the seed's "短请求完成后可以立即返回结果" (a short request returns as soon as it is done).
# Under static batching R1's 30-step answer reaches its user after 200 steps; under continuous batching, the step it finishes.

# %% [markdown]
# Batching should not change what a request generates: under greedy sampling every policy returns the tokens the request gets alone.
# minicb's tests check this for every policy on random workloads.
# It is a tested property, not a bit-for-bit guarantee: other rows can change a row's summation order in the last bits.
# Here static and continuous agree token for token:

# %%
# NBVAL_CHECK_OUTPUT
same = {rid: static.requests[rid].output_token_ids == cont.requests[rid].output_token_ids
        for rid in ("R1", "R2", "R3", "R4")}
print("same tokens under static and continuous:", same)
assert all(same.values()), "batching changed a greedy answer"

# %% [markdown]
# Step through the continuous run: step 30 (R1 finishes), 31 (R4 joins), 80 (R3 leaves), 91 (R2 alone).

# %%
# NBVAL_IGNORE_OUTPUT
viz.step_through(cont)

# %% [markdown]
# ## 4. Concurrency floats with the queue and the memory
#
# Under continuous batching the batch size is not a setting.
# It is whatever the queue, the slots and the memory allow at each step (系统的并发度…自然浮动).
# Eight requests with varied output lengths, four slots:

# %%
# NBVAL_IGNORE_OUTPUT
varied_lengths = [4, 24, 8, 20, 4, 12, 24, 8]
varied = [(f"v{i}", 16, n, 1) for i, n in enumerate(varied_lengths)]
runs = {}
runs["varied", "static"] = run("static", varied, max_num_seqs=4)
runs["varied", "continuous"] = run("continuous", varied, max_num_seqs=4)

# %%
# NBVAL_CHECK_OUTPUT
def size_runs(trace):
    """Batch size per step, as (first step, last step, size) runs."""
    out = []
    for rec, size in zip(trace, metrics.batch_sizes(trace)):
        if out and out[-1][2] == size and out[-1][1] == rec.step - 1:
            out[-1][1] = rec.step
        else:
            out.append([rec.step, rec.step, size])
    return ", ".join(f"{a}-{b}: {s}" if a != b else f"{a}: {s}" for a, b, s in out)


for policy in ("static", "continuous"):
    eng = runs["varied", policy][0]
    print(f"{policy:<11} batch size by step  {size_runs(eng.trace)}")

# %% [markdown]
# Static batching runs 4 at a time only until its first member finishes, then shrinks.
# Continuous batching keeps 4 busy while the queue has requests.
#
# Memory is the other limit: a request needs pages for its prompt to be admitted.
# Six requests with 40-token prompts (three pages each), six slots, and a pool of only 10 pages:

# %%
# NBVAL_IGNORE_OUTPUT
tight_requests = [(f"p{i}", 40, n, 1) for i, n in enumerate([8, 4, 8, 6, 8, 4])]
tight, _ = run("continuous", tight_requests, max_num_seqs=6, num_pages=10)
roomy, _ = run("continuous", tight_requests, max_num_seqs=6)

# %%
# NBVAL_CHECK_OUTPUT
for name, eng in (("10 pages", tight), (f"{roomy.pool.num_pages} pages", roomy)):
    print(f"{name:<11} batch size by step  {size_runs(eng.trace)}; "
          f"last step {eng.trace[-1].step}; most pages used {max(r.pages_used for r in eng.trace)}")

# %%
viz.plot_pages(tight, title="continuous batching on a 10-page pool: admission waits for pages")

# %% [markdown]
# With 10 pages three requests fit; the other three wait, with slots free, until pages come back.
# The hatched band is pages the prefix index keeps ("cached"); they count as available.
# With the default pool all six run at once.
# If running requests *grow* past the pool, the engine must preempt someone: chapter 06.
#
# Memory is shared, too (the seed's 更充分的多请求复用). A request admitted while another with the same prefix still runs maps that request's pages.
# Two requests with the same 40-token system prompt, the second arriving while the first decodes:

# %%
# NBVAL_CHECK_OUTPUT
system_prompt = random_prompt(40, np.random.default_rng(1))
shared = LLM(model, policy="continuous", max_num_seqs=2).engine
for rid, question, arrival in (("a", [5, 6, 7], 1), ("b", [8, 9], 2)):
    shared.add_request(system_prompt + question,
                       SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                       request_id=rid, arrival_step=arrival)
shared.run()
both = next(rec for rec in shared.trace if len(rec.page_tables) == 2)
print(f"step {both.step}: page tables {both.page_tables}, pages used {both.pages_used}")
print("b's prompt tokens found in the prefix index:", shared.requests["b"].num_cached_tokens)
print("what step 2 computed:", [(m.request_id, m.kind, m.num_tokens) for m in both.members])

# %% [markdown]
# b's page table starts with a's two full prompt pages (32 tokens), so b computes only its last 10 prompt tokens.
# The third page is never shared: it is not full, and each request writes its own tokens there.
#
# ## 5. Which workloads gain (seed §2.5)
#
# | 负载 (workload) | CB 相对静态批 (continuous vs static) |
# |---|---|
# | output lengths vary widely | large gain: dead slots are reclaimed often |
# | output lengths nearly equal, offline | small gain: static is simpler and often enough |
# | very low arrival rate | almost nothing to swap in: one request at a time |
#
# Measure each row with small workloads: the varied run from above, eight requests of exactly 12 tokens, and four requests arriving 20 steps apart.
# A fourth row is chapter 02's stream whose queue kept growing.

# %%
# NBVAL_IGNORE_OUTPUT
equal = [(f"e{i}", 16, 12, 1) for i in range(8)]
sparse = [(f"s{i}", 16, 8, 1 + 20 * i) for i in range(4)]
stream = [(f"q{i}", 16, n, 1 + 2 * i) for i, n in enumerate([2, 12, 4, 10, 2, 6, 12, 4] * 5)]
for policy in ("static", "continuous"):
    runs["equal", policy] = run(policy, equal, max_num_seqs=4)
    runs["low rate", policy] = run(policy, sparse, max_num_seqs=4)
    runs["high rate", policy] = run(policy, stream, max_num_seqs=4)

# %%
# NBVAL_CHECK_OUTPUT
def summary(engine):
    recs = metrics.request_records(engine)
    tokens = sum(r.num_output_tokens for r in recs)
    latency = [metrics.released(r)[1] - r.arrival_step + 1 for r in recs]  # until returned
    return {"last step": engine.trace[-1].step, "busy steps": len(engine.trace),
            "tokens/step": tokens / len(engine.trace), "mean latency": np.mean(latency),
            "max latency": max(latency), "dead slot-steps": metrics.dead_slot_steps(engine.trace),
            "max queue": max(rec.num_waiting for rec in engine.trace)}


WORKLOADS = ("varied", "equal", "low rate", "high rate")
print(f"{'workload':<10}{'policy':<12}{'last step':>10}{'busy steps':>11}{'tokens/step':>12}"
      f"{'mean lat.':>10}{'max lat.':>9}{'dead':>6}{'max queue':>10}")
table = {}
for workload in WORKLOADS:
    for policy in ("static", "continuous"):
        s = table[workload, policy] = summary(runs[workload, policy][0])
        print(f"{workload:<10}{policy:<12}{s['last step']:>10}{s['busy steps']:>11}"
              f"{s['tokens/step']:>12.2f}{s['mean latency']:>10.1f}{s['max latency']:>9}"
              f"{s['dead slot-steps']:>6}{s['max queue']:>10}")
print()
for workload in WORKLOADS:
    st, ct = table[workload, "static"], table[workload, "continuous"]
    print(f"{workload:<10} static / continuous: steps {st['busy steps']} / {ct['busy steps']} = "
          f"{st['busy steps'] / ct['busy steps']:.2f}, mean latency {st['mean latency']:.1f} / "
          f"{ct['mean latency']:.1f} = {st['mean latency'] / ct['mean latency']:.2f}")

# %% [markdown]
# Latencies count steps from arrival until the response is returned. The seed's table holds:
#
# - **Varied lengths**: continuous batching needs fewer steps and lowers the mean latency.
# - **Equal lengths**: the two policies run exactly the same schedule.
# - **Low arrival rate**: one request at a time either way; tokens/step is 1.
# - **High arrival rate**: continuous batching admits each request the step it arrives (`max queue` 0).
#
# At the seed's own scale, answers of 10 and 1,000 tokens, a run takes minutes on this CPU.
# A schedule depends only on token counts, so the simulated executor (chapter 06) gives it exactly, in milliseconds:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.benchmark.sim import make_sim_engine

seed_scale = Workload("10-vs-1k", [
    WorkloadRequest(prompt_len=16, max_tokens=10 if i % 2 else 1000, arrival_step=1,
                    request_id=f"r{i}") for i in range(8)])
print(f"{'policy':<12}{'steps':>6}{'dead':>6}  latency of each request (output tokens)")
for policy in ("static", "continuous"):
    sim = make_sim_engine(policy=policy, max_num_seqs=4)
    run_workload(sim, seed_scale)
    latency = {r.request_id: f"{metrics.released(r)[1]}({r.num_output_tokens})"
               for r in metrics.request_records(sim)}
    print(f"{policy:<12}{len(sim.trace):>6}{metrics.dead_slot_steps(sim.trace):>6}  "
          + " ".join(latency[f"r{i}"] for i in range(8)))

# %% [markdown]
# Static batching runs two batches of 1,000 steps; the second batch's 10-token answers come back after 2,000 steps.
# Continuous batching ends at step 1,020.
# It does not make everyone fast: `r7` waits until a long request leaves a slot. Fairness comes back in chapter 06.
#
# Steps are exact. Seconds depend on what one step costs, and that depends on how many requests it carries.
# Every decode-only step of the eight runs above, grouped by batch size:

# %%
# NBVAL_IGNORE_OUTPUT
from collections import defaultdict

by_size = defaultdict(list)
for eng, _ in runs.values():
    for rec, size in zip(eng.trace, metrics.batch_sizes(eng.trace)):
        if rec.num_prefill_tokens == 0:
            by_size[size].append(rec.duration)
sizes = sorted(by_size)
medians = [float(np.median(by_size[b])) for b in sizes]
per_request, fixed = np.polyfit(sizes, medians, 1)
for b, m in zip(sizes, medians):
    print(f"batch of {b}: median decode step {m * 1000:4.0f} ms over {len(by_size[b]):3} steps")
print(f"fit: one step = {fixed * 1000:.0f} ms + {per_request * 1000:.0f} ms per request\n")

print(f"{'workload':<10}{'policy':<12}{'steps':>6}{'seconds':>9}{'fit predicts':>14}{'tokens/s':>10}")
for workload, policy in sorted(runs, key=lambda k: WORKLOADS.index(k[0])):
    eng, seconds = runs[workload, policy]
    tokens = sum(len(r.output_token_ids) for r in eng.requests.values())
    predicted = sum(fixed + per_request * b for b in metrics.batch_sizes(eng.trace))
    print(f"{workload:<10}{policy:<12}{len(eng.trace):>6}{seconds:>9.1f}{predicted:>14.1f}"
          f"{tokens / seconds:>10.1f}")

# %% [markdown]
# A step costs a fixed part (reading the weights once) plus a part per request.
# The fit above splits the two. At these small batches the per-request part is lost in the noise; it can even come out negative.
# So the fixed part dominates, and continuous batching's saving in *steps* carries over to seconds.
# The `fit predicts` column shows how well that simple split explains each run.
#
# The equal-length and low-rate workloads run *identical* schedules under both policies.
# Any gap between their seconds is noise from a shared machine. Compare steps, which are exact.

# %%
viz.compare({"static": runs["varied", "static"][0],
             "continuous": runs["varied", "continuous"][0]})

# %% [markdown]
# The seed's first-principle gains (第一性收益) are both visible: **throughput** (more of each step's slots do useful work) and the **shape of tail latency** (a short request no longer waits on the longest in its batch).
#
# Continuous batching as built here still prefills a new prompt whole, inside one step.
# A 2,000-token prompt makes that step long, and every decode in the batch waits (the seed's 问题一, problem one).
# So continuous batching does not always lower latency (the contract's FAQ: 连续批处理一定会降低延迟吗？不会). Chapter 04 cuts prompts into chunks.
#
# ## Recap
#
# - Continuous batching re-decides the batch before every forward: schedule → forward → sample → reclaim, recorded as a `StepRecord`.
# - One forward serves every member; attention keeps each request to its own keys.
# - R1 finishes at step 30 and R4 takes its slot at step 31. The run ends at step 200 instead of 260, with no dead slots.
# - Concurrency follows the queue and the memory; running requests share prefix pages.
# - It gains most when output lengths vary, and nothing when they are equal or arrivals never overlap.
#
# **Exercises:** [`exercises/03_continuous_batching.ipynb`](../exercises/03_continuous_batching.ipynb): predict each request's finish step by hand (3.1), then write the continuous scheduler as a `minicb.Scheduler` subclass (3.2).
#
# **Try it** (no checker): find the smallest `num_pages` at which the varied workload still runs four at a time.
