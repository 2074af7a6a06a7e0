# %% [markdown]
# # 03 · Continuous batching: scheduling every step
#
# Static batching fixed the batch for its whole life. **连续批处理 Continuous Batching**, also
# called **Iteration-level Scheduling** (the Orca paper, OSDI 2022) or in-flight
# batching, decides the batch again before *every* forward: a finished request leaves at once, a
# new one takes its place at the next step. vLLM and SGLang use it as the base of online serving.
#
# Two notes from the benchmark contract (the course's second source text: the rules for
# measuring an engine the way production traffic would, which chapter 06 follows) before we
# start. The Orca paper proposed two things:
# iteration-level scheduling, and **selective batching** (batch the token-wise operations, the
# projections and MLP, over all of a step's tokens, and run attention per request, since each
# request's context differs); minicb's flat mixed batch with per-member attention metadata (chapter 05 §3 shows
# it) is the same split. The speedups Orca reports belong to its GPT-3 system and its baselines, not to
# every engine today: measure your own (chapter 06). And names blur: some products call
# continuous batching "dynamic batching". What matters is the **scheduling boundary**: does the
# batch change between iterations (continuous) or only between whole batches (static, and the
# request-level dynamic batching of chapter 02)?
#
# **After this chapter you will be able to**
#
# - name the four phases of one engine step, find each in `Engine.step`, and read a `StepRecord`;
# - reproduce the seed's R1/R2/R3/R4 table from a real trace: R4 joins at step 31 in R1's slot;
# - show concurrency floating with the queue and with the free pages of the page pool;
# - measure which workloads gain from continuous batching and which do not, in steps (exact) and
#   in tokens per second (on this machine).

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
# Chapter 02 ended on the cause of every problem it measured: static batching schedules a *whole
# batch's lifetime* at once, while decode is naturally step by step. After every step some
# requests may have finished and new ones may be waiting. Continuous batching lets the scheduler
# act on that at every step: 让调度决策跟上解码的处理速度, keep the scheduling decisions up with
# the pace of decoding.
#
# ## 2. The four phases of one step
#
# Each iteration of the engine has four phases (seed §2.3):
#
# 1. **schedule (调度)**: read the waiting queue and the running requests, the free slots and
#    pages, and choose this step's members and how many tokens each advances (1 for a decode,
#    the whole prompt for a prefill under this chapter's policy);
# 2. **forward (模型前向计算)**: flatten the members into one token batch and run the model once;
#    prefills and decodes share the forward. (The seed, §2.4, pictures the decodes as a batch of
#    shape [B, 1], B requests of one token each. minicb lays every member's tokens end to end
#    instead, B decode tokens and whole prompts in one flat row, so prompts and decodes share a
#    forward without padding. Decode is memory-bound, chapter 01: the B rows read every weight
#    once between them, which is where batching's gain comes from.)
# 3. **sample (采样)**: 0 or 1 new token per member: one for every member whose prompt is now
#    fully in the cache (several with speculative decoding, chapter 08);
# 4. **reclaim (资源回收)**: a member that produced EOS or reached `max_tokens` leaves the running
#    set now, and its pages and slot go back for the next step's schedule.
#
# In minicb that is `Engine.step()` in `minicb/engine.py`; each phase is marked in the source
# (forward and sample share one block). A phase 0 comes first: the waiting queue's housekeeping
# (new arrivals join; chapter 06's expired deadlines leave and its time-dependent orders
# re-sort), so the scheduler sees the queue as it is at this step:

# %%
# NBVAL_IGNORE_OUTPUT
import inspect

from minicb import Engine

lines, first = inspect.getsourcelines(Engine.step)
print(f"minicb/engine.py, Engine.step starts at line {first}")
for i, line in enumerate(lines):
    if line.strip().startswith("# ") and line.strip()[2:3].isdigit():
        print(f"  line {first + i}: {line.strip()}")

# %% [markdown]
# The scheduler itself is `ContinuousScheduler` in `minicb/scheduler.py`: every running decode
# gets one token, then waiting requests are admitted with their whole prompt while a slot and
# the pages for the prompt allow, and while the step's prompt lengths stay within
# `max_num_batched_tokens` (whole prompts, counted before any prefix-cache hit: a simplification,
# since vLLM counts only the tokens it computes). The budget never stops the step's first prompt,
# however long, though a slot and its pages must still be free (and decodes do not count
# against the budget): chapter 04's problem. Now the seed's example on the real model:
# R1, R2, R3 want 30, 200 and 80 tokens and start together; R4 arrives at step 31 wanting 60
# (the course's choice, as in chapter 02: the seed gives R4 no length).
# Three slots, as before. (200 steps, 10–25 s on the course's two CPU cores, depending on the machine
# and its load.)

# %%
# NBVAL_IGNORE_OUTPUT
workload = seed_r1_r4(r4_output=60)
cont = LLM(model, policy="continuous", max_num_seqs=3).engine
t0 = time.perf_counter()
run_workload(cont, workload)
t_cont = time.perf_counter() - t0
print(f"continuous: {len(cont.trace)} steps in {t_cont:.1f} s")

# %% [markdown]
# Each step left a `StepRecord`. Here is step 31, with its wall-clock fields left out:

# %%
# NBVAL_CHECK_OUTPUT
rec = cont.trace[30]
for name in ("step", "arrived", "members", "sampled", "finished", "waiting", "pages_used",
             "pages_cached", "page_tables"):
    print(f"{name:>13}: {getattr(rec, name)}")

# %% [markdown]
# Read it phase by phase. **Schedule**: R4 `arrived` this step; R2 and R3 are decoding, so each
# advances 1 token past the 37 already in its cache (`start`: the 8-token prompt and the first 29
# of the 30 tokens sampled so far, one per step in steps 1–30; the 30th has no K/V yet, and this
# step's 1 token feeds it); R4 is admitted into the free slot 0 with its 8-token prompt, from
# `start` 0 (a prefix-cache hit or an earlier chunk would start it later). **Forward**: one
# pass over 1 + 1 + 8 = 10 tokens. **Sample**: all three members got a token (`sampled`), R4 its
# first. **Reclaim**: nobody `finished`; nobody is `waiting`. `page_tables` shows each running
# request's pages after the step: R2 and R3 hold three pages each, R4 got one.
#
# ## 3. R4 takes R1's slot at step 31
#
# The seed tabulates the batch's members step by step. The same table, computed from the trace.
# (The seed counts decode steps, 步序（Decode）; minicb's step 1 is the prefill step, which also
# samples each request's first token, so a request of n output tokens finishes at step n either
# way.)

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
# Same story, with the engine's bookkeeping made explicit: R1's last token comes out of step 30,
# the reclaim phase of step 30 frees slot 0, and the schedule phase of step 31 hands it to R4.
# R2, the long request, is never disturbed, and the whole run ends at step 200 instead of 260.
# Where the seed writes "…" our R4, 60 tokens long, finishes at step 90 and R2 runs alone from
# 91; the seed's R4, of no stated length, is still running at 200.

# One thing the seed's picture has that this run lacks: at R3's exit it writes 再招新的请求
# (recruit a new request). Here nobody is waiting at step 81, so slot 2 stays empty. Add an R5
# (100 output tokens) that arrives at step 50, while all three slots are busy: it waits, and the
# step after R3 finishes it takes R3's slot. The text timeline below is the seed's second
# picture drawn from the run (`·` waiting, `▓` prefill, `█` decode, `|` finished).

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
# Now both policies side by side. The static run repeats chapter 02's (260 steps):

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
# This is the seed's pair of timelines (静态批处理 above, 连续批处理 below), drawn from the two
# runs. Static batching leaves hatched idle slots behind R1 and R3 and keeps R4 waiting (grey)
# until step 201; continuous batching fills R1's slot at step 31 and finishes everything 60 steps
# sooner. From the slots' point of view:

# %%
viz.plot_slots(cont, title="continuous batching: R4 takes slot 0 at step 31")

# %%
# NBVAL_CHECK_OUTPUT
for name, eng in (("static", static), ("continuous", cont)):
    r = {x.request_id: x for x in eng.request_records()}
    print(f"{name:<11} last step {eng.trace[-1].step:>3}, dead slot-steps "
          f"{metrics.dead_slot_steps(eng.trace):>3}, R4 starts at step "
          f"{r['R4'].first_scheduled_step:>3} and finishes at {r['R4'].finish_step:>3}, "
          f"R1 frees its slot after step {max(k.step for k in eng.trace for m in k.members if m.request_id == 'R1')}")
    e2e = {row["request_id"]: row["e2e_steps"] for row in metrics.per_request(eng.request_records())}
    print(f"{'':<11} end-to-end latency in steps (until the response is returned): {e2e}")

# %% [markdown]
# The last line is the seed's "短请求完成后可以立即返回结果" (a short request returns as soon as it is
# done). Under static batching R1's 30-step answer reaches its user with the batch, after 200
# steps (chapter 02), and R3's 80-step answer too; under continuous batching each is returned the
# step it finishes. R4 gains as much, 230 steps down to 60: it no longer waits for a batch to
# drain before it can start.

# %% [markdown]
# Batching should not change what a request generates: under greedy sampling every policy should
# return the tokens the request gets alone. minicb's tests check it for every policy on random
# workloads, but it is a tested property, not a bit-for-bit guarantee: with other rows beside it,
# a row's sums can run in another order and differ in the last bits (chapter 01), which could
# flip a greedy choice at a near-tie (vLLM promises bit-identical results only in its opt-in
# batch-invariant mode). Here the static and continuous runs agree token for token. R1's batch
# was the same in both runs (R1, R2, R3 for all its 30 steps), so its `True` tests nothing; R2,
# R3 and R4 had other batch-mates from step 31 on:

# %%
# NBVAL_CHECK_OUTPUT
same = {rid: static.requests[rid].output_token_ids == cont.requests[rid].output_token_ids
        for rid in ("R1", "R2", "R3", "R4")}
print("same tokens under static and continuous:", same)
assert all(same.values()), "batching changed a greedy answer"

# %% [markdown]
# Step through the continuous run: step 30 (R1 finishes), step 31 (R4 arrives and joins in the
# same step, its prefill sharing the forward with two decodes), step 80 (R3 leaves), step 91
# (R2 alone). Watch the page tables on the right: pages come and go with the requests.

# %%
# NBVAL_IGNORE_OUTPUT
viz.step_through(cont)

# %% [markdown]
# ## 4. Concurrency floats with the queue and the memory
#
# Under continuous batching the batch size is not a setting; it is whatever the queue, the slots
# and the memory allow at each step (系统的并发度…根据等待队列的长度、运行中请求的状态以及显存预算
# 自然浮动). Eight requests with varied output lengths, four slots:

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
# Static batching runs a batch of 4 only until its first member finishes, then shrinks (the dead
# slots) and refills only when the whole batch ends. Continuous batching keeps 4 busy while the
# queue has requests, and shrinks only at the end, when nothing is left to admit.
#
# Memory is the other limit. A request needs pages for its prompt to be admitted, and a page pool
# that is full keeps requests waiting even with free slots. Six requests with 40-token prompts
# (three pages each) and at most 8 output tokens (still three pages), six slots, and a pool of
# only 10 pages:

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
# With 10 pages, three requests (9 pages) fit; the other three wait, with three slots free,
# until a finished request's pages come back: each time a request leaves (reclaim), the next
# step's schedule admits whoever now fits. The light-blue hatched band ("cached") is pages the
# prefix index keeps after a
# request finishes (the first two, full, pages of its prompt): they count as available and are
# evicted, least recently used first, when an admission needs them. With the default pool all six
# run at once and the run ends at step 8 instead of 16.
#
# What if running requests *grow* past the pool, because their decodes need new pages that are
# not there? Then the engine must preempt someone: free a request's pages and recompute it later.
# Chapter 06 measures that.
#
# Memory is shared, too (the seed's 更充分的多请求复用, fuller reuse across requests). Under v1
# a prompt prefix could be reused only from a *finished* predecessor (chapter 02). Here the
# prefix index registers each full prompt page as soon as its K/V is computed, so a request
# admitted while another with the same prefix still runs maps that request's pages into its own
# page table. Two requests with the same 40-token system prompt, the second arriving at step 2
# while the first decodes:

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
# b's page table starts with a's two full prompt pages (32 tokens, `num_cached_tokens`), so b
# computes only its last 10 prompt tokens, and the step holds 4 pages for two 3-page requests.
# The third page is never shared: it is not full, and each request writes its own tokens there.
# Chapter 06 measures the gain at scale (the `shared-prefix` workload).
#
# ## 5. Which workloads gain (seed §2.5)
#
# The seed sums it up in a table:
#
# | 负载 (workload) | CB 相对静态批 (continuous vs static) |
# |---|---|
# | output lengths vary widely (chat, tool calls: some 10 tokens, some 1k) | large gain: dead slots are reclaimed often |
# | output lengths nearly equal, offline tidy batches | small gain: static is simpler and often enough |
# | very low arrival rate (often only one request running) | almost nothing to swap in: CB degenerates to one request at a time |
#
# Let us measure each row with small workloads, four slots, 16-token prompts: the varied run from
# above (eight requests, 4 to 24 tokens: the seed's "有的 10 token 有的 1k" scaled down so that a
# run takes seconds; chapter 06 runs answers of 16 to 256 tokens), eight requests of exactly 12
# tokens, and four requests of 8 tokens arriving 20 steps apart. A fourth row is the seed's §2.2
# warning, the stream of chapter 02 whose queue kept growing under static batching: forty requests
# of 2 to 12 tokens, one every 2 steps.

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
    recs = engine.request_records()
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
# Latencies are in steps, from arrival until the response is returned: the request's last token,
# except under static batching, which returns a batch's responses together when its last member
# finishes (chapter 02), as every E2E figure in this course does. The three rows of the seed's
# table, and chapter 02's high-rate stream, come out as the seed says:
#
# - **Varied lengths**: continuous batching needs far fewer steps for the same tokens (more tokens
#   per step), and the mean latency drops; static batching leaves dozens of dead slot-steps.
# - **Equal lengths**: the two policies run exactly the same schedule. Nobody finishes early, so
#   there is nothing to reclaim.
# - **Low arrival rate**: one request at a time under either policy; tokens/step is 1. Continuous
#   batching has nothing to swap in and behaves like v1.
# - **High arrival rate**: static batching's queue keeps growing while requests arrive (chapter
#   02); continuous batching hands each freed slot on at once, admits every request the step it
#   arrives (`max queue` is 0) and finishes the stream soon after the last arrival.
#
# At the seed's own scale, answers of 10 and of 1,000 tokens, a run takes 1,000 steps or more:
# minutes of the real model on this CPU. Schedules depend only on token counts, so the simulated
# executor (chapter 06: the real engine and scheduler, with a stand-in model whose steps take
# no real time) gives the real schedule exactly. Eight requests at step 1, alternately 1,000 and
# 10 tokens, four slots; latency in steps until each answer is returned:

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
               for r in sim.request_records()}
    print(f"{policy:<12}{len(sim.trace):>6}{metrics.dead_slot_steps(sim.trace):>6}  "
          + " ".join(latency[f"r{i}"] for i in range(8)))

# %% [markdown]
# Static batching runs two batches of 1,000 steps; the 10-token answers of the second batch come
# back after 2,000 steps, and 3,960 slot-steps sit dead. Continuous batching ends at step 1,020:
# a short answer leaves after ten steps and its slot goes to the next request at once. It does
# not make everyone fast: `r7`, a short one, still waits until a long request leaves a slot at
# step 1,000, since all four slots then hold 1,000-token answers. Admission order and fairness come back in
# chapter 06.
#
# Steps are exact and machine-independent. Seconds are not: they depend on what one step costs,
# and a step's cost depends on how many requests it carries. Every decode-only step of the eight
# runs above, grouped by batch size:

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
# A step costs a fixed part (reading all the weights once, running every layer) plus a part per
# request in the batch. Continuous batching saves whole *steps*: for the varied workload, 16 of
# them, and with them 16 times the fixed part. The per-request part is paid for every token under
# either policy. How much of the 1.5x gain in steps survives in seconds depends on the split
# (the fit's prediction is rough: it runs some 15 to 30% below the measured seconds, since
# it is fitted to decode-only steps while a run also holds its prefill steps and the engine's
# work around each forward; but it gets the ordering and the size of the gap about right).
# At these small batches the fixed part dominates (the fit above: tens of milliseconds a step
# against a millisecond or two per request, a slope no larger than the noise between the medians), so most
# of the gain carries over. The per-request part grows with the
# batch and with each request's context (its own attention, its row of every product): with 32
# requests of up to 768 tokens it is most of a CPU step (`bench/README.md`). On a GPU the fixed
# part is expected to dominate even more (below), and the gain in steps to carry over to seconds
# almost whole.
#
# The equal-length and low-rate workloads run *identical* schedules under both policies, so any
# gap between their two rows of seconds is noise: the machine that built this notebook was
# shared, and a run of a few seconds can land on a busy moment. Compare steps, which are exact,
# and treat single wall-clock runs with suspicion (chapter 06 does it properly).

# %%
viz.compare({"static": runs["varied", "static"][0],
             "continuous": runs["varied", "continuous"][0]})

# %% [markdown]
# The first-principle gains (第一性收益) the seed lists are both visible above: **throughput**
# (the same hardware, under the same arrival stream, finishes more tokens per unit time, because more of each step's slots do
# useful work) and the **shape of tail latency** (a short request's completion no longer depends
# on the longest output in its batch; it starts as soon as any slot frees up).
#
# On a GPU everything here grows: a decode step of many requests costs little more than a step
# of one (on an H200, SmolLM2's static batches, 16 slots with 8.7 requests live on average, took
# 2.0 ms a decode step against 1.6 ms for one request: the TPOT of static and single in chapter
# 07's second GPU check; for a model that small the step is a few hundred tiny kernels, for a
# large one reading the weights, which was not measured), so
# the gap between a full batch and a half-dead one is worth far more than on two CPU cores, and
# real servers keep hundreds of requests in flight.
#
# One thing continuous batching as built here does not fix. A new request's whole prompt is
# prefilled inside one step, alongside every running decode. An 8-token prompt costs nothing; a
# 2,000-token prompt makes that one step long, and every decode in the batch waits for it (the
# seed's 问题一, problem one). Chapter 04 cuts prompts into chunks. So continuous batching does not
# always lower latency (the benchmark contract's FAQ: 连续批处理一定会降低延迟吗？不会): a long
# prefill, or admitting more than the memory and the budget can carry, raises queue time, TTFT
# and ITL; chapter 06 measures that under load.
#
# ## Recap
#
# - Continuous batching (iteration-level scheduling) re-decides the batch before every forward.
#   One step is schedule → forward → sample → reclaim (`Engine.step`), recorded as a `StepRecord`.
# - In the R1..R4 example R1 finishes at step 30, its slot is reclaimed in the same step, and R4
#   takes it at step 31. Nothing idles; the run ends at step 200 instead of 260, with 0 dead
#   slot-steps instead of 290.
# - Concurrency is not fixed: it follows the queue (batches shrink only when nothing waits) and
#   the memory (with 10 pages, three 3-page requests at a time).
# - Running requests share prefix pages: b, arriving while a decodes, found a's two full prompt
#   pages in the prefix index (32 tokens), so the two 3-page requests held 4 pages.
# - It gains most when output lengths vary, nothing when they are equal (and arrive together),
#   and nothing when
#   arrivals are so sparse that requests never overlap, as the seed's table says. (A random
#   stream at a low rate still overlaps now and then, and then a newcomer no longer waits for a
#   batch to end: `bench/README.md`'s run at 0.5 requests/s, TTFT p99 0.18 s against static's
#   1.48 s: a static server returns the answer with its batch, so its TTFT is its E2E; its
#   first token was computed after 0.82 s.)
#
# **Exercises:**
# [`exercises/03_continuous_batching.ipynb`](../exercises/03_continuous_batching.ipynb): predict
# each request's finish step under continuous batching by hand (3.1, checked against the engine),
# then write the continuous scheduler as a `minicb.Scheduler` subclass (decodes first, then admit
# while slots and pages allow) and run the R1..R4 example through it (3.2).
#
# **Try it** (no checker): rebuild the batch table above for a workload of your own, and find the
# smallest `num_pages` at which the varied workload still runs four at a time.
