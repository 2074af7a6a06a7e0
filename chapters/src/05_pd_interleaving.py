# %% [markdown]
# # 05 · PD interleaving (PD 交错)
#
# Chapter 04 left the running chats frozen for seven steps while a long prompt was prefilled
# chunk by chunk: dec@P = 0. The seed's cure is to put decodes and a prefill chunk **in the same
# step**, with decodes served first: **PD 交错, prefill-decode interleaving**. The research name
# for the same idea is SARATHI's **decode-maximal batch** with chunked prefill (Agrawal et al.,
# 2023, [arXiv:2308.16369](https://arxiv.org/abs/2308.16369)): fill each step with every running
# decode, then top it up with one prefill chunk. The benchmark contract adds that engines still
# differ in how they do it (vLLM's chunked prefill and SGLang's mixed chunks are chapter 08's
# comparison), so a policy's name says less than its measured schedule.
#
# **After this chapter you will be able to**
#
# - write the seed's PD pseudo-code as a ten-line function over plain lists, run a whole workload
#   with it, and check that minicb's `PDScheduler` produces the same schedule on the real model;
# - read one mixed step as the model sees it: `[B_dec, 1]` decode rows and a `[1, N_chunk]`
#   prefill chunk flattened into one token batch (query lengths, context lengths, slot mapping);
# - measure **dec@P** and **short_P** for prefill-first chunking and for PD interleaving, in
#   steps and in seconds;
# - explain why total throughput moves much less than latency does, and what `min_chunk` trades.

# %%
# NBVAL_IGNORE_OUTPUT
%matplotlib inline
import inspect
import time

import numpy as np

from minicb.course import viz
from minicb.engine import Engine
from minicb.benchmark.metrics import long_prefill_metrics, max_itl
from minicb.model.loader import load_model
from minicb.benchmark.workload import get_workload, run_workload

model = load_model("smollm2-135m")  # (weights, info), loaded once and shared by every engine

# %% [markdown]
# The workload is chapter 04's: three chats (16-token prompts, 24 output tokens each) start at
# step 1; an 800-token prompt arrives at step 4 and wants 4 tokens. Greedy with `ignore_eos`, so
# every schedule below is exact and repeatable.

# %%
# NBVAL_CHECK_OUTPUT
workload = get_workload("long-prefill", long_prompt_len=800, num_short=3, short_prompt_len=16,
                        short_output=24, long_output=4, long_arrival_step=4)
BUDGET, CHUNK = 128, 128  # max_num_batched_tokens and chunk_size, as in chapter 04
requests = {r.request_id: (r.prompt_len, r.max_tokens, r.arrival_step) for r in workload}
print(requests)

# %% [markdown]
# ## 1. The decode-first token budget, on plain lists
#
# The seed's step has three rules:
#
# 1. **优先保障 Decode, decodes first**: every running request that is decoding gets one token of
#    the budget, so all of them advance however heavy the prefill pressure.
# 2. **剩余预算用于一个 Prefill Chunk, the rest goes to a prefill chunk**: from
#    `max_num_batched_tokens` minus the decode tokens, take the next chunk of a waiting prompt.
# 3. **预算不足时推迟, too little budget: defer**: if what is left cannot hold a minimal chunk
#    (`min_chunk`), the chunk waits for a later step.
#
# ```
# for each iteration:
#     budget = max_num_batched_tokens
#     for each seq in running:                       # 1. decodes first
#         schedule(seq, 1 token for decode); budget -= 1
#     if waiting is not empty:                       # 2. one prefill chunk from what is left
#         next_chunk = waiting.front().next_chunk(max_tokens = budget)
#         if next_chunk.size > 0: schedule(next_chunk)
# ```
#
# The same in Python, over plain lists. The one change from the seed: after the first chunk the
# loop keeps taking chunks from the next waiting prompts while budget is left (minicb and vLLM
# both do this). `one_chunk=True` keeps the seed's letter, one chunk a step; the next cells show
# what the difference costs on this workload.

# %%
def pd_step(decoding, prefilling, budget, chunk_size, min_chunk=1, one_chunk=False):
    """decoding: ids of running decodes; prefilling: [(id, prompt tokens left)] in arrival
    order. Returns the step's batch [(id, tokens)]."""
    batch = [(rid, 1) for rid in decoding]        # 1. every decode: one token
    budget -= len(decoding)
    for rid, left in prefilling:                  # 2. the rest to prefill chunks
        n = min(chunk_size, budget, left)
        if n < min(min_chunk, left):              # 3. too small a chunk: defer
            break
        batch.append((rid, n))
        budget -= n
        if one_chunk:                             # the seed's letter: one chunk a step
            break
    return batch


# %% [markdown]
# A whole run is that step in a loop. A request's prompt tokens go down with each chunk; the step
# that finishes its prompt also samples its first token; after that it decodes one token a step
# until it has `max_tokens`.

# %%
def toy_run(requests, step_fn, **knobs):
    """requests: {id: (prompt_len, max_tokens, arrival_step)} -> one batch per step."""
    left = {rid: p for rid, (p, _, _) in requests.items()}   # prompt tokens not yet computed
    made = {rid: 0 for rid in requests}                       # output tokens so far
    steps, step = [], 0
    while any(made[r] < requests[r][1] for r in requests):
        step += 1
        alive = [r for r in sorted(requests, key=lambda r: requests[r][2])  # by arrival
                 if requests[r][2] <= step and made[r] < requests[r][1]]
        batch = step_fn([r for r in alive if left[r] == 0],
                        [(r, left[r]) for r in alive if left[r] > 0], **knobs)
        for rid, n in batch:
            if left[rid]:
                left[rid] -= n
                made[rid] += left[rid] == 0   # the last chunk yields the first token
            else:
                made[rid] += 1
        steps.append(batch)
    return steps


toy = toy_run(requests, pd_step, budget=BUDGET, chunk_size=CHUNK)
for step, batch in enumerate(toy[:11], start=1):
    print(step, batch)

# %% [markdown]
# At steps 4–9 the batch is three decodes plus a 125-token chunk: 3 + 125 = 128, the whole
# budget. Step 10 takes the last 50 prompt tokens and gives `long` its first token, and from
# step 11 `long` decodes with the others.
#
# The seed's letter, one chunk a step, differs at step 1: the three chats arrive together, and
# their 16-token prompts would fit in one step's budget, but each step takes only the front
# prompt's chunk.

# %%
# NBVAL_CHECK_OUTPUT
literal = toy_run(requests, pd_step, budget=BUDGET, chunk_size=CHUNK, one_chunk=True)
for step, batch in enumerate(literal[:4], start=1):
    print(step, batch)
print(f"one chunk a step: {len(literal)} steps; chunks while budget lasts: {len(toy)} steps")

# %% [markdown]
# The chats start one step apart and every later step shifts with them, so the run takes two
# steps more. Taking chunks while the budget lasts costs nothing in a step that has room, which
# is why minicb and vLLM do it; with a single waiting prompt the two loops agree.
#
# ## 2. minicb's PDScheduler
#
# minicb's `pd` policy is the same rules, written against the engine's scheduling context
# (`ctx`): `schedule_decodes` gives every running decode one token (preempting if pages run
# out, chapter 06), and `schedule_prefill_chunks` spends the rest on chunks, skipping a chunk
# smaller than `min_chunk` (for a new prompt, `ctx.admit(..., min_tokens=min_chunk)` refuses it
# after counting its prefix-cache hit). One case the seed's pseudo-code never meets: running
# prompts, half prefilled, can hold every page while each waits for a page for its next chunk.
# With no decode left to finish and free one, nothing would ever run again (a property test
# found such a workload), so `schedule_prefill_chunks` then preempts the newest to let the oldest
# go on (the newest under the default first-come-first-served order; chapter 06's other orders
# pick the victim by their own rank).

# %%
# NBVAL_CHECK_OUTPUT
import minicb.scheduler

print(inspect.getsource(minicb.scheduler.PDScheduler))
print(inspect.getsource(minicb.scheduler.schedule_prefill_chunks))

# %% [markdown]
# Run it on the real model, and the prefill-first `chunked` policy of chapter 04 beside it with
# the same knobs:

# %%
# NBVAL_IGNORE_OUTPUT
engines, seconds = {}, {}
for policy in ("chunked", "pd"):
    engines[policy] = Engine(model, policy=policy, max_num_seqs=4, chunk_size=CHUNK,
                             max_num_batched_tokens=BUDGET)
    t0 = time.perf_counter()
    run_workload(engines[policy], workload)
    seconds[policy] = time.perf_counter() - t0
    print(f"{policy:<8} {len(engines[policy].trace)} steps in {seconds[policy]:.1f} s")
chunked, pd = engines["chunked"], engines["pd"]


# %% [markdown]
# The real schedule, step by step, and the comparison with the toy:

# %%
# NBVAL_CHECK_OUTPUT
def label(m):
    return f"{m.request_id}[{m.num_tokens}]" if m.kind == "prefill" else m.request_id


def show_steps(engine, steps):
    print(f"{'step':>4} {'tokens':>6}  members")
    for rec in engine.trace:
        if rec.step in steps:
            print(f"{rec.step:>4} {rec.num_tokens:>6}  " + " ".join(map(label, rec.members)))


show_steps(pd, range(1, 13))
real = [[(m.request_id, m.num_tokens) for m in rec.members] for rec in pd.trace]
print("\nminicb's pd schedule == the toy's:", real == toy)
print("same output tokens as chunked:",
      all(pd.requests[r].output_token_ids == chunked.requests[r].output_token_ids
          for r in requests))

# %% [markdown]
# The two policies side by side: under `pd` the three chats never stop (no dotted cells), and the
# long prompt still finishes its prefill at step 10.

# %%
viz.compare({"chunked (prefill-first)": chunked, "pd (decode-first)": pd})

# %% [markdown]
# The token budget picture shows the mix: every step from 4 to 9 is three decode tokens (blue)
# plus a 125-token chunk (orange), exactly at the `max_num_batched_tokens` line.

# %%
viz.compare({"chunked (prefill-first)": chunked, "pd (decode-first)": pd}, kind="budget")

# %% [markdown]
# Three decode tokens are a thin line under 128. Zoom into the bottom of the same picture: under
# `chunked` the blue disappears for steps 4–10; under `pd`, once the chats are decoding (step 2
# on), it never does.

# %%
viz.compare({"chunked (prefill-first)": chunked, "pd (decode-first)": pd}, kind="budget",
            ymax=8)

# %% [markdown]
# ## 3. One mixed step, as the model sees it
#
# The seed: "同一个 batch 中同时包含 [B_dec, 1] 的 Decode 序列和 [1, N_chunk] 的 Prefill 序列，两者在一次
# forward 中并行完成" (one batch holds decode sequences of shape [B_dec, 1] and a prefill
# sequence of shape [1, N_chunk], done together in one forward). The model never sees requests:
# it sees one flat batch of tokens plus `AttentionMetadata` saying which rows belong to whom.
#
# A standard PyTorch forward pre-hook lets us read the model's input without touching the
# engine. Run the same workload again under `pd` and keep the input of step 5:

# %%
# NBVAL_IGNORE_OUTPUT
captured = {}
probe = Engine(model, policy="pd", max_num_seqs=4, chunk_size=CHUNK, max_num_batched_tokens=BUDGET)


def keep_step_5(module, args):
    if probe.step_count == 5:
        input_ids, positions, meta, kv_caches, logits_indices = args
        captured.update(input_ids=input_ids, positions=positions, meta=meta,
                        logits_indices=logits_indices)


hook = model[0].register_forward_pre_hook(keep_step_5)
try:
    run_workload(probe, workload)
finally:
    hook.remove()

# %%
# NBVAL_CHECK_OUTPUT
meta = captured["meta"]
pos = captured["positions"].tolist()
print("tokens in the flat batch :", len(captured["input_ids"]))
print("members (query lengths)  :", meta.query_lens, f"-> num_decodes = {meta.num_decodes}")
print("query_start_loc          :", meta.query_start_loc.tolist())
print("context after the step   :", meta.context_lens_list)
print("positions                :", pos[:3], "+", pos[3:6], "...", pos[-2:])
print("page tables (padded)     :", meta.page_tables.shape[0], "x", meta.page_tables.shape[1])
print("logits rows              :", captured["logits_indices"].tolist())

# %% [markdown]
# Read it as the seed's shapes:
#
# - `[B_dec, 1]`: three decode members with one query each (rows 0, 1, 2), at position 19 of a
#   20-token context (16 prompt tokens plus 4 generated; the newest token is the one being
#   computed now).
# - `[1, N_chunk]`: one prefill member with 125 queries (rows 3–127), positions 125–249: the
#   second chunk, attending causally to the first chunk's pages and to itself.
# - Every linear layer (QKV, MLP) runs **once** on the 128 × 576 activation matrix, whatever
#   the members are; only attention looks at the metadata to keep members apart.
# - Logits are computed for 3 rows only: the decodes. The chunk is not the prompt's last, so it
#   samples nothing.
#
# The engine builds that metadata with `minicb.attention.build_metadata` from each member's page
# table, tokens already computed and tokens to compute this step. All three can be recovered
# from the trace, so rebuild it and compare:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.attention import build_metadata

rec = probe.trace[4]  # step 5
computed = {m.request_id: sum(n.num_tokens for r in probe.trace[:4] for n in r.members
                              if n.request_id == m.request_id) for m in rec.members}
rebuilt = build_metadata([rec.page_tables[m.request_id] for m in rec.members],
                         [computed[m.request_id] for m in rec.members],
                         [m.num_tokens for m in rec.members], probe.pool.page_size)
print("tokens computed before step 5:", computed)
print("same query lengths, contexts and slot mapping as the captured step:",
      rebuilt.query_lens == meta.query_lens
      and rebuilt.context_lens_list == meta.context_lens_list
      and rebuilt.slot_mapping.tolist() == meta.slot_mapping.tolist())
print("slot mapping of the decode rows:", meta.slot_mapping[:3].tolist(),
      "(page * 16 + offset of position 19)")

# %% [markdown]
# ## 4. dec@P and short_P
#
# The seed defines two metrics for a long prompt L:
#
# - **dec@P**: decode tokens the other requests produce while L's prefill is unfinished (from
#   L's arrival to the step of its last chunk). Higher is better: decodes kept flowing.
# - **short_P**: "从长请求进入系统排队起，到所有与之同时存在的短请求全部完成" (from L's arrival until
#   every short request alive with it has finished). Lower is better: the chats were not
#   dragged out by L.
#
# "Alive with it" needs one decision: a short request that arrives long after L's prefill, while
# L is still decoding, did not share the window L could disrupt, and counting it would make
# short_P grow with L's output length rather than with how L was prefilled. minicb counts the
# short requests that arrived **no later than the step L's prefill window ended** and had not
# finished before L arrived. (Here all three chats qualify.) One more difference from the seed's
# wording: the seed counts the decode tokens of the other *short* requests in dec@P; minicb
# counts every other request's, which is the same number in every scenario of this course, where
# the others are all short chats. Chapter 04 computed dec@P by hand; short_P by hand is a few
# lines more:

# %%
# NBVAL_CHECK_OUTPUT
def short_p_steps(engine, long_id="long"):
    long = engine.requests[long_id].metrics
    window_end = long.first_token_step  # the step L's last prefill chunk ran
    shorts = [r.metrics for r in engine.requests.values() if r.request_id != long_id
              and r.metrics.arrival_step <= window_end
              and r.metrics.finish_step >= long.arrival_step]
    return max(r.finish_step for r in shorts) - long.arrival_step + 1


print(f"{'policy':<8}{'window':>7}{'dec@P':>6}{'short_P':>8}{'L TTFT':>7}{'steps':>6}   "
      "(window, short_P, L's TTFT in steps)")
for policy, engine in engines.items():
    m = long_prefill_metrics(engine.trace, engine.request_records(), "long")
    assert m["short_p_steps"] == short_p_steps(engine)
    long = engine.requests["long"].metrics
    print(f"{policy:<8}{m['prefill_window_steps']:>7}{m['dec_at_p']:>6}{m['short_p_steps']:>8}"
          f"{long.first_token_step - long.arrival_step + 1:>7}{len(engine.trace):>6}")

# %% [markdown]
# PD interleaving takes dec@P from 0 to 21 (three chats × seven steps) and short_P from 28 steps
# to 21, and the long prompt pays nothing for it: its first token still comes in its 7th step,
# because three decode tokens in a 128-token budget cost it only 3 tokens of chunk per step
# (125-token chunks instead of 128, still seven chunks).
#
# In seconds (these numbers depend on the machine and its load; compare them within one run):

# %%
# NBVAL_IGNORE_OUTPUT
for policy, engine in engines.items():
    m = long_prefill_metrics(engine.trace, engine.request_records(), "long")
    itl = max(max_itl(r) for r in engine.request_records() if r.request_id.startswith("short"))
    print(f"{policy:<8} window {m['prefill_window_s']:5.2f} s   dec@P/s {m['dec_at_p_per_s']:5.2f}"
          f"   short_P {m['short_p_s']:5.2f} s   worst gap between two chat tokens {itl:.2f} s")

# %% [markdown]
# Under `chunked` the chats' worst gap between two tokens is the whole prefill window and one
# decode step more; under `pd` it is one mixed step. The window itself is usually a little longer in seconds under `pd`:
# each of its seven steps also carries three decode rows, and the long prompt's first token
# arrives that much later. That is the price of decode-first, and here it is small.

# What step counts cannot see: chapter 04's problem one. Plain `continuous` prefills the whole
# 800-token prompt in one step, which also carries the chats' decodes. Its short_P is 21 steps,
# the same as `pd`'s, and its dec@P is 3: every decode a one-step window can hold, none missed.
# Only seconds show the stall, in the chats' worst gap:

# %%
# NBVAL_IGNORE_OUTPUT
whole = Engine(model, policy="continuous", max_num_seqs=4)
run_workload(whole, workload)
for policy, engine in (("continuous", whole), ("pd", pd)):
    m = long_prefill_metrics(engine.trace, engine.request_records(), "long")
    itl = max(max_itl(r) for r in engine.request_records() if r.request_id.startswith("short"))
    print(f"{policy:<10} dec@P {m['dec_at_p']:>2}   short_P {m['short_p_steps']} steps, "
          f"{m['short_p_s']:.2f} s   worst gap between two chat tokens {itl:.2f} s")

# %% [markdown]
# The same short_P in steps and no decode missed, but one chat token waited for an 800-token
# forward. Read dec@P and short_P beside a latency in seconds (max ITL here; chapter 06's ITL
# percentiles at scale): a step count weighs a 3-token step and an 800-token step alike.
#
# ## 5. Why total throughput moves less than latency
#
# The seed warns: "从总吞吐量（tokens/s）的角度看，PD 交错与纯 Prefill‑first 策略往往非常接近" (in total
# tokens/s, PD interleaving and prefill-first are usually very close). Both policies compute
# exactly the same tokens; PD only changes **when**:

# %%
# NBVAL_CHECK_OUTPUT
for policy, engine in engines.items():
    prefill = sum(r.num_prefill_tokens for r in engine.trace)
    decode = sum(r.num_decode_tokens for r in engine.trace)
    out = sum(len(r.output_token_ids) for r in engine.requests.values())
    print(f"{policy:<8} prefill tokens {prefill}, decode tokens {decode}, output tokens {out}, "
          f"steps {len(engine.trace)}, output tokens/step {out / len(engine.trace):.2f}")

# %%
# NBVAL_IGNORE_OUTPUT
tokens_per_s = {}
for policy, engine in engines.items():
    out = sum(len(r.output_token_ids) for r in engine.requests.values())
    busy = sum(r.duration for r in engine.trace)
    tokens_per_s[policy] = out / busy
    print(f"{policy:<8} {busy:5.1f} s of steps, {out / busy:5.2f} output tokens/s")
print(f"pd / chunked output tokens/s: {tokens_per_s['pd'] / tokens_per_s['chunked']:.2f}x")

# %% [markdown]
# Same prefill tokens, same decode tokens. PD needs 7 fewer steps (24 against 31), because the
# chats' decodes ride along in the prefill steps instead of running in steps of their own. In
# seconds the saving is smaller than the step count: the seven steps PD saves are cheap ones, a few
# decode rows each, and its mixed steps cost a little more than chunk-only steps. The ratio printed
# last above is PD's gain in output tokens/s in this run, from 23% fewer steps; it changes from run
# to run, and on a shared machine a few percent of it is noise. How much the saved steps
# count depends on load: below saturation both policies simply keep up with the arrivals, so their
# tokens/s are the same (the simulation below: 1,259 against 1,260 at 10 requests/s); at saturation
# the saved steps show again (13% more there). The seed also notes that it can go the other way:
# mixing shapes in one step can cost extra kernel launches or padding, so PD's total can even be
# slightly lower. The simulation cannot show that: its cost model has no term for mixing, so a
# mixed step costs what its tokens and rows cost. On the real model, compare the prefill
# windows printed in section 4: the seven chunks of the same 800-token prompt took longer under
# `pd`, by the cost of the
# decode rows riding with them. Either way the change in throughput is modest; the change in the chats' experience
# (dec@P, short_P, the worst inter-token gap) is large.
#
# That is why the seed says to judge PD by latency: "应优先观察 dec@P 和 short_P 这类延迟分布指标，
# 总吞吐量仅作为辅助参考" (look at latency metrics such as dec@P and short_P first; total throughput
# is only a secondary reference).
#
# ### At scale (simulated)
#
# One long prompt is an anecdote. For a distribution, run 200 requests with Poisson arrivals at
# 10 requests/s, lognormal prompt lengths (median 256 tokens, a tail to 6,000) and outputs of
# 16–256 tokens. Thousands of steps of the real model would take too long on a CPU, so this uses
# minicb's **simulated executor** (`minicb.benchmark.sim`, chapter 06): the real engine, scheduler and
# pages, with a fake model whose step time comes from a cost model. The `h100-like` cost model
# is an **assumption** (an 8B model on one H100, from published peak figures), not a
# measurement: these are simulated seconds. The table uses three measures chapter 06 defines
# properly: **TTFT**, the time from a request's arrival to its first token; **ITL**, each gap
# between two of a request's tokens; **TPOT**, a request's mean gap after its first token.

# %%
# NBVAL_CHECK_OUTPUT
from minicb.benchmark.metrics import format_table, summarize
from minicb.benchmark.sim import make_sim_engine
from minicb.benchmark.workload import make_workload

results = {}
for rate in (10, 30):
    scale = make_workload(200, prompt_lengths="lognormal:256:1.5:16:6000",
                          output_lengths="uniform:16:256", arrival="poisson", rate=rate, seed=1)
    for policy in ("chunked", "pd"):
        sim = make_sim_engine("h100-like", policy=policy, max_num_seqs=64,
                              max_num_batched_tokens=512, chunk_size=512, num_pages=20000)
        run_workload(sim, scale)
        results[f"{policy} @{rate}/s"] = summarize(sim.trace, sim.request_records())
columns = [("output_tokens_per_s", "out tok/s", "{:.0f}"), ("ttft_s.p50", "TTFT p50", "{:.3f}"),
           ("ttft_s.p99", "TTFT p99", "{:.3f}"), ("tpot_s.p99", "TPOT p99", "{:.4f}"),
           ("itl_s.p50", "ITL p50", "{:.4f}"), ("itl_s.p99", "ITL p99", "{:.4f}"),
           ("max_itl_s.p50", "max ITL p50", "{:.3f}"), ("max_itl_s.p99", "max ITL p99", "{:.3f}"),
           ("num_steps", "steps", "{}")]
print("SIMULATED (h100-like cost model, an assumption); seconds")
print(format_table(results, columns))

# %% [markdown]
# At 10 requests/s the engine is below saturation, and a policy's throughput is just the arrival
# rate (the requests are simply served): the two rows show the same output tokens/s, 1,259
# against 1,260, and TTFT nearly so. The tails are what differ. Under prefill-first, a decode
# caught behind a train of 512-token chunks waits several steps for its next token, so ITL p99
# is 45 ms against PD's 22 ms, and TPOT p99 16 ms against 12 ms.
#
# **Pooled ITL hides the worst of it.** `ITL p99` pools every gap of every request: about 26,000
# gaps here, so a stall that hits each chat once or twice sits far below the 99th percentile.
# `max ITL` is each request's *worst* gap, the longest its user watched the output freeze, with
# percentiles over requests (`metrics.max_itl`). Under prefill-first one chat in a hundred
# froze for 570 ms or more; under PD 99 chats in 100 froze for at most 24 ms, one mixed step. That is
# dec@P's lesson at scale, and it is what an interactive SLO (service-level objective: a limit every request should meet;
# chapter 06 counts goodput against it) should bound: `slo={"itl": 0.1}`
# (`--slo-itl` on the command line) counts a request as good only if its worst gap is at most
# 100 ms.
#
# At 30 requests/s (the same 200 requests, arriving three times as fast) the engine saturates,
# and PD also finishes more tokens per second: 3,010 against 2,660 (13% more), in 703 steps
# instead of 895, because it fills the fixed cost of each
# prefill step with decode rows where prefill-first runs decode-only steps of its own.
#
# ## 6. `min_chunk`: when the leftover budget is too small
#
# Rule 3 of the seed: if after the decodes the budget left cannot hold a minimal chunk, defer the
# chunk. Why bother? A chunk of 3 tokens rides in a step that reads the weights anyway for the
# decodes, but each chunk attends over the prompt's whole prefix again, so many tiny chunks read
# the same K/V many times and spread one prompt's prefill over many steps. `min_chunk` sets the
# smallest chunk worth running.
#
# An extreme case makes it visible: nine chats with one-token prompts decoding, 8 to 32 tokens
# each, and a budget of only 12 tokens, so 3 tokens are left per step while all nine decode. A
# 48-token prompt arrives at step 2. This runs on the real model, 32 small steps for each
# `min_chunk`; the simulated executor, which chapter 06 uses for the same knob at scale, gives
# the same schedule (schedules depend only on token counts; `tests/test_sim.py` checks it step
# by step for every policy and knob the course simulates, `min_chunk`, the priority and fair
# orders, `max_preemptions`, swap and reject included; deadlines count seconds, so they follow
# each executor's own clock).

# %%
# NBVAL_CHECK_OUTPUT
from minicb.benchmark.workload import Workload, WorkloadRequest

chats = [WorkloadRequest(prompt_len=1, max_tokens=n, arrival_step=1, request_id=f"s{i}")
         for i, n in enumerate(range(8, 33, 3))]
tight = Workload("min-chunk", chats + [WorkloadRequest(prompt_len=48, max_tokens=2,
                                                       arrival_step=2, request_id="long")])
print(f"{'min_chunk':>9} {'chunks':>6} {'first at':>8} {'L TTFT':>6}  chunk sizes")
same_as_sim = []
for min_chunk in (1, 4, 8):
    knobs = dict(policy="pd", max_num_seqs=12, max_num_batched_tokens=12, chunk_size=64,
                 min_chunk=min_chunk)
    real, sim = Engine(model, **knobs), make_sim_engine(**knobs)
    for engine in (real, sim):
        run_workload(engine, tight)
    sizes = [(rec.step, m.num_tokens) for rec in real.trace for m in rec.members
             if m.request_id == "long" and m.kind == "prefill"]
    ttft = real.requests["long"].metrics.first_token_step - 2 + 1
    print(f"{min_chunk:>9} {len(sizes):>6} {'step ' + str(sizes[0][0]):>8} {ttft:>6}  "
          f"{[n for _, n in sizes]}")
    same_as_sim.append([[(m.request_id, m.num_tokens) for m in rec.members] for rec in real.trace]
                       == [[(m.request_id, m.num_tokens) for m in rec.members]
                           for rec in sim.trace])
print("the simulated executor's schedules are the same:", all(same_as_sim))

# %% [markdown]
# With `min_chunk=1` the prompt trickles in 3 to 5 tokens at a time from the step it arrives:
# 13 chunks. With `min_chunk=4` it waits until one chat has finished and leaves 4 tokens; with 8,
# until five have. Fewer, larger chunks, at the price of a later first token for the long prompt
# (13, 17, 25 steps). The decodes are never the ones deferred: that is the point of decode-first.
# minicb's default is `min_chunk=1`, the seed's pseudo-code (`if next_chunk.size > 0`).
#
# ## 7. Step through it
#
# Steps 4–9 of the real `pd` run: the batch panel lists three decodes and one 125-token chunk;
# `long`'s page table grows by about 8 pages a step while the chats' tables grow by one page
# every 16 tokens.

# %%
# NBVAL_IGNORE_OUTPUT
viz.step_through(pd)

# %% [markdown]
# ## Recap
#
# - **PD 交错** is a token budget spent in a fixed order: one token for every running decode
#   first, then prefill chunks with what is left, and a chunk smaller than `min_chunk` waits.
#   Ten lines on plain lists reproduce minicb's `PDScheduler` step for step.
# - A mixed step is one flat batch: `[B_dec, 1]` decode rows then `[1, N_chunk]` chunk rows,
#   kept apart only inside attention by `query_start_loc`, context lengths and page tables.
# - On the long-prompt scenario: dec@P 0 → 21, short_P 28 → 21 steps, the long prompt's first
#   token unchanged at 7 steps; same prefill and decode tokens, 7 fewer steps.
# - Total throughput moves much less than latency: the same tokens are computed, and PD saves
#   only decode-only steps (in the small run here a gain in tokens/s smaller than its 23% fewer
#   steps suggest, the ratio printed in section 5; none below saturation in the simulation, 13%
#   at saturation). Judge a scheduler by dec@P, short_P and tail
#   inter-token latency, then by tokens/s.
# - Chapter 06 turns this into a benchmark: arrival processes, percentiles, goodput at an SLO,
#   and what happens when the KV cache fills up.
#
# **Exercises:** [`exercises/05_pd_interleaving.ipynb`](../exercises/05_pd_interleaving.ipynb): turn
# the seed's pseudo-code into a `Scheduler` subclass and run it in the real engine beside
# prefill-first (the check compares it with minicb's `pd`, step by step), then write `dec_at_p` and
# `short_p` from a trace and check the chapter's claim with your own numbers.
