# %% [markdown]
# # 01 · One request at a time, over a paged KV cache (v1)
#
# v1 is the engine before any batching: one request runs alone, first its **Prefill**
# (the whole prompt in one forward), then its **Decode** (one token per forward) until it
# ends. What v1 already gets right is memory: the KV cache lives in fixed-size **pages** drawn from
# one **页池 page pool**, and a **前缀索引 prefix index** lets a later request reuse pages that an
# earlier one computed for the same prompt prefix. The seed puts it as "v1 的重点在于单请求路径上的
# 显存复用": v1 is about reusing memory along the single-request path.
#
# **After this chapter you will be able to**
#
# - measure prefill and decode on this machine and explain, with the numbers, why one is
#   compute-bound and the other memory-bound;
# - build a page allocator and a page table by hand, compute a token's slot, and check both
#   against minicb's `PagePool` and attention metadata;
# - follow one request through WAITING → RUNNING → FINISHED and watch its page table grow;
# - reuse a shared system prompt across requests with the prefix index, and say why the hit is
#   capped at `prompt_len − 1`.

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
# `load_model` returns the weights and the model's description once; `LLM(model, ...)` builds an
# engine around them, each with its own page pool, queues and trace. That keeps the chapter fast:
# we build several engines but load the weights once.
#
# ## 1. Two phases with different costs
#
# Autoregressive generation has two phases (seed §2.1):
#
# - **Prefill**: the whole prompt goes through the model in one forward. Every position's key
#   and value vectors (K/V) are computed and stored; the last position's logits give the first
#   output token. The work grows with the prompt length.
# - **Decode**: each step feeds only the newest token, attends over the stored K/V, and samples
#   one more token, until an end-of-sequence token or `max_tokens`.
#
# Let us time both. The `single` policy is v1: one request at a time. A request with
# `max_tokens=1` is exactly one prefill step; the engine records the seconds spent inside the
# model for every step in `StepRecord.t_forward`.

# %%
# NBVAL_IGNORE_OUTPUT
import torch

from minicb.benchmark.runs import device_description
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
print(f"(measured on: {device_description('cpu')['cpu_model']}, "
      f"{torch.get_num_threads()} torch thread(s))")

# %% [markdown]
# A prefill step of 256 tokens costs about as much as five to twenty decode steps, depending
# on the machine and its load (the line above says how many here), yet produces
# the K/V of 256 positions: per token, prefill is an order of magnitude faster than decode, and
# its tokens/s still climbs from 16 to 256 prompt tokens. (Absolute numbers depend on the machine
# and on what else it runs at the time; compare ratios measured in one run.) Why?
#
# Count what one step has to do. The model has about 134 M parameters in float32, so **every
# forward reads about 0.54 GB of weights**, whatever the number of tokens in it. Each token costs
# about 2 FLOPs per parameter it meets (a multiply and an add).
#
# - A decode step does 2 × 134 M ≈ 0.27 GFLOP of work for those 0.54 GB: about **0.5 FLOP per
#   byte**.
# - A prefill of N tokens reuses each weight N times: about **0.5 × N FLOP per byte**, 128 for
#   N = 256. (The output layer runs for the last position only, which the estimate below accounts
#   for: about 100 for N = 256.)
#
# The course's build machines (2 cores of an AMD EPYC or an Intel Xeon, depending on the day,
# measured unloaded when the course was written) reach about 110 GFLOP/s on a large fp32 matrix product through PyTorch's default path and move
# about 15 GB/s: they need about 7 FLOPs per byte to keep their arithmetic busy. (A better weight
# layout raises the arithmetic figure; the last part of this section shows how.) Below that
# ratio a step waits for memory (访存密集 memory-bound), above it for arithmetic (计算密集
# compute-bound). Decode sits at 0.5, far below; prefill at 128, far above. The numbers measured
# above say the same:

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
# Prefill's GFLOP/s rise with the prompt length and end more than ten times above decode's: the
# same weights, read once per step, feed more and more arithmetic. Decode's GFLOP/s are low
# because the step spends its time reading 0.54 GB of weights for 0.27 GFLOP of work; its
# "weights streamed" figure is the one that sits near what the memory system delivers. On an
# unloaded build machine, through PyTorch's default `F.linear`, the same picture shows at full
# speed: a prefill of 1,280 tokens at about 110 GFLOP/s (that path's arithmetic peak), one decode
# step of the linear layers in about 53 ms (19 tokens/s, about 10 GB/s of weights: most of the
# 15 GB/s bandwidth). This notebook's figures come from minicb's default prepacked weights
# (last part of this section) and one thread. On the AMD EPYC their decode streamed the weights
# at over 20 GB/s (42 tokens/s × 0.54 GB, below), above the 15 GB/s of a copy, which writes as many bytes as it reads; on the
# Intel Xeon, where one prepacked row gains little or is slower than `F.linear` (last part of
# this section), at 6–10 GB/s. The last line printed below the step table names the CPU that built the
# stored outputs; stored figures also vary with what else that machine ran at the time.
#
# That is the whole motivation for batching decodes (chapters 02–03): a decode step of 16
# requests reads the same 0.54 GB of weights as a step of one request. Through `F.linear` the
# build machines ran batch 16 at about 163 ms per step, 98 tokens/s, against 19 tokens/s for
# batch 1. On a GPU the gap is
# far wider: an H100 streams about 3 TB/s but computes near 1,000 TFLOP/s in bf16, so it needs
# about 300 FLOPs per byte before decode stops being memory-bound.

# %% [markdown]
# ### The other lever: fewer bytes per weight
#
# If a decode step waits for 0.54 GB of weights, a step that reads fewer bytes finishes sooner.
# `quantization="int8"` stores every projection and the output layer as int8, with one scale
# per output row (`minicb/model/quant.py`, weight-only quantization): about 0.13 GB per step
# instead of 0.54. Activations stay float32 between layers; each product runs in PyTorch's
# int8-weight kernel, which takes them and the scales in bfloat16. Same prompt, both ways:

# %%
# NBVAL_IGNORE_OUTPUT
model_int8 = load_model("smollm2-135m", quantization="int8")
question = [{"role": "user", "content": "Write a haiku about the sea."}]
greedy = SamplingParams(max_tokens=24, temperature=0.0)
answers = {}
for name, pair in (("float32", model), ("int8", model_int8)):
    chat_llm = LLM(pair, policy="single", enable_prefix_caching=False)
    chat_llm.chat(question, greedy, use_tqdm=False)  # warm-up
    answers[name] = chat_llm.chat(question, greedy, use_tqdm=False)[0]
    t = float(np.median([r.t_forward for r in chat_llm.engine.trace[-23:]]))
    print(f"{name:<8} decode {t * 1e3:5.1f} ms/token = {1 / t:5.1f} tokens/s")
same = next((i for i, (a, b) in enumerate(zip(answers["float32"].token_ids,
                                               answers["int8"].token_ids)) if a != b), 24)
print(f"greedy tokens agree for the first {same} of 24")
for name, out in answers.items():
    print(f"{name:<8} {out.text!r}")

# %% [markdown]
# On the AMD EPYC build machine, unloaded (one thread), int8 decoded 64 tokens/s, float32 42 (26
# through `F.linear`, see the next part; on the Intel Xeon int8 16–29 and float32 11–16 across
# builds of this notebook, the stored run above among them)
# and Hugging Face `generate` 23–24 (`python -m minicb bench
# --policy single --compare hf --quantization int8`; the numbers are in `bench/README.md`). The
# price is numbers, not speed: int8 weights (with their bfloat16 scales, and the kernel's
# bfloat16 activations) move the logits by up to about 5% of their largest value. Greedy decoding keeps float32's token wherever the best token leads the next by more than
# int8 moves them; at the first step where two tokens were nearly tied it can pick the other one, and from
# there the text takes another branch. The `greedy tokens agree` line above counts how many of the
# 24 agreed in this run. Whether and where the two part depends on the prompt, the length and the
# CPU's kernels: they can agree all the way on one machine and part partway through on another, or
# on a longer answer. That is why minicb stays float32 by default, where its tokens equal
# transformers' exactly, and int8 is a knob you turn on knowing what it changes.

# %% [markdown]
# ### A third lever: the same bytes, a better layout
#
# How fast a matrix product runs also depends on how its weight sits in memory. `F.linear` hands
# a float32 product to PyTorch's general matrix multiply, which copies the weight into the layout
# of its inner loops on every call. oneDNN, the CPU library under PyTorch, can store a weight once
# in its own blocked layout, after which every product reads it as it is. minicb does that when
# it loads float32 weights on an x86-64 CPU (`minicb/model/prepack.py`: `PackedLinear`, which
# replaces each projection and the output layer); `load_model(..., prepack=False)`, or
# `MINICB_PREPACK=0` in the environment, keeps `F.linear`. The weights, their bytes and their
# float32 type stay the same (SmolLM2's output layer shares the embedding's weights, so it gets
# a packed copy of its own, 113 MB). Same engine, both ways, at 1 and at 16 requests per decode
# step:

# %%
# NBVAL_IGNORE_OUTPUT
model_plain = load_model("smollm2-135m", prepack=False)
print("prepacked:", model[0].prepacked, "| plain:", model_plain[0].prepacked)
print(model[0].layers[0].mlp.down_proj, "vs", model_plain[0].layers[0].mlp.down_proj)


def decode_ms(pair, rows: int) -> float:
    """Median forward time of the decode steps that ran `rows` requests together."""
    batch_llm = LLM(pair, policy="continuous", max_num_seqs=rows, enable_prefix_caching=False)
    prompts = [random_prompt(32, np.random.default_rng(i)) for i in range(rows)]
    batch_llm.generate(prompts, SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    steps = [r.t_forward for r in batch_llm.engine.trace
             if len(r.members) == rows and all(m.kind == "decode" for m in r.members)]
    return float(np.median(steps)) * 1e3


print(f"\n{'rows':>5}{'F.linear ms':>13}{'prepacked ms':>14}{'speed-up':>10}")
for rows in (1, 16):
    plain_ms, packed_ms = decode_ms(model_plain, rows), decode_ms(model, rows)
    print(f"{rows:>5}{plain_ms:>13.1f}{packed_ms:>14.1f}{plain_ms / packed_ms:>9.1f}x")

# %% [markdown]
# How much the layout gains depends on the CPU, because it races whatever PyTorch's default path
# does there. `python bench/prepack_timing.py` times SmolLM2's projections alone (two threads,
# `F.linear` time divided by prepacked time) on the course's two build machines:
#
# | rows per product | 1 | 32 | 512 | 2,048 |
# |---|---|---|---|---|
# | AMD EPYC (AVX-512) | 2.1× | 2.5× | 2.4× | 2.6× |
# | Intel Xeon (AVX-512 and AMX) | 0.6–0.8× (0.9× on one thread) | 1.1–1.3× | 1.6× | 1.3× |
#
# On the EPYC every size gains. On the Xeon batches and prefill gain less, and a single row is
# *slower* prepacked: whole batch-1 decode steps measured 10–40% slower on two threads and
# 2–16% on one (the course runs one thread per process; the table printed by the code cell above is one
# such run).
# `MINICB_PREPACK=0` is the better setting there for one request at a time. minicb keeps prepacking on by default because
# batches and prefill gain on both; choosing per step would need both layouts in memory. Whole
# decode steps should change a little less than the projections, because attention and the
# small per-layer operations stay the same; the table printed above comes from the machine that
# ran this notebook, so run it to see yours (this run's 16-row step gained 1.4×, more than the
# Xeon's projection timings: single runs on a shared machine are noisy). On the EPYC at batch 1 (one thread) minicb decoded 42
# tokens/s prepacked against 26 through `F.linear` and 24 for Hugging Face `generate`; int8
# still wins at batch 1 (64), where a step is bound by bytes, and loses at 32 rows, where the
# products are bound by arithmetic (`bench/README.md`). bfloat16 weights (`dtype=torch.bfloat16`)
# are prepacked the same way where oneDNN runs bf16 products: on the Xeon, whose AMX units do,
# a forward's products ran 1.2–1.4× faster at 1–32 rows and the standard mixed benchmark of
# `python -m minicb bench` (chapter 06's tool) 1.02–1.30×.
#
# The numbers are the same products summed in another order, so they differ in the last bits:
# about one part in a million. That does not move a greedy choice here, and both ways minicb's
# tokens equal transformers' on every parity test (`tests/test_model.py`):

# %%
# NBVAL_CHECK_OUTPUT
answers_plain = LLM(model_plain, policy="single").chat(question, greedy, use_tqdm=False)[0]
print("same 24 greedy tokens, F.linear and prepacked:",
      answers_plain.token_ids == answers["float32"].token_ids)

# %% [markdown]
# ## 2. Pages and the page pool
#
# Decode needs the K and V vectors of every earlier position, for every layer. For this model
# that is:

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
# Reserving a contiguous region for the longest possible request wastes most of it; growing a
# contiguous region means copying. Paging (the idea behind vLLM's PagedAttention) avoids both:
# the cache is one big array of fixed-size **pages** (16 tokens each here), a request owns a list
# of page ids, its **page table**, in token order, and takes one more page whenever its tokens
# cross a page boundary. The pages need not be adjacent.
#
# The bookkeeping is small. Here is a whole page allocator on plain lists: a free list, and a
# reference count per page (how many page tables hold it; the prefix index, in section 4,
# makes it exceed 1).

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
# Three requests on a pool of 8 pages: A holds 40 tokens, B holds 20; A finishes; C arrives with
# 50 tokens.

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
# C's page table `[5, 6, 7, 2]` is not contiguous, and that does not matter. minicb's `PagePool`
# (in `minicb/kv_cache.py`) does the same bookkeeping, plus the K/V tensors and the prefix index.
# With no layers it allocates no tensors, so it runs instantly; the same operations give the same
# pages:

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
# The attention code needs, for each new token, the row of the cache to write to. Flattening the
# pool into `num_pages × page_size` rows, token position `p` of a request lives in **slot**
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
# Each step, the engine hands the model one `AttentionMetadata` with exactly this **slot
# mapping** for every new token of the batch (`minicb/attention/__init__.py`). The model writes
# the new K/V through it and reads a request's context through its page table; it never sees a
# request. Built for C prefilling all 50 tokens, the metadata agrees with our function:

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
# A request moves through a small state machine, `WAITING → RUNNING → FINISHED` (plus
# `PREEMPTED` and `SWAPPED`, chapter 06). Let us step one by hand: a 40-token prompt, 12 output
# tokens, greedy, with `ignore_eos=True` so that it runs exactly 12 tokens.

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
# Step 1 is the prefill: 40 prompt tokens into pages `[0, 1, 2]` (48 slots), and the first token
# sampled. Each decode step then runs the newest token through the model. At step 10 the 49th
# token needs a slot: the scheduler takes page 3 before the forward. At step 12 the request
# finishes and the **reclaim** phase gives its pages back at once.
#
# Look at the last line: two pages are `cached`, not free. Pages 0 and 1 hold the first 32 prompt
# tokens, two *full* pages, and the prefix index keeps them, unreferenced but still valid, in case
# another request starts with the same 32 tokens. Pages 2 and 3 were partly filled or held
# generated tokens; they went straight back to the free list. A cached page is reclaimed only if
# the free list runs dry (least recently used first).

# %% [markdown]
# ## 4. The prefix index: one system prompt, computed once
#
# Chat requests often share a long prefix: the same system prompt, the same few-shot examples, the
# same document. The prefix index maps **full prompt pages** to the pages that already hold their
# K/V. A page's key is a chained hash: it names the page's 16 tokens *and everything before them*,
# so two prompts share a page only if they agree on every token up to its end (the K/V of a
# position depends on all earlier tokens).

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
# Now three questions behind one system prompt, on the v1 path (`policy="single"`, one at a time).
# The output length is fixed so that the schedule does not depend on the text.

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
# The first request computes its whole prompt. The chat template puts the system prompt first,
# so the next two requests find its full pages in the index: their page tables *start with the
# same page ids* (`share` adds a reference instead of computing), and only the tail (the last
# partial page of the system prompt, their own question and the template's closing tokens) runs
# through the model. A page is a unit of reuse: a shared prefix that ends mid-page reuses only
# the full pages before it.

# %% [markdown]
# On the v1 path the sharing happens across time: each request reuses pages its predecessor left
# in the index. Once requests run together (chapter 03), several page tables hold the same pages
# *at the same time*, and the reference count tracks how many. The same three chats, arriving one
# step apart under the `continuous` policy:

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
# Pages 0 to 3 hold the prompt's first 64 tokens (the template's opening and most of the system
# prompt) once, for all three requests; each request owns only the pages of its own tail.
#
# ### Why a hit is capped at `prompt_len − 1`
#
# Send the *same* prompt twice. Its K/V is all in the cache, yet the model must still run on at
# least one token: the logits that choose the first output token come out of a forward pass, and
# the cache stores K/V, not logits. So `match_prefix` only looks at the first `prompt_len − 1`
# tokens. For a 33-token prompt that allows both full pages (32 tokens); for a 32-token prompt,
# only the first page, because the last token sits in the second one.

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
# nano-vllm's issue tracker records what happens without that cap: a full hit leaves zero tokens
# to compute and the first token has nowhere to come from.
#
# ## 5. The v1 path, whole
#
# Put together, v1 runs each request alone: admit it (reusing cached prefix pages), prefill the
# rest of its prompt in one step, decode one token per step while taking pages as it grows,
# finish, give the pages back, and only then start the next. The three system-prompt requests
# above ran exactly like that:

# %%
# NBVAL_CHECK_OUTPUT
print(viz.render_text(trace, width=60))
print(f"\nmost pages in use at once: {max(r.pages_used for r in trace)} of "
      f"{trace[-1].pages_total}; largest batch: {max(len(r.members) for r in trace)} request")

# %%
viz.plot_timeline(trace, title="v1 (policy='single'): one request at a time")

# %% [markdown]
# Each request waits (grey) until the one before it is completely done, and at any step the batch
# holds one request; a handful of the pool's 1,024 pages is ever in use. Chapter 02 asks what
# that costs when many requests arrive together.
#
# ## Recap
#
# - Prefill processes a whole prompt in one forward and is compute-bound; decode produces one
#   token per forward, reads every weight to do it, and is memory-bound. Per token, prefill ran
#   an order of magnitude faster here.
# - The KV cache is a pool of fixed-size pages. A request's page table lists its pages in token
#   order; `slot = page_table[p // page_size] * page_size + p % page_size` places each token.
#   Pages return to the pool the moment a request finishes.
# - The prefix index keeps full prompt pages under a chained hash; later requests with the same
#   prefix share them (ref count > 1) and skip that part of the prefill. The hit is capped at
#   `prompt_len − 1` tokens so that one token is always left to produce logits.
# - Since decode pays for bytes of weights, int8 weights (one scale per output row) decode about
#   1.5× faster than float32 at batch 1 on the AMD EPYC (2.7× Hugging Face), at the price of
#   slightly different numbers.
# - The same float32 weights, stored once in oneDNN's blocked layout (`prepack`, minicb's CPU
#   default), change the answers only in the last bits, and the speed by the CPU: the products
#   ran 2.1–2.6× faster than `F.linear` on the AMD EPYC, 1.1–1.6× for 32 rows or more on the
#   Intel Xeon, and 0.6–0.9× (slower) there for a single row. Measure on yours
#   (`MINICB_PREPACK=0` turns it off).
#
# **Exercises:** [`exercises/01_paged_kv.ipynb`](../exercises/01_paged_kv.ipynb): write a page
# pool with reference counts (`page_pool`, checked against `PagePool`), the chained hash of a
# prompt's full pages (`prefix_hashes`), the lookup of a cached prefix with its
# `prompt_len − 1` cap (`match_prefix`), and the int8 quantization of a weight, one scale per
# row, as `quantization="int8"` does it (`quantize_int8`).
#
# **Try this (not graded):** predict a request's page table and slot mapping before you run it,
# and lengthen the shared system prompt of section 4 to see how much more prefill it saves.
