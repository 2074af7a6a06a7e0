# %% [markdown]
# # 04 · Chunked prefill
#
# Chapter 03 ended with continuous batching admitting a new request's **whole prompt** in one
# step. With chat-sized prompts that is harmless. With a long prompt it is not: the seed's
# section 3 names two problems, and this chapter measures both on the real model.
#
# **After this chapter you will be able to**
#
# - measure **问题一, problem one**: one long prompt prefilled in a single step stretches that
#   step, and every running decode waits for it (队头阻塞 head-of-line blocking, now caused by a
#   prefill instead of a long decode);
# - cut a prompt into chunks under the two knobs `chunk_size` and `max_num_batched_tokens` (the
#   per-step token budget, the seed's token 预算), predict the chunks by hand and read them off
#   the budget picture;
# - compute **dec@P** from a trace by hand and show **问题二, problem two**: a prefill-first
#   scheduler with chunks still stops every decode for the whole prefill window (dec@P = 0).

# %%
# NBVAL_IGNORE_OUTPUT
%matplotlib inline
import time

import matplotlib.pyplot as plt
import numpy as np

from minicb.course import viz
from minicb.engine import Engine
from minicb.benchmark.metrics import long_prefill_metrics
from minicb.model.loader import load_model
from minicb.benchmark.workload import get_workload, run_workload

viz.use_course_style()  # projector-sized fonts for this chapter's own plots too

model = load_model("smollm2-135m")  # (weights, info), loaded once and shared by every engine

# %% [markdown]
# ## The scenario: three chats and one long document
#
# `minicb.benchmark.workload` has the chapter's scenario ready: `long-prefill`. Three short requests
# (16-token prompts, 24 output tokens each) start at step 1 and are decoding by step 2. At step 4
# a long prompt arrives, a document of 800 tokens that wants 4 output tokens. The seed talks about
# 2,000 tokens; 800 keeps the CPU run short and shows the same thing (on a GPU, try 8,000).
# Sampling is greedy with `ignore_eos`, so every request produces exactly its `max_tokens`
# and the schedule never depends on the generated text.

# %%
# NBVAL_CHECK_OUTPUT
workload = get_workload("long-prefill", long_prompt_len=800, num_short=3, short_prompt_len=16,
                        short_output=24, long_output=4, long_arrival_step=4)
for key, value in workload.declaration.items():
    print(f"{key:>22}: {value}")


# %% [markdown]
# A small helper prints a schedule, one line per step: who was in the batch and what each
# member did. `long[128]` is a prefill chunk of 128 tokens of `long`; a bare name is one decode
# token. It only reads `engine.trace`, the plain list of `StepRecord`s every picture is drawn from.

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
# Continuous batching (`policy="continuous"`, chapter 03) gives every running decode one token,
# then admits waiting requests with their whole prompt.

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
# Counted in steps, nothing looks wrong: at step 4 the three decodes each still got their token.
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
# That one step lasts as long as twenty or more decode steps, and the three chats wait the
# whole time for their next token. A user streaming one of those answers sees it freeze. This is the
# seed's 问题一: "单步迭代的耗时因此被显著拉长。在这一整步迭代期间，所有已经在运行中的 Decode
# 请求都无法得到推进" (the single iteration is stretched, and for its whole length no running
# decode advances). The inter-token latency (ITL) of the short requests shows it directly:

# %%
# NBVAL_IGNORE_OUTPUT
def worst_gap(engine, rid):
    times = engine.requests[rid].metrics.token_times
    return max(b - a for a, b in zip(times, times[1:]))


for rid in ("short-0", "short-1", "short-2"):
    print(f"{rid}: longest gap between two tokens {worst_gap(cont, rid) * 1000:.0f} ms")

# %% [markdown]
# Prefill costs grow with the prompt: about linearly in the matrix products and quadratically in
# attention. On a GPU the same thing happens at a larger scale: a 32k-token prompt prefilled in
# one step stalls every decode on that GPU for a second or more with an 8B model.
#
# The timeline (x axis in steps) hides the problem; the same steps drawn in seconds show it.
# Step 1 stands tall too, for another reason: a new engine's first forward pays one-off costs
# (memory touched for the first time, first calls into the math library's kernels). Read it as
# warm-up, not as the price of its 48 prompt tokens; step 4 is the one to look at.

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
# The fix for problem one is to cut the prompt into pieces and prefill one piece per step, so no
# step grows beyond a fixed number of tokens. Two knobs bound a step (`max_num_batched_tokens`
# is vLLM's name; vLLM calls the per-request cap `long_prefill_token_threshold`; SGLang has no
# per-request cap: its `chunked_prefill_size` is the prefill tokens of the whole step, shared by
# every prompt in it, so with one long prompt it is that prompt's chunk; chapter 08):
#
# - `chunk_size`: at most this many prompt tokens of **one** request per step;
# - `max_num_batched_tokens`: at most this many tokens in the **whole** step, prefill and decode
#   together: the step's token budget.
#
# A chunk is therefore `min(chunk_size, budget left, tokens left)`. The seed adds one rule,
# 预算不足时推迟 (defer when the budget is short): if what is left of the step's budget cannot hold
# a minimum chunk, the chunk waits for a later step instead of running as a sliver whose fixed
# cost outweighs its work. minicb calls that minimum `min_chunk` (`EngineConfig`, default 1, so it
# never fires unless you set it) and defers a chunk smaller than `min(min_chunk, tokens left)`: a
# prompt's last few tokens still run when they finish it. Only the `pd` policy applies it: the
# rule starts to matter in chapter 05, where decodes take their share of the budget first; this
# chapter's `chunked` policy ignores it. On plain numbers, without it:

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
# minicb's `chunked` policy (`ChunkedScheduler` in `minicb/scheduler.py`) does exactly this.
# Each chunk writes its K/V into the request's pages, and the next chunk's queries attend to
# every earlier page: the attention backends take a chunk that starts anywhere in the prompt,
# even in the middle of a page. Only the last chunk produces logits and a first token.

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
# Chunking changes the order of the work, not the result: the long request's four greedy tokens
# are the ones the one-step prefill produced. (Bit for bit here, in float32 on the CPU. In
# bfloat16 on a GPU the chunked and one-pass attention add their terms in another order, and a
# near-tie between two tokens can flip; chapter 07.) Now the step times:

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
# Each 128-token chunk step is several times shorter than the 803-token step, so no step holds
# the running decodes for long any more: problem one is solved. The prefill work is the same 800
# prompt tokens, but not the same seconds: the seven chunk steps together take longer than the
# one big step (a quarter more in this run), since every step pays the fixed costs of a forward
# again and each chunk's queries also read the K/V of the chunks before it. (Step 1 is tall in
# both runs: the warm-up of a new engine, section 1.)
#
# ## 3. Problem two: prefill-first starves the decodes
#
# The chats are no better off yet. Look at what ran in those seven steps:

# %%
# NBVAL_CHECK_OUTPUT
show_steps(chunked, range(1, 13))

# %% [markdown]
# From step 4 to step 10 only `long` runs. The three chats hold their pages and their slots but
# get no tokens: `ChunkedScheduler` is **prefill-first**; while any prefill chunk can run (a
# waiting prompt with a free slot and pages, or a prompt already half done), only prefill chunks
# get the budget, even when the last chunk leaves most of it unused (step 10: 32
# of 128), and decodes run only in steps with no prefill at all. This
# is the seed's 问题二: "系统仍然会连续许多步只执行 Prefill 块 … 用户侧观察到的是已经开始的生成突然
# 卡住不动" (the system runs only prefill chunks for many steps in a row … the user sees a
# generation that had started suddenly freeze).
#
# The seed measures it with **dec@P**: the number of decode tokens the *other* requests produce
# while the long request's prefill is unfinished. The prefill window runs from the step the long
# prompt arrives to the step its last chunk runs (the step that yields its first token). By hand,
# from the trace and the request records:

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
# `minicb.benchmark.metrics.long_prefill_metrics` computes the same numbers, and the seed's second metric
# with them: **short_P**, the steps from the long prompt's arrival until the last short request
# has finished (chapter 05 compares policies by both):

# %%
# NBVAL_CHECK_OUTPUT
for name, engine in (("continuous", cont), ("chunked", chunked)):
    m = long_prefill_metrics(engine.trace, engine.request_records(), "long")
    print(f"{name:<11} prefill window {m['prefill_window_steps']} step(s), "
          f"dec@P = {m['dec_at_p']}, agrees with the hand count: "
          f"{(m['dec_at_p'], m['prefill_window_steps']) == dec_at_p(engine)};  "
          f"short_P = {m['short_p_steps']} steps")

# %% [markdown]
# dec@P = 0 under `chunked`. Continuous batching got 3 (one token for each chat, in its one
# enormous step). short_P grows by seven steps (21 to 28): the chats lose every step of the
# seven-step window, where under `continuous` they still decoded in its one step. In seconds the two are the same failure: during the prefill window the chats produced
# (almost) nothing, and their longest wait between two tokens is the whole window (under
# `chunked`, with one decode step more):

# %%
# NBVAL_IGNORE_OUTPUT
for name, engine in (("continuous", cont), ("chunked", chunked)):
    m = long_prefill_metrics(engine.trace, engine.request_records(), "long")
    gap = max(worst_gap(engine, rid) for rid in m["short_request_ids"])
    print(f"{name:<11} window {m['prefill_window_s']:.2f} s, dec@P = {m['dec_at_p']}, "
          f"i.e. {m['dec_at_p_per_s']:.1f} decode tokens/s for the chats; "
          f"a chat's longest gap between two tokens {gap * 1000:.0f} ms")

# %% [markdown]
# The two runs side by side, on one step axis. Dotted cells are requests that are running (they
# hold pages and a slot) but were not scheduled in that step: the stalled chats.

# %%
viz.compare({"continuous": cont, "chunked, prefill-first": chunked})

# %% [markdown]
# The **token budget picture** makes the policy visible. Each bar is one step: blue decode tokens
# under orange prefill tokens, against the `max_num_batched_tokens` line. Continuous batching
# shoots through the line at step 4: a whole-prompt policy counts only prompt tokens against the
# budget and always lets the first waiting prompt in (else a prompt longer than the budget could
# never run), so a step may exceed the line by that prompt and by the decodes riding along.
# Chunked prefill stays under it, but every step is either all prefill or all decode, never both.
# (Each panel draws its own run's budget, and its title names it: the continuous run had the
# default 256, the chunked run 128.)

# %%
viz.compare({"continuous": cont, "chunked, prefill-first": chunked}, kind="budget")

# %% [markdown]
# Three decode tokens are too thin to see on an axis that reaches past 800. Zoom into the bottom
# of the same picture: under `continuous` the blue is there in every step from 2 on, step 4
# included; under `chunked` it disappears for steps 4–10.

# %%
viz.compare({"continuous": cont, "chunked, prefill-first": chunked}, kind="budget", ymax=8)

# %% [markdown]
# Step through the chunked run: at steps 4–10 the batch holds only `long`'s chunk while the
# three chats sit in `running` with their page tables intact. Watch `long`'s page table grow by
# 8 pages (128 tokens / 16 per page) per step, and the last, 32-token chunk at step 10 yield its
# first token.

# %%
# NBVAL_IGNORE_OUTPUT
viz.step_through(chunked)

# %% [markdown]
# ## 4. The two knobs, at a glance
#
# The scheduler's decisions depend only on token counts, never on the model's outputs
# (greedy, `ignore_eos`, fixed `max_tokens`). So the **simulated executor** (`minicb.benchmark.sim`: the
# real engine and scheduler with a fake model that costs no computation, chapter 06) produces the
# very same schedule, in milliseconds. First the proof on this workload:

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
# Now two long prompts, A (500 tokens) and B (300), arrive together. How do `chunk_size` and
# `max_num_batched_tokens` split them?

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
# - `128/128`: one request's chunk fills the budget; A goes first (first come, first served),
#   and B starts in the step where A's last 116 tokens leave 12 tokens of budget: exactly the
#   sliver the seed's defer rule is for (`min_chunk`, section 2); `chunked` runs it anyway.
# - `512/128`: the budget is the binding limit; same schedule.
# - `64/128`: each request's chunk is capped at 64, so A and B share every step until B is done;
#   A then finishes alone in 64-token steps (the last one 52): 8 steps, the last three half
#   empty.
# - `128/256`: both advance 128 tokens per step; the prefill is done in 4 steps instead of 7,
#   the first two of those steps carry twice the tokens (256), the last two what is left.
#
# The budget sets the longest step (problem one). Once decodes share every step with the chunks
# (`pd`, chapter 05), that also bounds the worst gap between a chat's tokens; under prefill-first
# `chunked` it does not, since the chats wait out the whole prefill window (section 3). A larger
# budget makes prefill more efficient (bigger matrix products)
# but makes those steps longer. On a GPU the sweet spot is much higher than here: budgets of
# 2,048 to 8,192 tokens are common, because a GPU step costs nearly the same for 1 token or
# a few hundred (chapter 06 sweeps it).
#
# ## Recap
#
# - **Problem one** (问题一): a long prompt prefilled in one step makes that step some twenty or
#   more decode steps long (21 in this CPU run); every running decode waits (head-of-line blocking by a prefill).
# - **Chunked prefill** bounds each step: chunks of `min(chunk_size, budget left,
#   tokens left)`. 800 tokens at 128 per step are `[128] * 6 + [32]`; the output tokens do not
#   change.
# - **Problem two** (问题二): with a prefill-first policy the decodes still stop for the whole
#   prefill window, now 7 steps instead of one long step: dec@P = 0.
# - What is missing is putting decodes and a prefill chunk **in the same step**. That is PD
#   interleaving, chapter 05.
#
# **Exercises:** [`exercises/04_chunked_prefill.ipynb`](../exercises/04_chunked_prefill.ipynb):
# write `next_chunk` (the rule of section 2, `min_chunk` included), then a
# prefill-first chunked scheduler of your own as a `minicb.Scheduler` subclass; the check runs it in
# the real engine against minicb's `chunked` schedule, and you measure problem two with it.
