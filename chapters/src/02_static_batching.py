# %% [markdown]
# # 02 · Static batching and its dead slots
#
# v1 serves one request at a time. This chapter puts it under concurrent load, measures what goes
# wrong, and tries the first fix, **静态批处理 static batching**: run several requests together as
# one batch. It helps, but a static batch starts together and ends together, and the seed's
# R1/R2/R3 example shows how much that costs.
#
# **After this chapter you will be able to**
#
# - measure v1's three problems under concurrency: throughput, 尾延迟 tail latency, and an idle
#   页池 page pool;
# - write a static-batch loop on plain lists, predict its schedule, and check it against minicb's
#   `static` policy on the real model;
# - draw and count the dead 槽位 slots of the R1/R2/R3 example (170 dead slot-steps for R1, 120 for
#   R3) and see R4 locked out until step 201;
# - explain request-level dynamic batching (`batch_timeout`) and when static batching is good
#   enough.

# %%
# NBVAL_IGNORE_OUTPUT
%matplotlib inline
import time

import numpy as np

from minicb import LLM, SamplingParams
from minicb.course import viz
from minicb.model.loader import load_model
from minicb.benchmark.workload import random_prompt

model = load_model("smollm2-135m")  # loaded once, shared by every engine below


def run(policy, requests, **options):
    """Run `requests` = [(id, prompt_len, output_len, arrival_step)] under `policy`.
    Greedy with ignore_eos: every request generates exactly output_len tokens, so the schedule
    never depends on the generated text. Returns the engine and the wall-clock seconds."""
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


def finish_steps(engine):
    return {r.request_id: r.finish_step for r in engine.request_records()}

# %% [markdown]
# Time is counted in **engine steps**: one step is one forward of the model over the current
# batch. A request whose prompt is prefilled at step `s` gets its first token at step `s` and one
# more token per step after that, so a request generating 30 tokens alone finishes at step
# `s + 29`.
#
# ## 1. v1 under concurrency (seed §1.1)
#
# ### Throughput: serial decodes add up
#
# Four requests arrive together, each wanting 24 tokens. v1 (`policy="single"`) serves them one
# after another; a static batch of four serves them side by side.

# %%
# NBVAL_CHECK_OUTPUT
four = [(f"q{i}", 16, 24, 1) for i in range(4)]
serial, t_serial = run("single", four)
batched, t_batched = run("static", four, max_num_seqs=4)
print(f"{'policy':<8}{'steps':>6}{'tokens':>7}{'tokens/step':>12}  finish steps")
for name, eng in (("single", serial), ("static", batched)):
    tokens = sum(len(r.output_token_ids) for r in eng.requests.values())
    print(f"{name:<8}{eng.trace[-1].step:>6}{tokens:>7}{tokens / len(eng.trace):>12.1f}  "
          f"{finish_steps(eng)}")

# %% [markdown]
# v1 needs 96 steps for 96 tokens; the batch needs 24. That would not matter if a step of four
# decodes cost four times a step of one. It does not: a decode step is dominated by reading the
# weights (chapter 01), which the whole batch shares.

# %%
# NBVAL_IGNORE_OUTPUT
def decode_step_seconds(engine):
    return float(np.median([r.duration for r in engine.trace
                            if r.members and r.num_prefill_tokens == 0]))


s1, s4 = decode_step_seconds(serial), decode_step_seconds(batched)
print(f"median decode step: batch of 1 {s1 * 1000:.0f} ms, batch of 4 {s4 * 1000:.0f} ms "
      f"({s4 / s1:.2f}x the time for 4x the tokens)")
print(f"wall clock: single {t_serial:.1f} s = {96 / t_serial:.1f} tokens/s, "
      f"static {t_batched:.1f} s = {96 / t_batched:.1f} tokens/s")

# %% [markdown]
# The seed: "若多个请求只能串行执行，则多个请求的 Decode 时间在墙钟时间上近似累加" (run serially,
# the requests' decode times simply add up). On a GPU the effect should be much larger: a decode
# step of dozens of requests is expected to cost barely more than a step of one, since reading
# the weights dominates (an expectation, not a measurement: no run in this course times a GPU
# decode step at different batch sizes).
#
# ### Tail latency: a short request behind a long one
#
# One long request (64 tokens) arrives just ahead of three short ones (8 tokens each). Alone, a
# short request would finish in 8 steps.

# %%
# NBVAL_CHECK_OUTPUT
long_short = [("long", 16, 64, 1)] + [(f"short{i}", 16, 8, 1) for i in range(3)]
v1, t_v1 = run("single", long_short)
print(f"{'request':<8}{'tokens':>7}{'finishes at step':>18}{'alone it would take':>21}")
for r in v1.request_records():
    print(f"{r.request_id:<8}{r.num_output_tokens:>7}{r.finish_step:>18}{r.num_output_tokens:>21}")

# %%
# NBVAL_IGNORE_OUTPUT
for r in v1.request_records():
    print(f"{r.request_id:<8} end-to-end {r.finish_time - r.arrival_time:5.2f} s")

# %% [markdown]
# The last short request waits 80 steps for 8 steps of work: its latency is set by the long
# request, not by itself. That is the seed's 尾延迟恶化 (tail latency gets worse): the slowest
# few percent of responses are the ones stuck behind long ones.
#
# ### The page pool sits mostly empty
#
# Paging lets many sequences share one pool, and the prefix index lets them share prefixes. Under
# v1 only one request holds pages at any step:

# %%
# NBVAL_CHECK_OUTPUT
for name, eng in (("single, 4 x 24 tokens", serial), ("single, long + 3 short", v1)):
    print(f"{name:<24} most pages in use: {max(r.pages_used for r in eng.trace)} of "
          f"{eng.pool.num_pages}; requests holding pages at once: "
          f"{max(len(r.page_tables) for r in eng.trace)}")

# %% [markdown]
# The memory that would let dozens of requests run together is idle, and cross-request sharing
# of a prefix can only happen between a request and its *finished* predecessors.
#
# ## 2. Static batching (seed §1.2, §2.2)
#
# The classic fix (早期推理服务系统): collect a batch of up to B requests, prefill them all, decode
# them all together, and release the batch only when **every** member has finished; then form the
# next batch. Its 调度粒度 scheduling granularity is the whole batch.
#
# Here it is on plain lists: requests are `{id: (tokens to generate, arrival step)}`, and each
# request's `(start, finish, batch end)` steps come out.

# %%
def toy_static(requests, batch_size):
    waiting = sorted(requests, key=lambda r: requests[r][1])  # first come, first served
    out, step = {}, 0
    while waiting:
        step = max(step + 1, requests[waiting[0]][1])  # next step a batch can form
        batch = [r for r in waiting if requests[r][1] <= step][:batch_size]
        end = step + max(requests[r][0] for r in batch) - 1  # the slowest member decides
        for r in batch:
            out[r] = (step, step + requests[r][0] - 1, end)
            waiting.remove(r)
        step = end
    return out

# %% [markdown]
# The seed's example: R1, R2 and R3 need 30, 200 and 80 tokens and start together; R4 arrives
# at step 31. The seed gives R4 no length (its continuous-batching picture draws R4 still
# running at step 200);
# the course gives it 60 tokens, so that its whole life fits in the pictures.

# %%
# NBVAL_CHECK_OUTPUT
example = {"R1": (30, 1), "R2": (200, 1), "R3": (80, 1), "R4": (60, 31)}
toy = toy_static(example, batch_size=3)
print(f"{'request':<8}{'start':>6}{'finish':>7}{'batch ends':>11}{'dead slot-steps':>16}")
for rid, (start, finish, end) in toy.items():
    print(f"{rid:<8}{start:>6}{finish:>7}{end:>11}{end - finish:>16}")

# %% [markdown]
# Now the real thing: minicb's `static` policy (`StaticScheduler` in `minicb/scheduler.py`) on
# SmolLM2, three slots (`max_num_seqs=3`), and the same example from `minicb.benchmark.workload`
# (8-token prompts). This is the slowest run of the chapter: 260 steps, 10–20 s on two CPU cores
# (the cell prints its own time).

# %%
# NBVAL_IGNORE_OUTPUT
from minicb.benchmark.workload import run_workload, seed_r1_r4

workload = seed_r1_r4(r4_output=60)
static = LLM(model, policy="static", max_num_seqs=3).engine
t0 = time.perf_counter()
run_workload(static, workload)
t_static = time.perf_counter() - t0
print(f"{len(static.trace)} steps in {t_static:.1f} s")

# %% [markdown]
# A trace is plain data, so the same table comes straight from it: a finished member of a static
# batch still appears in every step's record, as an `idle` member holding its slot.

# %%
# NBVAL_CHECK_OUTPUT
records = {r.request_id: r for r in static.request_records()}
last_held = {}  # request -> last step it held its slot (busy or idle)
dead = {rid: 0 for rid in records}
for rec in static.trace:
    for m in rec.members:
        last_held[m.request_id] = rec.step
        dead[m.request_id] += m.kind == "idle"
print(f"{'request':<8}{'arrives':>8}{'start':>6}{'finish':>7}{'slot held until':>16}"
      f"{'dead slot-steps':>16}{'released':>9}")
for rid, r in records.items():
    print(f"{rid:<8}{r.arrival_step:>8}{r.first_scheduled_step:>6}{r.finish_step:>7}"
          f"{last_held[rid]:>16}{dead[rid]:>16}{r.released_step:>9}")
engine_view = {rid: (r.first_scheduled_step, r.finish_step, last_held[rid])
               for rid, r in records.items()}
print("same as the toy loop:", engine_view == toy)

# %%
# NBVAL_CHECK_OUTPUT
from minicb.benchmark import metrics

busy = sum(m.num_tokens > 0 for rec in static.trace[:200] for m in rec.members)
print(f"dead slot-steps in the whole run: {metrics.dead_slot_steps(static.trace)}")
print(f"first batch, steps 1-200: {busy} busy slot-steps of {3 * 200} held "
      f"({busy / 600:.0%} of the batch did useful work)")
print(f"R4 waited from step {records['R4'].arrival_step} to step "
      f"{records['R4'].first_scheduled_step}: {records['R4'].first_scheduled_step - records['R4'].arrival_step} steps in the queue")

# %% [markdown]
# The seed's three problems, now counted:
#
# 1. **已完成请求占用资源, finished requests hold resources.** R1 is done at step 30 but its
#    slot stays in the batch until step 200: 170 dead slot-steps. R3 adds 120 more. Over the
#    batch's 200 steps only about half of the slot-steps produced a token.
# 2. **短请求受长请求阻塞, short requests are held by long ones.** R1's tokens exist at step 30,
#    but a static server returns the batch whole (as `model.generate` on a padded batch does):
#    R1's response, like its slot, is released only with the batch at step 200, the batch's
#    lifetime `max(R1, R2, R3) = 200`. minicb records both moments, `finish_step` 30 and
#    `released_step` 200 (the `released` column), and end-to-end latency counts to the release:
#    R1's user waits 200 steps for a 30-step answer, and every static E2E figure in the course
#    includes that wait.
# 3. **新请求无法及时加入, new requests cannot join.** R4 arrives at step 31, next to an idle
#    slot, and waits 170 steps for the batch to end.
#
# The seed goes on: "当请求到达率较高时，等待队列会持续增长" (when requests arrive fast, the waiting
# queue keeps growing). Forty short requests, of 2 to 12 tokens, arrive one every 2 steps at four
# slots. On average they need fewer slots than there are (the first line below), so the slots
# could carry this load:

# %%
# NBVAL_CHECK_OUTPUT
stream_lengths = [2, 12, 4, 10, 2, 6, 12, 4] * 5
stream = [(f"q{i}", 16, n, 1 + 2 * i) for i, n in enumerate(stream_lengths)]
flood, _ = run("static", stream, max_num_seqs=4)
queue = {rec.step: rec.num_waiting for rec in flood.trace}
waits = [r.first_scheduled_step - r.arrival_step for r in flood.request_records()]
print(f"slots busy on average if each were handed on at once: "
      f"{np.mean(stream_lengths) / 2:.2f} of 4")
print(f"{'step':<14}" + "".join(f"{s:>4}" for s in range(10, 130, 10)))
print(f"{'queue length':<14}" + "".join(f"{queue[s]:>4}" for s in range(10, 130, 10)))
print(f"last arrival at step {stream[-1][3]}, last finish at step {flood.trace[-1].step}; "
      f"queue wait mean {np.mean(waits):.1f} steps, max {max(waits)}")

# %% [markdown]
# The queue grows for as long as requests keep coming, and drains only after the last one has
# arrived. Each batch lives as long as its longest member, mostly 10 to 12 steps, while short
# members sit finished in their slots: static batching serves about four requests every 11
# steps, while five or six arrive. The shortage is not in the slots but in how they are handed
# on. Chapter 03 runs the same stream under continuous batching.
#
# Back to R1-R4: the picture makes their run plain. Hatched cells are idle slots: finished,
# still held.

# %%
viz.plot_timeline(static, title="static batching: R1, R2, R3 together; R4 waits")

# %% [markdown]
# The same run seen from the slots: each row is one of the three batch slots, labelled by who
# holds it.

# %%
viz.plot_slots(static, title="static batching: who holds each slot")

# %% [markdown]
# And as text, the way the seed draws it (each column is several steps; `░` an idle slot, `·`
# waiting in the queue):

# %%
# NBVAL_CHECK_OUTPUT
print(viz.render_text(static, width=80))

# %% [markdown]
# Step through the run yourself: move the slider to step 30 (R1 finishes), 31 (R4 arrives and
# waits; R1's slot is idle), 80 (R3 finishes) and 201 (the batch is gone and R4 finally starts).
# The right-hand panel shows the queue and each running request's page table at that step.

# %%
# NBVAL_IGNORE_OUTPUT
viz.step_through(static)

# %% [markdown]
# Note what the pages did: R1's and R3's pages went back to the pool when they finished (the
# engine reclaims memory at once), but their *slots* did not. Under static batching the slot,
# not the memory, is what keeps R4 out.
#
# That makes minicb's static batching the **best case** for static batching. The seed's static
# server also keeps the finished request's memory until the batch ends, and its idle slots
# "填充无效数据…或参与无实际意义的重复计算" (hold padding, or take part in meaningless
# recomputation): a padded `[B, L]` tensor computes every row every step. Here an idle member
# costs no compute and no memory, only its slot. Every gap the next chapter measures between
# static and continuous batching would be larger on a classic static server. Hugging Face
# transformers' `generate` on a left-padded batch is one: on the standard mixed workload of
# `python -m minicb bench` (the tool of chapter 06: 32 chat requests, batches of 32, the same
# model, `--compare hf`) it produced
# 55.6 output tokens/s where minicb's `static` produced 187.8 (`bench/README.md`), though padding
# is only part of that gap; the rest is each library's own cost per step.
#
# What would the padded rows cost here? Chapter 06's step-cost model (`bench/cost_model_cpu.json`)
# prices a step from its shape: a fixed cost, so much per prefill token, per decode row, per
# token of context read. It was fitted on one of the course's build machines on 2026-11-29 (an
# AMD EPYC; its `source` line says so), not necessarily the one running this notebook, so its
# seconds are not the run above's: the ratio is the result. Price the schedule minicb ran, then
# again with every idle slot-step computed as a padded row would be: one more decode row,
# reading its request's context, which keeps growing since a padded row keeps producing tokens
# nobody reads.

# %%
# NBVAL_CHECK_OUTPUT
from minicb.benchmark.sim import CostModel, step_features

cpu_cost = CostModel.load("cpu")
as_run = cpu_cost.predict_features(step_features(static.trace, records.values())).sum()
idle_rows = idle_context = 0
for rec in static.trace:
    for m in rec.members:
        if m.kind == "idle":
            r = records[m.request_id]
            idle_rows += 1
            idle_context += r.num_prompt_tokens + r.num_output_tokens + rec.step - r.finish_step
padded = as_run + cpu_cost.c * idle_rows + cpu_cost.d * idle_context
print(f"cost model: {cpu_cost.source}")
print(f"the schedule minicb ran, priced by the model: {as_run:.2f} s")
print(f"with {idle_rows} padded rows computed: {padded:.2f} s, {padded / as_run - 1:.0%} more, "
      f"for no token anyone reads")

# %% [markdown]
# About a tenth more time for nothing, on top of the slots held: the compute the seed's
# "无实际意义的重复计算" (meaningless recomputation) costs in this example. The figure is the cost
# model's (chapter 06 shows how it is fitted and how well it predicts), not a run of a padded
# server.
#
# ## 3. Request-level dynamic batching
#
# Static batching has a second knob to turn: **when** to form a batch. Forming one as soon as any
# request waits (as above) launches small batches; waiting longer fills them. Request-level
# dynamic batching (as in Triton Inference Server and TF Serving) forms a batch when `max_num_seqs`
# requests wait **or** the oldest has waited `batch_timeout` steps (or seconds, with
# `batch_timeout_in_seconds=True`). Once formed, the batch is static again. The seed's step 1,
# 等待并收集一批请求 (wait and collect a batch of B), is this policy with no timeout: wait until B
# requests are there; minicb's `static` is the other end, a batch as soon as anyone waits.
#
# Five requests of 8 tokens trickle in at steps 1, 2, 4, 14 and 15; four slots.

# %%
# NBVAL_IGNORE_OUTPUT
trickle = [("A", 16, 8, 1), ("B", 16, 8, 2), ("C", 16, 8, 4), ("D", 16, 8, 14),
           ("E", 16, 8, 15)]
eager, _ = run("static", trickle, max_num_seqs=4)
patient, _ = run("dynamic", trickle, max_num_seqs=4, batch_timeout=4)
full, _ = run("dynamic", trickle, max_num_seqs=3, batch_timeout=4)  # 3 slots: the size trigger
forever, _ = run("dynamic", trickle, max_num_seqs=4, batch_timeout=1000)  # "wait for B"

# %%
# NBVAL_CHECK_OUTPUT
def batches(engine):
    """(first step, members) of each batch: a batch starts when its members prefill together."""
    out = []
    for rec in engine.trace:
        started = [m.request_id for m in rec.members if m.kind == "prefill"]
        if started:
            out.append((rec.step, started))
    return out


for name, eng in (("static", eager), ("dynamic, batch_timeout=4", patient),
                  ("dynamic, batch_timeout=4, 3 slots", full),
                  ("dynamic, batch_timeout=1000 (wait for 4)", forever)):
    latency = {r.request_id: metrics.released(r)[1] - r.arrival_step + 1
               for r in eng.request_records()}
    print(f"{name}: batches {batches(eng)}, last finish at step {eng.trace[-1].step}")
    print(f"    latency in steps {latency}, mean {np.mean(list(latency.values())):.1f}")

# %%
viz.compare({"static (form at once)": eager, "dynamic (batch_timeout=4)": patient})

# %% [markdown]
# The dynamic policy held A back four steps so that B and C could join it: one batch of three
# instead of a batch of one and a batch of two. A pays 4 steps, B and C gain, and D and E pay
# one step each (static started them at step 17, when B and C's batch ended; the timeout holds D
# to step 18, four steps after it came, hoping for more); the mean latency
# barely moves, and the batches are fuller. That trade-off (a timeout against batch fill) is all
# request-level batching can offer: once a batch starts, it still lives until its slowest member
# ends. The timeout chooses *when* to lock the door, not whether.
#
# The other trigger is size. With 3 slots, the batch forms at step 4, the step C makes three
# waiting, one step before A's timeout would have fired; D and E, two of three, still wait for
# the timeout (step 18). And the seed's step 1 taken literally, wait until B requests are there
# (here a timeout of 1,000 steps stands for "never"): A, B and C wait for D (A for 13 steps),
# and E, the fifth, waits alone for a batch of four that never fills, 1,000 steps, until the
# timeout.
# That is why request-level batchers always pair the size with a timeout, and why the timeout's
# value is a latency promise: it is the longest a lone request can wait before it starts.
#
# ## 4. When static batching is good enough
#
# Look back at the throughput run: four requests of exactly 24 tokens.

# %%
# NBVAL_CHECK_OUTPUT
print(f"equal lengths: {metrics.dead_slot_steps(batched.trace)} dead slot-steps, "
      f"every member finishes at step {set(finish_steps(batched).values())}")
print(f"R1/R2/R3:      {metrics.dead_slot_steps(static.trace)} dead slot-steps")

# %% [markdown]
# With equal output lengths nobody finishes early, so nothing idles and nobody waits on a
# slower neighbour. The seed's verdict: 静态批处理适合请求长度相近、负载稳定的离线场景 (static batching
# suits offline jobs with similar lengths and a steady load) and struggles with online serving,
# where output lengths vary by orders of magnitude (a 10-token tool call next to a 1,000-token
# essay) and requests arrive at random times. Where it fits, static batching has the merit of
# simplicity: a batch's membership and shape never change during its life.
#
# ## Recap
#
# - v1 under concurrency: decode times add up (96 steps for four 24-token requests against 24
#   batched), short requests queue behind long ones (the last 8-token request finished at step
#   88), and the page pool is nearly empty.
# - A static batch starts together and ends with its slowest member. In the R1/R2/R3 example that
#   is 170 dead slot-steps for R1 and 120 for R3, half the batch's capacity, and R4 waiting from
#   step 31 to step 201. minicb's idle slots cost no compute; a padded server's would, 11% more
#   time here by the CPU's step-cost model.
# - Request-level dynamic batching only decides when a batch forms (`max_num_seqs` waiting, or
#   `batch_timeout`); the batch is still static. Waiting for a full batch with no timeout left
#   the fifth request waiting 1,000 steps: the timeout is the promise to a lone request.
# - All of this comes from the batch being the unit of scheduling. Chapter 03 makes the unit a
#   single step.
#
# **Exercises:** [`exercises/02_static_batching.ipynb`](../exercises/02_static_batching.ipynb):
# form a static batch from the front of the waiting queue under the slot limit and the free pages
# (`form_static_batch`, exercise 2.1), then watch your function form the batches of the R1..R4 example in the real
# engine; then predict from output lengths and arrival steps the step at which each request
# finishes under static batching (`static_finish_steps`, checked against the real engine on the
# R1..R4 example and on random workloads).
#
# **Try this (not graded):** rerun section 3's trickle of requests with other `batch_timeout`
# values and find the one that minimises their mean latency.
