# %% [markdown]
# # 04 · Chunked prefill
#
# Chapter 03's continuous batching admits a new request's **whole prompt** in one step.
# With chat-sized prompts that is harmless; with a long prompt it is not.
# The seed's section 3 names two problems, and this chapter measures both on the real model.
#
# **After this chapter you will be able to**
#
# - measure **问题一, problem one**: one long prompt in a single step stretches it, and every running decode waits (队头阻塞 head-of-line blocking);
# - cut a prompt into chunks under `chunk_size` and `max_num_batched_tokens` (the step's token 预算 budget), and predict them by hand;
# - compute **dec@P** from a trace and show **问题二, problem two**: a prefill-first scheduler with chunks still stops every decode (dec@P = 0).

# %%
# NBVAL_IGNORE_OUTPUT
%matplotlib inline
import time

import matplotlib.pyplot as plt
import numpy as np

from minicb.course import viz
from minicb.engine import Engine
from minicb.benchmark.metrics import long_prefill_metrics, request_records
from minicb.model.loader import load_model
from minicb.benchmark.workload import get_workload, run_workload

viz.use_course_style()  # projector-sized fonts for this chapter's own plots too

model = load_model("smollm2-135m")  # (weights, info), loaded once and shared by every engine

# %% [markdown]
# ## The scenario: three chats and one long document
#
# The `long-prefill` workload: three short requests (16-token prompts, 24 output tokens) start at step 1.
# At step 4 a document of 800 tokens arrives and wants 4 output tokens.
# The seed talks about 2,000 tokens; 800 keeps the CPU run short and shows the same thing.
# Sampling is greedy with `ignore_eos`, so every schedule is exact.

# %%
# NBVAL_CHECK_OUTPUT
workload = get_workload("long-prefill", long_prompt_len=800, num_short=3, short_prompt_len=16,
                        short_output=24, long_output=4, long_arrival_step=4)
for key, value in workload.declaration.items():
    print(f"{key:>22}: {value}")

# %% [markdown]
# A helper prints a schedule, one line per step. `long[128]` is a 128-token prefill chunk of `long`; a bare name is one decode token.

# %%
def label(m):
    return f"{m.request_id}[{m.num_tokens}]" if m.kind == "prefill" else m.request_id


def show_steps(engine, steps=None):
    print(f"{'step':>4} {'tokens':>6}  members")
    for rec in engine.trace:
        if steps is None or rec.step in steps:
            print(f"{rec.step:>4} {rec.num_tokens:>6}  " + " ".join(map(label, rec.members)))

# %% [markdown]
# ## 1. Problem one: the whole prompt in one step
#
# Continuous batching gives every running decode one token, then admits waiting requests with their whole prompt.

# %%
# NBVAL_IGNORE_OUTPUT
cont = Engine(model, policy="continuous", max_num_seqs=4)
t0 = time.perf_counter()
run_workload(cont, workload)
print(f"continuous: {len(cont.trace)} steps in {time.perf_counter() - t0:.1f} s")

# %%
# NBVAL_CHECK_OUTPUT
show_steps(cont, range(1, 9))

# %% [markdown]
# Counted in steps, nothing looks wrong: at step 4 the three decodes still got their token.
# But step 4 is one forward over 803 tokens. Time it against the decode steps around it:

# %%
# NBVAL_IGNORE_OUTPUT
def step_seconds(engine):
    return np.array([rec.duration for rec in engine.trace])


secs = step_seconds(cont)
decode_only = [rec.duration for rec in cont.trace
               if rec.num_prefill_tokens == 0 and rec.num_decode_tokens > 0]
print(f"step 4 (3 decodes + 800 prompt tokens): {secs[3] * 1000:.0f} ms")
print(f"median decode-only step:                {np.median(decode_only) * 1000:.0f} ms")
print(f"the long step costs {secs[3] / np.median(decode_only):.0f} decode steps")

# %% [markdown]
# The last line says how many decode steps that one step cost. For all of it, the three chats wait for their next token.
# A user streaming one of those answers sees it freeze.
# The seed's 问题一: "在这一整步迭代期间，所有已经在运行中的 Decode 请求都无法得到推进" (for the whole step, no running decode advances).
# The chats' longest gap between two tokens (inter-token latency, ITL) shows it:

# %%
# NBVAL_IGNORE_OUTPUT
def worst_gap(engine, rid):
    times = engine.requests[rid].metrics.token_times
    return max(b - a for a, b in zip(times, times[1:]))


for rid in ("short-0", "short-1", "short-2"):
    print(f"{rid}: longest gap between two tokens {worst_gap(cont, rid) * 1000:.0f} ms")

# %% [markdown]
# Prefill cost grows with the prompt: linearly in the matrix products, quadratically in attention.
#
# The timeline (x axis in steps) hides the problem; the same steps in seconds show it.
# Step 1 stands tall too: a new engine's first forward pays one-off warm-up costs. Step 4 is the one to look at.

# %%
viz.plot_timeline(cont, title="continuous: the long prompt is prefilled in one step (step 4)")

# %%
# NBVAL_IGNORE_OUTPUT
def plot_step_seconds(engines, title):
    fig, ax = plt.subplots(figsize=(12, 3.6), layout="constrained")
    width = 0.8 / len(engines)
    for i, (name, engine) in enumerate(engines.items()):
        steps = np.array([rec.step for rec in engine.trace])
        ax.bar(steps - 0.4 + width * (i + 0.5), step_seconds(engine), width=width, label=name,
               color=("black", "#999999")[i % 2])  # not the prefill/decode colours
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title(title)
    ax.legend()
    return fig


fig = plot_step_seconds({"continuous": cont}, "wall-clock time of each step")

# %% [markdown]
# ## 2. Chunks
#
# The fix for problem one: cut the prompt into pieces and prefill one piece per step.
# Two knobs bound a step (vLLM's names; chapter 08 maps them to SGLang's):
#
# - `chunk_size`: at most this many prompt tokens of **one** request per step;
# - `max_num_batched_tokens`: at most this many tokens in the **whole** step: the token budget.
#
# A chunk is `min(chunk_size, budget left, tokens left)`.
# The seed adds a rule, 预算不足时推迟 (defer when the budget is short). minicb calls its threshold `min_chunk`; chapter 05 uses it.
# On plain numbers:

# %%
# NBVAL_CHECK_OUTPUT
def chunks(prompt_len, chunk_size, budget):
    out, done = [], 0
    while done < prompt_len:
        n = min(chunk_size, budget, prompt_len - done)
        out.append(n)
        done += n
    return out


print(chunks(800, chunk_size=128, budget=128))

# %% [markdown]
# minicb's `chunked` policy (`ChunkedScheduler`) does exactly this.
# Each chunk writes its K/V into the request's pages; the next chunk's queries attend to every earlier page.
# Only the last chunk produces logits and a first token.

# %%
# NBVAL_IGNORE_OUTPUT
chunked = Engine(model, policy="chunked", max_num_seqs=4, chunk_size=128,
                 max_num_batched_tokens=128)
t0 = time.perf_counter()
run_workload(chunked, workload)
print(f"chunked: {len(chunked.trace)} steps in {time.perf_counter() - t0:.1f} s")

# %%
# NBVAL_CHECK_OUTPUT
long_chunks = [m.num_tokens for rec in chunked.trace for m in rec.members
               if m.request_id == "long" and m.kind == "prefill"]
print("chunks of 'long' in the trace:", long_chunks)
print("same as by hand:", long_chunks == chunks(800, 128, 128))
print("same tokens as the one-step prefill:",
      chunked.requests["long"].output_token_ids == cont.requests["long"].output_token_ids)

# %% [markdown]
# Chunking changes the order of the work, not the result: the long request's greedy tokens are unchanged.
# Now the step times:

# %%
# NBVAL_IGNORE_OUTPUT
def prefill_steps_of(engine, rid="long"):
    return [rec for rec in engine.trace
            if any(m.request_id == rid and m.kind == "prefill" for m in rec.members)]


for name, engine in (("continuous", cont), ("chunked", chunked)):
    s = step_seconds(engine)
    long_steps = [rec.duration * 1000 for rec in prefill_steps_of(engine)]
    print(f"{name:<11} whole run {s.sum():4.1f} s in {len(s)} steps;  the long prompt's "
          f"{len(long_steps)} step(s): {min(long_steps):4.0f} to {max(long_steps):4.0f} ms each, "
          f"{sum(long_steps) / 1000:.2f} s together")
fig = plot_step_seconds({"continuous": cont, "chunked (128)": chunked},
                        "wall-clock time of each step: one big step, or seven bounded ones")

# %% [markdown]
# Each chunk step is several times shorter than the 803-token step, so problem one is solved.
# The prefill work is the same 800 tokens, but the seven chunk steps together take longer than the one big step.
# Every step pays a forward's fixed cost again, and each chunk re-reads the K/V of the chunks before it.
#
# ## 3. Problem two: prefill-first starves the decodes
#
# The chats are no better off yet. Look at what ran in those seven steps:

# %%
# NBVAL_CHECK_OUTPUT
show_steps(chunked, range(1, 13))

# %% [markdown]
# From step 4 to step 10 only `long` runs. The chats hold their pages and slots but get no tokens.
# `ChunkedScheduler` is **prefill-first**: while any prefill chunk can run, only prefill chunks get the budget.
# Even the last chunk, 32 tokens of 128, leaves the rest unused.
# This is the seed's 问题二: "系统仍然会连续许多步只执行 Prefill 块…已经开始的生成突然卡住不动" (only prefill chunks for many steps; a started generation freezes).
#
# The seed measures it with **dec@P**: decode tokens the *other* requests produce while the long prefill is unfinished.
# The window runs from the long prompt's arrival to the step of its last chunk. By hand, from the trace:

# %%
# NBVAL_CHECK_OUTPUT
def dec_at_p(engine, long_id="long"):
    long = engine.requests[long_id].metrics
    window = range(long.arrival_step, long.first_token_step + 1)
    tokens = sum(m.num_tokens for rec in engine.trace if rec.step in window
                 for m in rec.members if m.kind == "decode" and m.request_id != long_id)
    return tokens, len(window)


for name, engine in (("continuous", cont), ("chunked", chunked)):
    tokens, steps = dec_at_p(engine)
    print(f"{name:<11} prefill window {steps} step(s), dec@P = {tokens}")

# %% [markdown]
# `metrics.long_prefill_metrics` computes the same numbers, and the seed's second metric: **short_P**, the steps from the long prompt's arrival until the last short request finishes.

# %%
# NBVAL_CHECK_OUTPUT
for name, engine in (("continuous", cont), ("chunked", chunked)):
    m = long_prefill_metrics(engine.trace, request_records(engine), "long")
    print(f"{name:<11} prefill window {m['prefill_window_steps']} step(s), "
          f"dec@P = {m['dec_at_p']}, agrees with the hand count: "
          f"{(m['dec_at_p'], m['prefill_window_steps']) == dec_at_p(engine)};  "
          f"short_P = {m['short_p_steps']} steps")

# %% [markdown]
# dec@P = 0 under `chunked`. Continuous batching got 3, one token per chat in its one enormous step.
# short_P grows by seven steps (21 to 28): the chats lose every step of the window.
# In seconds the two are the same failure: the chats' longest gap is the whole window.

# %%
# NBVAL_IGNORE_OUTPUT
for name, engine in (("continuous", cont), ("chunked", chunked)):
    m = long_prefill_metrics(engine.trace, request_records(engine), "long")
    gap = max(worst_gap(engine, rid) for rid in m["short_request_ids"])
    print(f"{name:<11} window {m['prefill_window_s']:.2f} s, dec@P = {m['dec_at_p']}, "
          f"i.e. {m['dec_at_p_per_s']:.1f} decode tokens/s for the chats; "
          f"a chat's longest gap between two tokens {gap * 1000:.0f} ms")

# %% [markdown]
# The two runs side by side. Dotted cells are requests that hold pages and a slot but were not scheduled: the stalled chats.

# %%
viz.compare({"continuous": cont, "chunked, prefill-first": chunked})

# %% [markdown]
# The **token budget picture** makes the policy visible. Each bar is one step: blue decode tokens under orange prefill tokens, against the budget line.
# The lane below the axis shows the decode tokens alone, at their own scale.
# Continuous batching shoots through the line at step 4: it always lets the first waiting prompt in whole.
# Chunked prefill stays under the line, but its decode lane is empty for steps 4–10.

# %%
viz.compare({"continuous": cont, "chunked, prefill-first": chunked}, kind="budget")

# %% [markdown]
# Step through the chunked run: at steps 4–10 the batch holds only `long`'s chunk.
# `long`'s page table grows by 8 pages (128 tokens) a step.

# %%
# NBVAL_IGNORE_OUTPUT
viz.step_through(chunked)

# %% [markdown]
# ## 4. The two knobs, at a glance
#
# A schedule depends only on token counts, never on the model's outputs.
# So the **simulated executor** (`minicb.benchmark.sim`: the real engine and scheduler with a stand-in model, chapter 06) gives the very same schedule, in milliseconds.
# First the proof on this workload:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.benchmark.sim import make_sim_engine


def schedule(engine):
    return [[(m.request_id, m.kind, m.num_tokens) for m in rec.members] for rec in engine.trace]


sim = make_sim_engine(policy="chunked", max_num_seqs=4, chunk_size=128,
                      max_num_batched_tokens=128)
run_workload(sim, workload)
print("simulated schedule == real schedule:", schedule(sim) == schedule(chunked))

# %% [markdown]
# Two long prompts, A (500 tokens) and B (300), arrive together. How do the two knobs split them?

# %%
# NBVAL_CHECK_OUTPUT
from minicb.benchmark.workload import Workload, WorkloadRequest

two_long = Workload("two-long", [WorkloadRequest(prompt_len=500, max_tokens=2, request_id="A"),
                                 WorkloadRequest(prompt_len=300, max_tokens=2, request_id="B")])
for chunk_size, budget in ((128, 128), (512, 128), (64, 128), (128, 256)):
    sim = make_sim_engine(policy="chunked", chunk_size=chunk_size,
                          max_num_batched_tokens=budget)
    run_workload(sim, two_long)
    prefill_steps = [" ".join(label(m) for m in rec.members) for rec in sim.trace
                     if rec.num_prefill_tokens]
    print(f"chunk_size={chunk_size:<3} budget={budget:<3} {len(prefill_steps)} prefill steps: "
          + " | ".join(prefill_steps))

# %% [markdown]
# Read the four lines:
#
# - `128/128`: A goes first. B starts in the step where A's last 116 tokens leave 12 tokens of budget: the sliver `min_chunk` would defer.
# - `512/128`: the budget binds; same schedule.
# - `64/128`: A and B share every step until B is done.
# - `128/256`: both advance 128 tokens a step; the prefill takes 4 steps instead of 7.
#
# The budget sets the longest step (problem one).
# A larger budget makes prefill more efficient (bigger matrix products) but each step longer.
# On a GPU the sweet spot is much higher: budgets of thousands of tokens are common (chapter 06 sweeps it).
#
# ## Recap
#
# - **Problem one** (问题一): a long prompt in one step makes that step many decode steps long, and every running decode waits.
# - **Chunked prefill** bounds each step with chunks of `min(chunk_size, budget left, tokens left)`: 800 tokens at 128 a step are `[128] * 6 + [32]`.
# - **Problem two** (问题二): under prefill-first the decodes still stop for the whole window: dec@P = 0.
# - What is missing is decodes and a prefill chunk **in the same step**: PD interleaving, chapter 05.
#
# **Exercises:** [`exercises/04_chunked_prefill.ipynb`](../exercises/04_chunked_prefill.ipynb): write `next_chunk` (with `min_chunk`), then a prefill-first chunked scheduler; the check runs it against minicb's `chunked`.
