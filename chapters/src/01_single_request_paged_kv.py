# %% [markdown]
# # 01 · One request at a time, over a paged KV cache (v1)
#
# v1 is the engine before any batching. One request runs alone: first its **Prefill** (the whole prompt in one forward), then its **Decode** (one token per forward) until it ends.
# What v1 already gets right is memory.
# The KV cache lives in fixed-size **pages** drawn from one **页池 page pool**.
# A **前缀索引 prefix index** lets a later request reuse pages computed for the same prompt prefix.
# The seed: "v1 的重点在于单请求路径上的显存复用" (v1 is about reusing memory along the single-request path).
#
# **After this chapter you will be able to**
#
# - measure prefill and decode, and say why one is compute-bound and the other memory-bound;
# - build a page allocator and a page table by hand, and compute a token's slot;
# - follow one request through WAITING → RUNNING → FINISHED and watch its page table grow;
# - reuse a shared system prompt with the prefix index, and say why the hit is capped at `prompt_len − 1`.

# %%
# NBVAL_IGNORE_OUTPUT
%matplotlib inline
import time

import numpy as np

from minicb import LLM, SamplingParams
from minicb.course import viz
from minicb.model.loader import load_model

t0 = time.perf_counter()
model = load_model("smollm2-135m")  # (weights, info): every engine below reuses them
print(f"loaded in {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# `load_model` loads the weights once; each `LLM(model, ...)` builds an engine around them, with its own pool, queues and trace.
#
# ## 1. Two phases with different costs
#
# Generation has two phases (seed §2.1):
#
# - **Prefill**: the whole prompt goes through the model in one forward. Every position's keys and values (K/V) are stored. The last position's logits give the first output token.
# - **Decode**: each step feeds only the newest token, attends over the stored K/V, and samples one more token.
#
# The `single` policy is v1. A request with `max_tokens=1` is exactly one prefill step.
# `StepRecord.t_forward` holds the seconds each step spent inside the model.

# %%
# NBVAL_IGNORE_OUTPUT
from minicb.benchmark.workload import random_prompt

llm = LLM(model, policy="single", enable_prefix_caching=False)
engine = llm.engine
rng = np.random.default_rng(0)
one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

engine.add_request(random_prompt(32, rng), one_token)  # warm-up
engine.run()

prefill = {}
for n in (16, 64, 256):
    times = []
    for _ in range(2):
        engine.add_request(random_prompt(n, rng), one_token)
        record = engine.step()  # one step: the whole prompt, then the first token
        times.append(record.t_forward)
    prefill[n] = min(times)

N_DECODE = 64
engine.add_request(random_prompt(64, rng),
                   SamplingParams(max_tokens=N_DECODE + 1, temperature=0.0, ignore_eos=True))
engine.run()
decode_steps = engine.trace[-N_DECODE:]
assert all(r.members[0].kind == "decode" for r in decode_steps)
t_decode = float(np.median([r.t_forward for r in decode_steps]))

print(f"{'step':<22}{'tokens':>7}{'seconds':>10}{'tokens/s':>10}")
for n, t in prefill.items():
    print(f"{'prefill':<22}{n:>7}{t:>10.3f}{n / t:>10.1f}")
print(f"{'decode (median of 64)':<22}{1:>7}{t_decode:>10.3f}{1 / t_decode:>10.1f}")
print(f"\na prefill step of 256 tokens took as long as {prefill[256] / t_decode:.0f} decode steps "
      f"and did the work of 256")

# %% [markdown]
# The last line says how many decode steps one 256-token prefill cost in this run.
# Per token, prefill is far cheaper than decode. Why?
#
# Count the work. The model has about 134 M parameters in float32, so **every forward reads about 0.54 GB of weights**.
# Each token costs about 2 FLOPs per parameter (a multiply and an add).
#
# - A decode step does about 0.27 GFLOP for those 0.54 GB: about **0.5 FLOP per byte**.
# - A prefill of N tokens reuses each weight N times: about **0.5 × N FLOP per byte**.
#
# A processor needs some number of FLOPs per byte to keep its arithmetic busy.
# Below it, a step waits for memory (访存密集 memory-bound); above it, for arithmetic (计算密集 compute-bound).
# Decode sits far below any processor's ratio; a long prefill sits far above.
# The next cell turns this run's times into rates:

# %%
# NBVAL_IGNORE_OUTPUT
cfg = model[1].config
params = sum(p.numel() for p in model[0].parameters())
embed = cfg.vocab_size * cfg.hidden_size  # looked up, not multiplied, for every prompt token
weight_bytes = params * 4
flops_decode = 2 * params
flops_prefill = {n: 2 * (params - embed) * n + 2 * embed for n in prefill}
print(f"weights: {params / 1e6:.1f} M parameters = {weight_bytes / 1e9:.2f} GB in float32")
for n, t in prefill.items():
    print(f"prefill {n:>3}: {flops_prefill[n] / t / 1e9:6.1f} GFLOP/s, "
          f"{flops_prefill[n] / weight_bytes:6.1f} FLOP per weight byte")
print(f"decode     : {flops_decode / t_decode / 1e9:6.1f} GFLOP/s, "
      f"{flops_decode / weight_bytes:6.1f} FLOP per weight byte, "
      f"weights streamed at {weight_bytes / t_decode / 1e9:.1f} GB/s")

# %% [markdown]
# Prefill's GFLOP/s rise with the prompt length: the same weights, read once, feed more arithmetic.
# Decode's GFLOP/s stay low, and its "weights streamed" rate is the one near the memory's speed.
#
# That is the whole case for batching decodes (chapters 02–03).
# A decode step of 16 requests reads the same 0.54 GB of weights as a step of one.
# A GPU makes the gap wider still: an H100's published peaks need about 300 FLOPs per byte.
# Chapter 08 shows three ways minicb makes a CPU step itself faster.
#
# ## 2. Pages and the page pool
#
# Decode needs the K and V of every earlier position, in every layer. For this model:

# %%
# NBVAL_CHECK_OUTPUT
bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, fp32
page_size = engine.config.page_size
print(f"K/V per token: 2 x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x "
      f"{cfg.head_dim} dims x 4 bytes = {bytes_per_token:,} bytes ({bytes_per_token / 1024:.0f} KiB)")
print(f"one page of {page_size} tokens: {bytes_per_token * page_size / 2**20:.2f} MiB")
print(f"this engine's pool: {engine.pool.num_pages} pages = "
      f"{engine.pool.num_pages * page_size:,} tokens = "
      f"{engine.pool.num_pages * page_size * bytes_per_token / 2**30:.2f} GiB")
print("one layer's K cache is a tensor of shape", tuple(engine.pool.k[0].shape),
      "= [num_pages, page_size, num_kv_heads, head_dim]")

# %% [markdown]
# How long will a request be? Nobody knows in advance: it stops at an end-of-sequence token.
# Reserving room for the longest possible request wastes most of it; growing a region means copying.
# Paging (the idea behind vLLM's PagedAttention) avoids both.
# The cache is one big array of **pages** (16 tokens each here).
# A request owns a list of page ids, its **page table**, in token order.
# It takes one more page whenever its tokens cross a page boundary, and the pages need not be adjacent.
#
# Here is a whole page allocator on plain lists: a free list, and a reference count per page.

# %%
class ToyPagePool:
    def __init__(self, num_pages):
        self.free = list(range(num_pages))  # page ids nobody holds, in reuse order
        self.ref_count = [0] * num_pages

    def allocate(self, n):
        pages, self.free = self.free[:n], self.free[n:]
        for p in pages:
            self.ref_count[p] = 1
        return pages

    def release(self, pages):
        for p in reversed(pages):  # a sequence's last pages go back first
            self.ref_count[p] -= 1
            if self.ref_count[p] == 0:
                self.free.append(p)


def pages_needed(num_tokens, page_size=16):
    return -(-num_tokens // page_size)  # ceiling division

# %% [markdown]
# Three requests on a pool of 8 pages: A holds 40 tokens, B holds 20; A finishes; C arrives with 50 tokens.

# %%
# NBVAL_CHECK_OUTPUT
toy = ToyPagePool(8)
a = toy.allocate(pages_needed(40))
b = toy.allocate(pages_needed(20))
toy.release(a)
c = toy.allocate(pages_needed(50))
print("A:", a, " B:", b, " C:", c)
print("free list:", toy.free, " ref counts:", toy.ref_count)

# %% [markdown]
# C's page table `[5, 6, 7, 2]` is not contiguous, and that does not matter.
# minicb's `PagePool` (`minicb/kv_cache.py`) does the same bookkeeping and gives the same pages:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.kv_cache import PagePool

pool = PagePool(num_pages=8, page_size=16)
a2 = pool.allocate(pool.pages_needed(40))
b2 = pool.allocate(pool.pages_needed(20))
pool.release(a2)
c2 = pool.allocate(pool.pages_needed(50))
print("A:", a2, " B:", b2, " C:", c2)
print("free list:", list(pool.free), " ref counts:", pool.ref_count)
assert (a2, b2, c2, list(pool.free), pool.ref_count) == (a, b, c, toy.free, toy.ref_count)

# %% [markdown]
# ### Slots: where one token's K/V lives
#
# Flatten the pool into `num_pages × page_size` rows. Token position `p` of a request lives in **slot**
#
# $$\text{slot}(p) = \text{page\_table}[\lfloor p / \text{page\_size} \rfloor] \times \text{page\_size} + p \bmod \text{page\_size}$$
#
# For C, whose 50 tokens span pages 5, 6, 7 and 2:

# %%
# NBVAL_CHECK_OUTPUT
def slot(page_table, p, page_size=16):
    return page_table[p // page_size] * page_size + p % page_size


for p in (0, 15, 16, 31, 32, 47, 48, 49):
    print(f"position {p:>2} -> page {c[p // 16]}, offset {p % 16:>2} -> slot {slot(c, p)}")

# %% [markdown]
# Each step, the engine hands the model one `AttentionMetadata` with this **slot mapping** for every new token.
# The model writes new K/V through it and reads a request's context through its page table; it never sees a request.
# Built for C prefilling all 50 tokens, the metadata agrees with our function:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.attention import build_metadata

meta = build_metadata(page_tables=[c], num_computed=[0], num_new=[50], page_size=16)
assert meta.slot_mapping.tolist() == [slot(c, p) for p in range(50)]
print("slot_mapping[:3] =", meta.slot_mapping.tolist()[:3],
      "... slot_mapping[46:] =", meta.slot_mapping.tolist()[46:])
print("context length after the step:", meta.context_lens.tolist())

# %% [markdown]
# ## 3. One request's life on the real engine
#
# A request moves through `WAITING → RUNNING → FINISHED` (plus `PREEMPTED` and `SWAPPED`, chapter 06).
# Step one by hand: a 40-token prompt, 12 output tokens, greedy, `ignore_eos=True`.

# %%
# NBVAL_CHECK_OUTPUT
llm = LLM(model, policy="single")
engine = llm.engine
rid = engine.add_request(random_prompt(40, np.random.default_rng(1)),
                         SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                         request_id="A")
req = engine.requests[rid]
print(f"before step 1: {req.status.name:<8} page table {req.page_table}")
while not req.is_finished:
    rec = engine.step()
    member = rec.members[0]
    print(f"after step {rec.step:>2}: {req.status.name:<8} {member.kind:<7} {member.num_tokens:>2} "
          f"token(s), {req.num_computed_tokens:>2} in cache, page table {rec.page_tables.get(rid)}, "
          f"{len(req.output_token_ids):>2} generated")
print(engine.stats())

# %% [markdown]
# Step 1 is the prefill: 40 prompt tokens into pages `[0, 1, 2]` (48 slots), and the first token sampled.
# At step 10 the 49th token needs a slot, so the scheduler takes page 3 before the forward.
# At step 12 the request finishes, and the **reclaim** phase gives its pages back at once.
#
# Two pages are `cached`, not free. Pages 0 and 1 hold the first 32 prompt tokens, two *full* pages.
# The prefix index keeps them in case another request starts with the same 32 tokens.
# A cached page is reclaimed only when the free list runs dry, least recently used first.

# %% [markdown]
# ## 4. The prefix index: one system prompt, computed once
#
# Chat requests often share a prefix: the same system prompt, the same few-shot examples.
# The prefix index maps **full prompt pages** to the pages that hold their K/V.
# A page's key is a chained hash of its 16 tokens *and everything before them*.
# Two prompts share a page only if they agree on every token up to its end.

# %%
# NBVAL_CHECK_OUTPUT
from minicb.kv_cache import prompt_page_hashes

p1 = list(range(100, 148))  # 48 tokens: 3 full pages
p2 = p1[:40] + [7] * 8  # same first 40 tokens: pages 0 and 1 agree, page 2 differs
p3 = [99] + p1[1:]  # differs at token 0 only: every page differs
h1, h2, h3 = (prompt_page_hashes(p, 16) for p in (p1, p2, p3))
print("p2 shares pages with p1:", [x == y for x, y in zip(h1, h2)])
print("p3 shares pages with p1:", [x == y for x, y in zip(h1, h3)])

# %% [markdown]
# Now three questions behind one system prompt, on the v1 path, with fixed output lengths:

# %%
# NBVAL_CHECK_OUTPUT
system = ("You are a patient tutor for a course on LLM inference engines. Answer in plain "
          "English, in at most three sentences, and name the engine component involved when you "
          "can: the scheduler, the page pool, the prefix index, the sampler or the model "
          "forward. Prefer concrete numbers over adjectives, and say so when you are unsure.")
questions = ["What is a KV cache?", "Why is decode slow?", "What does a scheduler do?"]
llm = LLM(model, policy="single")
fixed = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
outs = llm.chat([[{"role": "system", "content": system}, {"role": "user", "content": q}]
                 for q in questions], fixed, use_tqdm=False)

trace = llm.engine.trace
first_step = {}  # request -> (prefill tokens computed, page table) at its prefill step
for rec in trace:
    for m in rec.members:
        if m.kind == "prefill":
            first_step[m.request_id] = (m.num_tokens, rec.page_tables[m.request_id])
print(f"{'request':<8}{'prompt':>7}{'cached':>7}{'computed':>9}  page table at prefill")
for o in outs:
    computed, table = first_step[o.request_id]
    print(f"{o.request_id:<8}{len(o.prompt_token_ids):>7}{o.num_cached_tokens:>7}{computed:>9}  "
          f"{table}")
prompt_total = sum(len(o.prompt_token_ids) for o in outs)
computed_total = sum(n for n, _ in first_step.values())
print(f"prefill tokens: {computed_total} computed of {prompt_total} "
      f"({prompt_total - computed_total} served from the prefix index)")

# %%
# NBVAL_IGNORE_OUTPUT
for q, o in zip(questions, outs):
    print(f"{q!r:32} -> {o.text!r}")

# %% [markdown]
# The first request computes its whole prompt.
# The next two find the system prompt's full pages in the index: their page tables *start with the same page ids*.
# Only the tail runs through the model: the system prompt's last partial page, the question and the template's closing tokens.
# A page is the unit of reuse.

# %% [markdown]
# Under v1 the sharing happens across time. Once requests run together (chapter 03), several page tables hold the same pages *at once*.
# The reference count tracks how many. The same three chats, arriving one step apart under `continuous`:

# %%
# NBVAL_CHECK_OUTPUT
llm = LLM(model, policy="continuous")
for k, q in enumerate(questions):
    ids = llm.apply_chat_template([{"role": "system", "content": system},
                                   {"role": "user", "content": q}])
    llm.engine.add_request(ids, fixed, request_id=f"chat{k}", arrival_step=k + 1)
llm.engine.run()
at3 = llm.engine.trace[2]  # step 3: all three are running
for rid, table in at3.page_tables.items():
    print(f"{rid}: page table {table}")
holders = {}
for table in at3.page_tables.values():
    for p in table:
        holders[p] = holders.get(p, 0) + 1
print("pages held by more than one request (page: ref count):",
      {p: n for p, n in holders.items() if n > 1})

# %%
viz.plot_page_map(llm.engine, step=3)

# %% [markdown]
# Pages 0 to 3 hold the prompt's first 64 tokens once, for all three requests. Each request owns only the pages of its own tail.
#
# ### Why a hit is capped at `prompt_len − 1`
#
# Send the *same* prompt twice. Its K/V is all cached, yet the model must still run on at least one token.
# The first output token comes from logits, and the cache stores K/V, not logits.
# So `match_prefix` looks at the first `prompt_len − 1` tokens only.

# %%
# NBVAL_CHECK_OUTPUT
llm = LLM(model, policy="single")
for n in (33, 32):
    prompt = list(range(500, 500 + n))
    first, again = llm.generate([prompt, prompt], SamplingParams(max_tokens=2, temperature=0.0),
                                use_tqdm=False)
    computed = [m.num_tokens for rec in llm.engine.trace for m in rec.members
                if m.request_id == again.request_id and m.kind == "prefill"]
    print(f"prompt of {n} tokens, sent twice: 2nd request cached {again.num_cached_tokens}, "
          f"computed {computed[0]}; same output: {first.token_ids == again.token_ids}")

# %% [markdown]
# nano-vllm's issue tracker shows the bug this cap avoids: a full hit leaves zero tokens to compute.
#
# ## 5. The v1 path, whole
#
# v1 runs each request alone: admit it, prefill the rest of its prompt, decode while taking pages, finish, give the pages back.
# Only then does the next one start. The three system-prompt requests ran exactly like that:

# %%
# NBVAL_CHECK_OUTPUT
print(viz.render_text(trace, width=60))
print(f"\nmost pages in use at once: {max(r.pages_used for r in trace)} of "
      f"{trace[-1].pages_total}; largest batch: {max(len(r.members) for r in trace)} request")

# %%
viz.plot_timeline(trace, title="v1 (policy='single'): one request at a time")

# %% [markdown]
# Each request waits (grey) until the one before it is done, and the batch never holds more than one request.
# A handful of the pool's 1,024 pages is ever in use. Chapter 02 asks what that costs.
#
# ## Recap
#
# - Prefill runs a whole prompt in one forward and is compute-bound. Decode reads every weight for one token and is memory-bound.
# - The KV cache is a pool of fixed-size pages. A page table lists a request's pages in token order.
# - `slot = page_table[p // page_size] * page_size + p % page_size` places each token.
# - Pages return to the pool the moment a request finishes.
# - The prefix index keeps full prompt pages under a chained hash. Later requests share them (ref count > 1) and skip that prefill.
# - The hit is capped at `prompt_len − 1`, so one token is left to produce logits.
#
# **Exercises:** [`exercises/01_paged_kv.ipynb`](../exercises/01_paged_kv.ipynb): a page pool with reference counts, the chained hash of a prompt's pages, the prefix lookup with its cap, and int8 weights (chapter 08 measures them).
#
# **Try this (not graded):** predict a request's page table and slot mapping before you run it.
# Lengthen the shared system prompt of section 4 and see how much prefill it saves.
