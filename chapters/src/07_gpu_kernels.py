# %% [markdown]
# # 07 · GPU kernels: paged attention and the KV store in Triton
#
# Everything so far ran on a CPU with the plain-PyTorch attention backend. On a GPU, minicb swaps in Triton kernels.
# Two do the attention work over the paged cache: **store** the step's new K/V into their pages, and **attend** over each member's pages for the whole mixed batch of chapter 05.
# This chapter reads both kernels and checks them against the torch reference on the CPU, in Triton's interpreter.
# Then it says what changes on a GPU, and reads what a GPU measured.
#
# **After this chapter you will be able to**
#
# - name the two functions an attention backend provides (`store_kv`, `attend`) and the metadata they read;
# - read the Triton store kernel and the paged-attention kernel (online softmax over pages, grouped-query heads);
# - check both kernels against the reference in Triton's interpreter, and run the whole model on the Triton backend;
# - say what changes on a GPU (bfloat16, the pool sized from free memory, CUDA graphs, fused kernels) and read the committed GPU results.

# %% [markdown]
# ## 0. Triton on a CPU
#
# Triton compiles kernels for GPUs. Its **interpreter** runs the same kernel code with numpy on CPU tensors: slow, but exact enough to test.
# Triton reads `TRITON_INTERPRET` when a kernel is *decorated*, so the variable must be set before anything imports `triton`.
# This cell does that, first thing, unless a GPU is present:

# %%
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# %%
# NBVAL_IGNORE_OUTPUT
%matplotlib inline
import inspect
import random
import time

import triton

from minicb.attention import build_metadata, resolve_backend, torch_ref
from minicb.attention import triton_ops as tops

print(f"triton {triton.__version__}, torch {torch.__version__}, device {DEVICE}")
print("kernels run in the interpreter:", tops._interpreted())

# %% [markdown]
# ## 1. The backend interface
#
# The model never sees a request. Each attention layer calls two functions of its backend:
#
# ```python
# store_kv(k, v, k_cache, v_cache, meta)   # write this step's new K/V rows through meta.slot_mapping
# attend(q, k_cache, v_cache, meta, scale) # -> [tokens, num_heads, head_dim]
# ```
#
# Caches are `[num_pages, page_size, num_kv_heads, head_dim]` per layer.
# `meta` holds each member's query rows (`query_start_loc`), its context length after the step, and its page table; decode members come first.
# `attention_backend="auto"` picks Triton on CUDA. On the CPU it picks `cpu`, a C kernel (chapter 08), where a C compiler can build it:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.attention import cpu_kernel

print("auto on cuda ->", resolve_backend("auto", "cuda"))
expected = "torch" if cpu_kernel.unavailable_reason() else "cpu"  # 'torch' needs no compiler
print("auto on cpu  -> 'cpu' where a C compiler builds the kernel, else 'torch':",
      resolve_backend("auto", "cpu") == expected)

# %% [markdown]
# ## 2. The KV-store kernel
#
# Each program copies a block of `BLOCK_T` tokens' K and V rows to the cache slots given by the slot mapping.
# A slot below 0 is skipped, so a batch padded to a fixed size (for CUDA graphs, section 6) can mark its padding rows with -1.

# %%
# NBVAL_CHECK_OUTPUT
print(inspect.getsource(tops._store_kv_kernel.fn))

# %% [markdown]
# ## 3. The paged-attention kernel
#
# One kernel serves both kinds of member. A program owns one kv head and a tile of query rows.
# Its rows are `BLOCK_Q` queries of one member times the `GROUP` query heads sharing that kv head (grouped-query attention, GQA).
# So each K and V block is loaded once for the whole group.
#
# It walks the member's context in blocks of `BLOCK_N` keys, looking each key's page up in the page table.
# It keeps a running maximum, a running sum and an accumulator: the **online softmax** of FlashAttention, which never builds the full score matrix.
# Keys after a query's position are masked (causal), and so is every slot past the context: the mask chapter 05 drew.

# %%
# NBVAL_CHECK_OUTPUT
print(inspect.getsource(tops._paged_attention_kernel.fn))

# %% [markdown]
# The host side launches it twice per layer and step: once over the decode rows, once over the prefill chunks' tiles.
# A chunk may start in the middle of a page.

# %%
# NBVAL_CHECK_OUTPUT
print(inspect.getsource(tops.attend))

# %% [markdown]
# ## 4. Checking the kernels against the reference, on the CPU
#
# A small mixed step by hand: two decode members and one prefill chunk, page size 8, a GQA group of 2.
# The pages come in shuffled order, and the two decodes **share** their first two pages (a prefix hit).
# Every slot no token owns holds NaN, so a backend that reads a wrong slot turns its output into NaN.

# %%
# NBVAL_CHECK_OUTPUT
PAGE, KV_HEADS, GROUP, HEAD_DIM = 8, 2, 2, 16
members = [(22, 1), (39, 1), (9, 20)]  # (tokens already cached, tokens this step)
gen = torch.Generator().manual_seed(0)
rng = random.Random(0)

need = [-(-(done + new) // PAGE) for done, new in members]
order = list(range(sum(need) + 2))
rng.shuffle(order)
shared = order[:2]  # the two decodes start with the same two pages
free = order[2:]
tables = [shared + [free.pop() for _ in range(need[0] - 2)],
          shared + [free.pop() for _ in range(need[1] - 2)],
          [free.pop() for _ in range(need[2])]]
num_pages = len(order)
k_cache = torch.full((num_pages, PAGE, KV_HEADS, HEAD_DIM), float("nan"))
v_cache = torch.full_like(k_cache, float("nan"))
for table, (done, _) in zip(tables, members):
    for pos in range(done):  # what earlier steps stored
        k_cache[table[pos // PAGE], pos % PAGE] = torch.randn(KV_HEADS, HEAD_DIM, generator=gen)
        v_cache[table[pos // PAGE], pos % PAGE] = torch.randn(KV_HEADS, HEAD_DIM, generator=gen)
# the two shared pages must hold the same tokens for both decodes: member 1 wrote them last
meta = build_metadata(tables, [d for d, _ in members], [n for _, n in members], PAGE,
                      device=DEVICE)
tokens = sum(n for _, n in members)
q = torch.randn(tokens, KV_HEADS * GROUP, HEAD_DIM, generator=gen)
k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
print("page tables:", tables)
print("query lengths", meta.query_lens, "| contexts after the step", meta.context_lens_list,
      "| decodes", meta.num_decodes)

# %% [markdown]
# Store with both backends into two copies of the caches, then attend with both:

# %%
# NBVAL_IGNORE_OUTPUT
scale = HEAD_DIM ** -0.5
caches = {}
outs = {}
timings = {}
for name, backend in (("torch", torch_ref), ("triton", tops)):
    kc, vc = k_cache.clone().to(DEVICE), v_cache.clone().to(DEVICE)
    t0 = time.perf_counter()
    backend.store_kv(k.to(DEVICE), v.to(DEVICE), kc, vc, meta)
    outs[name] = backend.attend(q.to(DEVICE), kc, vc, meta, scale).cpu()
    timings[name] = time.perf_counter() - t0
    caches[name] = (kc.cpu(), vc.cpu())
print({name: f"{t * 1000:.0f} ms" for name, t in timings.items()},
      "(the interpreter runs kernels in numpy, one program at a time)")

# %%
# NBVAL_CHECK_OUTPUT
same_k = torch.equal(caches["torch"][0].nan_to_num(7.0), caches["triton"][0].nan_to_num(7.0))
same_v = torch.equal(caches["torch"][1].nan_to_num(7.0), caches["triton"][1].nan_to_num(7.0))
diff = (outs["triton"] - outs["torch"]).abs().max().item()
print("store_kv: identical caches (K, V):", same_k, same_v)
print("attend: no NaN in either output:", not outs["torch"].isnan().any().item(),
      not outs["triton"].isnan().any().item())
print("attend: max |triton - torch| < 1e-5:", diff < 1e-5)

# %% [markdown]
# And the reference against ordinary attention: gather each member's keys in token order and run causal `scaled_dot_product_attention` without pages.
# Paging is only an indirection, so the numbers must agree.

# %%
# NBVAL_CHECK_OUTPUT
import torch.nn.functional as F

kc, vc = caches["torch"]
qsl = meta.query_start_loc.tolist()
worst = 0.0
for b, (table, (done, new)) in enumerate(zip(tables, members)):
    ctx = done + new
    slots = [table[p // PAGE] * PAGE + p % PAGE for p in range(ctx)]
    keys = kc.view(-1, KV_HEADS, HEAD_DIM)[slots].transpose(0, 1)  # [kv heads, ctx, dim]
    values = vc.view(-1, KV_HEADS, HEAD_DIM)[slots].transpose(0, 1)
    queries = q[qsl[b]:qsl[b + 1]].transpose(0, 1)  # [heads, new, dim]
    mask = torch.arange(ctx)[None, :] <= torch.arange(done, ctx)[:, None]
    dense = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                           enable_gqa=True).transpose(0, 1)
    worst = max(worst, (dense - outs["torch"][qsl[b]:qsl[b + 1]]).abs().max().item())
print("paged reference == dense causal attention (max diff < 1e-5):", worst < 1e-5)

# %% [markdown]
# `tests/test_triton.py` does this on many random cases: ragged decodes, chunks starting mid-page, shared pages, several page sizes and GQA groups.
#
# ## 5. The whole model on the Triton backend
#
# The same check one level up: SmolLM2 with `attention_backend="triton"`, every layer's kernels in the interpreter, against the torch backend.
# Three requests and a 16-token budget give two mixed steps (one chunk starts mid-page) and two decode-only steps.
# On a GPU the decode-only steps would replay a CUDA graph (section 6); here they run the graph runner's padded buffers without capture.
# Interpreting 30 layers of kernels is slow, so this is 5 steps only.

# %%
# NBVAL_IGNORE_OUTPUT
from minicb.engine import Engine
from minicb.model.loader import load_model
from minicb.request import SamplingParams

model = load_model("smollm2-135m", device=DEVICE)  # float32, on the GPU when there is one
requests = [("a", list(range(1000, 1012)), 5, None), ("c", list(range(3000, 3004)), 5, None),
            ("b", list(range(2000, 2020)), 3, 2)]  # (id, prompt, max_tokens, arrival step)
results, seconds, graph_batches = {}, {}, []
for backend in ("torch", "triton"):
    engine = Engine(model, policy="pd", attention_backend=backend, device=DEVICE,
                    max_num_batched_tokens=16, chunk_size=16,
                    num_pages=64)  # the GPU default: max_num_seqs full contexts, far too many
    if backend == "triton":
        if engine.runner.graph_runner is None:  # on the CPU: the graph runner's buffers, no capture
            engine.runner.graph_runner = engine.runner.make_graph_runner(capture=False)
        replay = engine.runner.graph_runner.run
        engine.runner.graph_runner.run = lambda *args: graph_batches.append(len(args[0])) or replay(*args)
    for rid, prompt, max_tokens, arrival in requests:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                  ignore_eos=True),
                           request_id=rid, arrival_step=arrival)
    t0 = time.perf_counter()
    engine.run()
    seconds[backend] = time.perf_counter() - t0
    results[backend] = engine
model[0].set_attention_backend("torch")  # the engine set it on the shared model: put it back
print({b: f"{s:.1f} s" for b, s in seconds.items()})

# %%
# NBVAL_CHECK_OUTPUT
for rec in results["triton"].trace:
    print(rec.step, [(m.request_id, m.kind, m.num_tokens) for m in rec.members])
runner = results["triton"].runner.graph_runner
print("decode-only steps through the graph runner:", graph_batches, "-> padded to buckets",
      [runner.bucket(n) for n in graph_batches])
print("same greedy tokens with the Triton kernels as with the torch reference:",
      all(results["triton"].requests[r].output_token_ids
          == results["torch"].requests[r].output_token_ids for r, *_ in requests))

# %% [markdown]
# ## 6. What changes on a GPU
#
# The scheduler, the pages, the trace and every chapter's code stay the same. Underneath, five things change.
#
# **bfloat16.** `dtype="auto"` is float32 on the CPU (exact parity with the reference) and bfloat16 on CUDA: half the bytes, and tensor-core products.
# The kernels accumulate in float32 whatever the input dtype.
#
# **The page pool is sized from free memory.** After loading the weights, minicb takes `gpu_memory_utilization` (0.9) of the free memory, less 512 MiB of headroom, in pages.
# It never takes more than `max_num_seqs` full-length contexts could fill:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.runner import default_num_pages
from minicb.kv_cache import page_bytes

print(inspect.getsource(default_num_pages))
cfg = model[1].config
bytes_per_page = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16
agrees = bytes_per_page == page_bytes(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim,
                                     torch.bfloat16)
print(f"SmolLM2-135M: {cfg.num_layers} layers x {cfg.num_kv_heads} kv heads x {cfg.head_dim}"
      f" dims -> one 16-token page = {bytes_per_page / 1024:.0f} KiB in bf16 "
      f"(minicb's kv_cache.page_bytes agrees: {agrees})")
for free_gib in (20, 75):  # e.g. a 24 GB card, an 80 GB H100, after loading the weights
    pages = int((free_gib * 2**30 * 0.9 - 512 * 2**20) // bytes_per_page)
    print(f"{free_gib} GiB free -> {pages:,} pages = {pages * 16 / 1e6:.1f} M tokens of KV cache")
for slots in (16, 256):
    cap = slots * cfg.max_position_embeddings // 16
    print(f"max_num_seqs={slots}: {slots} contexts of {cfg.max_position_embeddings:,} tokens "
          f"fill at most {cap:,} pages ({cap * 16 / 1e6:.2f} M tokens)")

# %% [markdown]
# On the CPU the default is 1,024 pages. On a GPU the pool stops at what `max_num_seqs` contexts can fill; raise `max_num_seqs` or pass `num_pages` for more.
#
# **CUDA graphs for decode steps.** A small model's decode step is a few hundred short kernel launches, each costing CPU time.
# A CUDA graph records the whole decode forward once for a fixed batch size and replays it with one launch.
# The engine captures one graph per bucket of 1, 2, 4, … requests (`minicb/cuda_graphs.py`).
# A step of B decodes replays the smallest bucket of at least B.
# Padding rows get slot −1 and context length 0. Steps with a prefill chunk run eagerly: their shapes vary too much.

# %%
# NBVAL_CHECK_OUTPUT
from minicb.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphRunner, graph_buckets

print("buckets:", DEFAULT_BUCKETS, "-> with max_num_seqs=16:", graph_buckets(16))
print(inspect.getsource(DecodeGraphRunner.run))

# %% [markdown]
# **Fewer kernels: fused RMSNorm and RoPE.** A graph removes the cost of *launching* kernels, not of running them.
# In plain PyTorch one RMSNorm is 6–8 kernels and RoPE on q and k is 14.
# So a backend also provides `rms_norm` and `rope`: the reference keeps plain PyTorch, and the Triton backend does each in one kernel.
# `count_launches` (`minicb/benchmark/launches.py`) counts the kernels of one decode step with either backend:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.benchmark.launches import count_launches

kv = model[0].allocate_kv_cache(4, 16)
ids, positions = torch.tensor([5, 6], device=DEVICE), torch.tensor([10, 20], device=DEVICE)


def decode_step():  # two decode rows, contexts of 11 and 21 tokens after this step
    meta = build_metadata([[0], [1, 2]], [10, 20], [1, 1], 16, device=DEVICE)
    return model[0](ids, positions, meta, kv, torch.arange(2, device=DEVICE))


launches = {}
for backend in ("torch", "triton"):
    model[0].set_attention_backend(backend)
    decode_step()  # RoPE tables, compilation on a GPU
    launches[backend] = count_launches(decode_step)
model[0].set_attention_backend("torch")
for backend, counts in launches.items():
    print(f"{backend:>6} backend: {sum(counts.values()):4d} kernels per decode step, "
          f"{sum(counts.values()) / cfg.num_layers:.1f} per layer")
print("triton kernels:", {k: v for k, v in sorted(launches["triton"].items())
                          if k.startswith("triton.")})

# %% [markdown]
# Whether fewer kernels make a faster step is a question for a GPU: `bench/gpu_check.py` times this decode step both ways (below).

# %% [markdown]
# **A bandwidth target for decode attention.** A decode row reads its whole context's K and V once and does little arithmetic.
# So decode attention is judged by bandwidth, against a plain device-to-device copy on the same GPU. The target is at least half the copy bandwidth.

# %%
# NBVAL_CHECK_OUTPUT
rows, context, kv_heads, head_dim = 64, 2048, 8, 128
kv_bytes = rows * context * kv_heads * head_dim * 2 * 2  # K and V, 2 bytes each
print(f"K/V read by one decode-attention call: {kv_bytes / 2**20:.0f} MiB")
for name, tb_per_s in (("H100 SXM, nominal HBM3 3.35 TB/s", 3.35e12),):
    print(f"at half of {name}: {kv_bytes / (tb_per_s / 2) * 1e6:.0f} us per call")
print("(a measured copy runs below the nominal figure, so the real target allows a little more)")

# %% [markdown]
# **What a GPU measured.** The prepared check (`bench/gpu_check.sh`) ran on a lent data-center GPU and wrote `bench/gpu-results-2026-12-04.md`.
# That machine had no network, so the benchmark ran a checkpoint of SmolLM2-135M's exact shapes with random weights.
# With greedy sampling and EOS ignored, both engines do the same work. This cell reads the committed table:

# %%
# NBVAL_CHECK_OUTPUT
from pathlib import Path

bench_dir = Path(inspect.getfile(tops)).parents[2] / "bench"
measured = (bench_dir / "gpu-results-2026-12-04.md").read_text().splitlines()
wanted = {"| kernel tests": "kernel tests on CUDA", "| copy bandwidth": "copy bandwidth",
          "| decode attention, default": "decode attention, 32 q / 8 kv heads of 128",
          "| decode attention, torch": "  the torch reference",
          "| decode attention at SmolLM2": "decode attention at SmolLM2's heads",
          "| decode step": "decode step, fused vs torch norm + RoPE",
          "| mixed-chat, pd |": "mixed-chat, pd", "| mixed-chat, hf-generate-batch |": "mixed-chat, HF",
          "| mixed-chat, pd ÷": "mixed-chat, pd ÷ HF generate_batch"}
for line in measured:
    for start, label in wanted.items():
        if line.startswith(start):
            figure = line.strip("|").split(" | ", 1)[1].strip().replace("**", "")
            print(f"{label:<44} {figure.split('; reference')[0]}")

# %% [markdown]
# Decode attention reached most of the copy bandwidth, above its target; the torch reference far less.
# The fused decode step beat the unfused one, and `pd` beat Hugging Face's default `generate_batch` by far more than the 2× target.
# Transformers ran without its CUDA graphs there. `bench/gpu-api-2026-12-04.md` forced them on, and pd's lead shrank but stayed above 2×.
#
# The second check ran every policy on the same workload and GPU:

# %%
# NBVAL_CHECK_OUTPUT
api_report = (bench_dir / "gpu-api-2026-12-04.md").read_text().split("## 2.")[1].split("```")[1]
print(f"{'policy':<11}{'out tok/s':>10}{'TTFT p50':>9}{'TTFT p99':>9}{'TPOT p50':>9}{'steps':>6}")
seen = set()
for line in api_report.splitlines():
    cells = line.split()
    if cells and cells[0] in ("single", "static", "dynamic", "continuous", "chunked", "pd") \
            and cells[0] not in seen:  # the first table only
        seen.add(cells[0])
        print(f"{cells[0]:<11}{cells[1]:>10}{cells[3]:>9}{cells[4]:>9}{cells[5]:>9}{cells[-2]:>6}")

# %% [markdown]
# On this GPU and this small model chapter 06's CPU ordering turns over: static batching gives the most tokens per second.
# A SmolLM2 step is too small to fill a GPU. Its time depends less on its tokens than on whether it replays a graph (decode-only) or runs eagerly (any prefill).
# Latency still favours the iteration-level policies: continuous batching has the best TTFT.
#
# Two settings decide this, and another run measured both (`bench/gpu-settings-2026-12-04.md`). This cell reads the committed results:

# %%
# NBVAL_CHECK_OUTPUT
import json

print(f"{'setting':<26}{'policy':<11}{'out tok/s':>10}{'TTFT p50':>9}{'TTFT p99':>9}"
      f"{'TPOT ms':>8}{'steps':>6}")
for name, label in (("default", "16 slots, budget 256"), ("nographs", "  CUDA graphs off"),
                    ("budget2048", "16 slots, budget 2048"), ("seqs32", "32 slots, budget 2048")):
    run = json.loads((bench_dir / "results" / f"gpu-h200-2026-12-04-{name}.json").read_text())
    for policy, r in run["results"].items():
        print(f"{label:<26}{policy:<11}{r['output_tokens_per_s']:>10.0f}{r['ttft_s']['p50']:>9.3f}"
              f"{r['ttft_s']['p99']:>9.3f}{r['tpot_s']['p50'] * 1e3:>8.1f}{r['num_steps']:>6}")
        label = ""

# %% [markdown]
# The same numbers as a picture: tokens per second and the median wait for the first token, per setting.

# %%
# NBVAL_IGNORE_OUTPUT
import matplotlib.pyplot as plt

from minicb.course import viz

settings = {"default\n(16, 256)": "default", "graphs off": "nographs",
            "budget 2048": "budget2048", "32 slots,\nbudget 2048": "seqs32"}
runs = {label: json.loads((bench_dir / "results" / f"gpu-h200-2026-12-04-{name}.json")
                          .read_text())["results"] for label, name in settings.items()}
viz.use_course_style()
fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(13, 4.6), layout="constrained")
for i, policy in enumerate(("static", "continuous", "pd")):
    x = [j + (i - 1) * 0.27 for j in range(len(runs))]
    style = dict(width=0.27, label=policy, color=viz.request_colour(i), edgecolor="black")
    ax_tput.bar(x, [r[policy]["output_tokens_per_s"] for r in runs.values()], **style)
    ax_ttft.bar(x, [r[policy]["ttft_s"]["p50"] for r in runs.values()], **style)
for ax, title in ((ax_tput, "output tokens / s (higher is better)"),
                  (ax_ttft, "TTFT p50, s (lower is better; log scale)")):
    ax.set_xticks(range(len(runs)), list(runs))
    ax.set_title(title)
ax_ttft.set_yscale("log")
ax_tput.legend()
fig.suptitle("mixed-chat on a GPU, measured (bench/results/gpu-h200-*.json)")
plt.show()

# %% [markdown]
# - **CUDA graphs matter most here.** With them off, every decode step launches its kernels one by one, and throughput falls several-fold.
# - **The token budget was chosen for a CPU.** At 256 tokens `pd` chunks long prompts into many eager steps; at 2,048 it leads throughput and TTFT.
# - **With 32 slots** static batching leads throughput again, while `pd` keeps the best TTFT tail: chapter 02's trade, on a GPU.
#
# The default runs differ between result files with nothing changed: compare within one run.
# Size the budget to the machine; chapters 04–05 reasoned about a CPU step, whose cost grows with its tokens.

# %% [markdown]
# ## 7. Running the course on a GPU
#
# [docs/gpu.md](../docs/gpu.md) has the install line and the GPU checks.
# With a CUDA build of torch, `device="auto"` puts the engine on the GPU, and the chapters are meant to run unchanged.
# Make the examples bigger where the chapters say so, and give the token budget thousands of tokens.
#
# **Compiled for a GPU, on this CPU.** The interpreter runs a kernel's logic, not the GPU's compiler.
# A kernel can pass every test here and still fail to compile, or *spill* (run out of registers, parking values in slow local memory).
# Triton ships its own compiler and NVIDIA's `ptxas`, so it can compile for an H100 (`sm_90`) without one.
# `bench/compile_check.py` runs one forward with a stand-in driver that compiles every launch and reports what `ptxas -v` says:

# %%
# NBVAL_IGNORE_OUTPUT
import json
import subprocess
import sys
import tempfile

script = bench_dir / "compile_check.py"
env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for real
with tempfile.TemporaryDirectory() as tmp:
    done = subprocess.run([sys.executable, str(script), "--models",
                           "smollm2-135m", "--dtypes", "bfloat16,float32", "--json",
                           f"{tmp}/rows.json"], env=env, capture_output=True, text=True)
    rows = json.load(open(f"{tmp}/rows.json")) if done.returncode in (0, 1) else []
assert done.returncode == 0 and rows, done.stdout[-2000:] + done.stderr[-2000:]
print(f"{'dtype':<10}{'kernel':<26}{'warps':>6}{'registers':>10}{'spilled':>8}"
      f"{'in loops':>9}{'shared KiB':>11}")
for r in rows:
    kernel = r["kernel"].removesuffix("_kernel")
    if kernel == "paged_attention":
        kernel += f" ({r['launch'].split()[0]})"  # decode or prefill
    print(f"{r['dtype']:<10}{kernel:<26}{r['num_warps']:>6}{r['registers']:>10}"
          f"{r['spill_bytes']:>8}{r['loop_spills']:>9}{r['shared_bytes'] / 1024:>11.1f}")

# %% [markdown]
# Where a spill sits matters as much as its size: the `in loops` column counts spill instructions inside a loop, and only those fail the check.
# It says nothing about speed, but it catches in seconds, on any Linux machine, what would otherwise cost a borrowed GPU's first minutes.
#
# ## Recap
#
# - An attention backend is `store_kv` and `attend` over one flat batch and its metadata (plus `rms_norm` and `rope`).
# - The store kernel scatters K/V through the slot mapping. The attention kernel runs an online softmax over a member's pages, per kv head and GQA group.
# - In Triton's interpreter both kernels match the reference, which matches dense attention; the whole model gives the same greedy tokens.
# - On a GPU: bfloat16, a pool sized from free memory, decode steps replayed from CUDA graphs, and fused norm and RoPE kernels.
# - The committed GPU results (`bench/gpu-results-2026-12-04.md`, `bench/gpu-settings-2026-12-04.md`) say: graphs matter most for a small model, and the budget must be sized to the machine.
#
# **Try it:** run the kernel check with page size 1 and 64, with `GROUP = 3` as in SmolLM2, and with a chunk starting at a page's last slot.
#
# **Exercises:** [`exercises/07_paged_attention.ipynb`](../exercises/07_paged_attention.ipynb): the slot mapping and attention over pages in plain PyTorch, checked against minicb's.
