# %% [markdown]
# # 02 · Static batching and its dead slots
#
# v1 serves one request at a time. This chapter puts it under concurrent load and measures what goes wrong.
# Then it tries the first fix, **静态批处理 static batching**: run several requests together as one batch.
# It helps, but a static batch starts together and ends together. The seed's R1/R2/R3 example shows the cost.
#
# **After this chapter you will be able to**
#
# - measure v1's three problems under load: throughput, 尾延迟 tail latency, and an idle 页池 page pool;
# - write a static-batch loop on plain lists and check it against minicb's `static` policy;
# - count the dead 槽位 slots of the R1/R2/R3 example and see R4 locked out until step 201;
# - explain request-level dynamic batching (`batch_timeout`) and when static batching is good enough.

# %%
# NBVAL_IGNORE_OUTPUT
%matplotlib inline
import time

import numpy as np

from minicb import LLM, SamplingParams
from minicb.course import viz
from minicb.model.loader import load_model
from minicb.benchmark.metrics import request_records
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
    return {r.request_id: r.finish_step for r in request_records(engine)}

# %% [markdown]
# Time is counted in **engine steps**: one step is one forward over the current batch.
# A request prefilled at step `s` gets its first token at step `s` and one more each step after.
# So a request of 30 tokens alone finishes at step `s + 29`.
#
# ## 1. v1 under concurrency (seed §1.1)
#
# ### Throughput: serial decodes add up
#
# Four requests arrive together, each wanting 24 tokens. v1 serves them one after another; a static batch of four serves them side by side.

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
# v1 needs 96 steps for 96 tokens; the batch needs 24.
# That matters because a step of four decodes costs far less than four steps of one.
# A decode step is dominated by reading the weights (chapter 01), which the whole batch shares:

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
# The seed: "若多个请求只能串行执行，则多个请求的 Decode 时间在墙钟时间上近似累加" (run serially, the requests' decode times add up).
#
# ### Tail latency: a short request behind a long one
#
# One long request (64 tokens) arrives just ahead of three short ones (8 tokens each).

# %%
# NBVAL_CHECK_OUTPUT
long_short = [("long", 16, 64, 1)] + [(f"short{i}", 16, 8, 1) for i in range(3)]
v1, t_v1 = run("single", long_short)
print(f"{'request':<8}{'tokens':>7}{'finishes at step':>18}{'alone it would take':>21}")
for r in request_records(v1):
    print(f"{r.request_id:<8}{r.num_output_tokens:>7}{r.finish_step:>18}{r.num_output_tokens:>21}")

# %%
# NBVAL_IGNORE_OUTPUT
for r in request_records(v1):
    print(f"{r.request_id:<8} end-to-end {r.finish_time - r.arrival_time:5.2f} s")

# %% [markdown]
# The last short request waits 80 steps for 8 steps of work. Its latency is set by the long request, not by itself.
# That is the seed's 尾延迟恶化 (tail latency gets worse).
#
# ### The page pool sits mostly empty
#
# Under v1 only one request holds pages at any step:

# %%
# NBVAL_CHECK_OUTPUT
for name, eng in (("single, 4 x 24 tokens", serial), ("single, long + 3 short", v1)):
    print(f"{name:<24} most pages in use: {max(r.pages_used for r in eng.trace)} of "
          f"{eng.pool.num_pages}; requests holding pages at once: "
          f"{max(len(r.page_tables) for r in eng.trace)}")

# %% [markdown]
# The memory that would let dozens of requests run together sits idle.
#
# ## 2. Static batching (seed §1.2, §2.2)
#
# The classic fix: collect up to B requests, prefill them all, decode them together.
# Release the batch only when **every** member has finished; then form the next.
# Its 调度粒度 scheduling granularity is the whole batch.
#
# Here it is on plain lists. Requests are `{id: (tokens to generate, arrival step)}`; out come `(start, finish, batch end)` steps.

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
# The seed's example: R1, R2 and R3 need 30, 200 and 80 tokens and start together; R4 arrives at step 31.
# The seed gives R4 no length; the course gives it 60 tokens so its whole life fits in the pictures.

# %%
# NBVAL_CHECK_OUTPUT
example = {"R1": (30, 1), "R2": (200, 1), "R3": (80, 1), "R4": (60, 31)}
toy = toy_static(example, batch_size=3)
print(f"{'request':<8}{'start':>6}{'finish':>7}{'batch ends':>11}{'dead slot-steps':>16}")
for rid, (start, finish, end) in toy.items():
    print(f"{rid:<8}{start:>6}{finish:>7}{end:>11}{end - finish:>16}")

# %% [markdown]
# Now minicb's `static` policy (`StaticScheduler` in `minicb/scheduler.py`) on SmolLM2, with three slots and the same example.
# This is the chapter's slowest run (260 steps); the cell prints its time.

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
# The same table comes straight from the trace. A finished member of a static batch stays in every step's record as an `idle` member holding its slot.

# %%
# NBVAL_CHECK_OUTPUT
records = {r.request_id: r for r in request_records(static)}
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
# 1. **已完成请求占用资源, finished requests hold resources.** R1 is done at step 30, but its slot stays until step 200: 170 dead slot-steps. R3 adds 120 more.
# 2. **短请求受长请求阻塞, short requests are held by long ones.** A static server returns the batch whole, so R1's answer is released at step 200. minicb records both moments, `finish_step` 30 and `released_step` 200. End-to-end latency counts to the release.
# 3. **新请求无法及时加入, new requests cannot join.** R4 arrives at step 31, next to an idle slot, and waits 170 steps.
#
# The seed goes on: "当请求到达率较高时，等待队列会持续增长" (when requests arrive fast, the queue keeps growing).
# Forty short requests of 2 to 12 tokens arrive one every 2 steps at four slots.
# On average they need fewer slots than there are (the first line below):

# %%
# NBVAL_CHECK_OUTPUT
stream_lengths = [2, 12, 4, 10, 2, 6, 12, 4] * 5
stream = [(f"q{i}", 16, n, 1 + 2 * i) for i, n in enumerate(stream_lengths)]
flood, _ = run("static", stream, max_num_seqs=4)
queue = {rec.step: rec.num_waiting for rec in flood.trace}
waits = [r.first_scheduled_step - r.arrival_step for r in request_records(flood)]
print(f"slots busy on average if each were handed on at once: "
      f"{np.mean(stream_lengths) / 2:.2f} of 4")
print(f"{'step':<14}" + "".join(f"{s:>4}" for s in range(10, 130, 10)))
print(f"{'queue length':<14}" + "".join(f"{queue[s]:>4}" for s in range(10, 130, 10)))
print(f"last arrival at step {stream[-1][3]}, last finish at step {flood.trace[-1].step}; "
      f"queue wait mean {np.mean(waits):.1f} steps, max {max(waits)}")

# %% [markdown]
# Yet the queue grows for as long as requests keep coming.
# Each batch lives as long as its longest member, while short members sit finished in their slots.
# The shortage is not in the slots but in how they are handed on. Chapter 03 runs the same stream under continuous batching.
#
# Back to R1–R4. Hatched cells are idle slots: finished, still held.

# %%
viz.plot_timeline(static, title="static batching: R1, R2, R3 together; R4 waits")

# %% [markdown]
# The same run from the slots' side: each row is one batch slot, labelled by who holds it.

# %%
viz.plot_slots(static, title="static batching: who holds each slot")

# %% [markdown]
# And as text, the way the seed draws it (`░` an idle slot, `·` waiting in the queue):

# %%
# NBVAL_CHECK_OUTPUT
print(viz.render_text(static, width=80))

# %% [markdown]
# Step through the run: move the slider to step 30 (R1 finishes), 31 (R4 arrives and waits), 80 (R3 finishes) and 201 (R4 starts).
# The right-hand panel shows the queue and each running request's page table.

# %%
# NBVAL_IGNORE_OUTPUT
viz.step_through(static)

# %% [markdown]
# R1's and R3's pages went back to the pool when they finished; their *slots* did not.
# Under static batching the slot, not the memory, keeps R4 out.
#
# So minicb's static batching is the **best case**. The seed's static server also computes the idle rows: "填充无效数据…或参与无实际意义的重复计算" (padding, or meaningless recomputation).
# What would those padded rows cost? Chapter 06's step-cost model (`bench/cost_model_cpu.json`) prices a step from its shape.
# Price the schedule minicb ran, then again with every idle slot-step computed as a padded decode row:

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
print(f"the schedule minicb ran, priced by the model: {as_run:.2f} s")
print(f"with {idle_rows} padded rows computed: {padded:.2f} s, {padded / as_run - 1:.0%} more, "
      f"for no token anyone reads")

# %% [markdown]
# The printed share is the time a padded server would spend for no token anyone reads.
# It is the cost model's estimate (chapter 06 fits it), not a run of a padded server.
#
# ## 3. Request-level dynamic batching
#
# Static batching has a second knob: **when** to form a batch.
# Request-level dynamic batching (Triton Inference Server, TF Serving) forms one when `max_num_seqs` requests wait **or** the oldest has waited `batch_timeout` steps.
# Once formed, the batch is static again. The seed's step 1, 等待并收集一批请求 (wait and collect a batch), is this with no timeout.
#
# Five requests of 8 tokens trickle in at steps 1, 2, 4, 14 and 15, with four slots.

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
               for r in request_records(eng)}
    print(f"{name}: batches {batches(eng)}, last finish at step {eng.trace[-1].step}")
    print(f"    latency in steps {latency}, mean {np.mean(list(latency.values())):.1f}")

# %%
viz.compare({"static (form at once)": eager, "dynamic (batch_timeout=4)": patient})

# %% [markdown]
# The dynamic policy held A back four steps so that B and C could join it: one batch of three instead of two small ones.
# A pays 4 steps, B and C gain, and the mean latency barely moves.
# The timeout chooses *when* to lock the door, not whether: the batch still lives until its slowest member ends.
#
# With 3 slots the size trigger fires at step 4, when C makes three waiting.
# Taken literally, "wait for B requests" (a timeout of 1,000 steps) leaves E waiting alone for 1,000 steps.
# So request-level batchers pair the size with a timeout. The timeout is a latency promise to a lone request.
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
# With equal lengths nobody finishes early, so nothing idles.
# The seed's verdict: 静态批处理适合请求长度相近、负载稳定的离线场景 (static batching suits offline jobs with similar lengths and steady load).
# Online serving has neither: a 10-token tool call sits next to a 1,000-token essay.
#
# ## Recap
#
# - v1 under load: decode times add up (96 steps against 24 batched), and short requests queue behind long ones.
# - A static batch ends with its slowest member. R1/R2/R3 leave 290 dead slot-steps, and R4 waits from step 31 to 201.
# - minicb's idle slots cost no compute; a padded server's would.
# - Request-level dynamic batching only decides when a batch forms. The timeout is a promise to a lone request.
# - All of this comes from the batch being the unit of scheduling. Chapter 03 makes the unit a single step.
#
# **Exercises:** [`exercises/02_static_batching.ipynb`](../exercises/02_static_batching.ipynb): form a static batch from the waiting queue (2.1), then predict each request's finish step under static batching (2.2).
#
# **Try this (not graded):** rerun section 3's trickle with other `batch_timeout` values and find the one with the lowest mean latency.
