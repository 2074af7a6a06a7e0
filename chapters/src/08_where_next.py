# %% [markdown]
# # 08 · Where next: from minicb to vLLM, SGLang and beyond one machine
#
# minicb is small on purpose, but its knobs are the ones production engines expose, under nearly
# the same names. This last chapter maps them, serves minicb over the OpenAI API and measures it
# from the client side, builds two next steps (a CPU attention kernel, speculative decoding by
# prompt lookup) from profile to measurement, and lists what a learner can build next.
#
# **After this chapter you will be able to**
#
# - translate a minicb configuration into vLLM and SGLang settings (`max_num_batched_tokens`,
#   `max_num_seqs`, `enable_chunked_prefill`, `long_prefill_token_threshold`, prefix caching,
#   preemption; SGLang's `chunked_prefill_size`, `max_running_requests`, `schedule_policy`) and
#   say where the analogy stops;
# - start minicb's OpenAI-compatible server, call it, and benchmark it with the same client you
#   would point at vLLM or SGLang;
# - follow one next step from profile to kernel: find where a CPU decode step spends its time,
#   and check a C attention kernel that reads the pages in place against the reference;
# - run steps that yield several tokens per request (speculative decoding by prompt lookup),
#   check that greedy text does not change, and measure when the guesses pay;
# - pick a next project (better speculative guesses, disaggregated prefill/decode, tensor
#   parallelism, CUDA graphs for mixed steps…) and say which part of minicb it touches.

# %% [markdown]
# ## 1. The knobs, side by side
#
# Every minicb knob lives in one dataclass, `EngineConfig`:

# %%
# NBVAL_CHECK_OUTPUT
from dataclasses import fields

from minicb import EngineConfig

defaults = EngineConfig()
for f in fields(EngineConfig):
    if f.name != "extra":
        print(f"{f.name:<24} {getattr(defaults, f.name)!r}")

# %% [markdown]
# And their counterparts (vLLM names are its engine arguments, as in `LLM(...)` or `vllm serve
# --max-num-seqs`; SGLang names are its server arguments, as in `--chunked-prefill-size`):
#
# | minicb | vLLM | SGLang | what it bounds |
# |---|---|---|---|
# | `max_num_batched_tokens` | `max_num_batched_tokens` | `chunked_prefill_size`: the prefill tokens of one step, shared by all its prompts (a mixed step's decodes count against it too); `max_prefill_tokens` is a looser cap of the same kind | tokens per step: the token budget (ch. 04–05) |
# | `max_num_seqs` | `max_num_seqs` | `max_running_requests` | requests in the running batch (ch. 03) |
# | `chunk_size` | `long_prefill_token_threshold` (caps one request's prefill tokens per step) | (none per request: a long prompt's chunk is what is left of `chunked_prefill_size`) | one request's chunk (ch. 04) |
# | `policy="chunked"` / `"pd"` vs `"continuous"` | `enable_chunked_prefill` (on by default in the V1 engine, which serves running requests before admitting new ones, close to `pd`) | chunked prefill on unless `chunked_prefill_size=-1`; `enable_mixed_chunk` mixes a chunk with decodes in one batch, like `pd` | whether prompts are cut, and whether decodes share the step (ch. 04–05) |
# | `min_chunk` | (none: any leftover budget is used) | (none) | the smallest chunk worth running (ch. 05) |
# | `enable_prefix_caching` | `enable_prefix_caching` | radix cache, on unless `disable_radix_cache` | reuse of cached prompt pages (ch. 01) |
# | `page_size` | `block_size` | `page_size` | tokens per KV page (ch. 01) |
# | `num_pages` / `gpu_memory_utilization` | `gpu_memory_utilization`, `num_gpu_blocks_override` | `mem_fraction_static` | the size of the KV pool (ch. 07) |
# | `preemption="newest"` (recompute) | preemption by recompute (V1; the older engine also had `preemption_mode="swap"`) | retracting decode requests, recomputed later | what happens when pages run out (ch. 06) |
# | `max_preemptions` | (none) | (none) | how often one request may be preempted; 0 reserves each request's whole life (ch. 06) |
# | `preemption_mode="swap"`, `num_swap_pages` | `preemption_mode="swap"` with `swap_space` (GiB) in the older engine; V1 recomputes | (none: retracted requests are recomputed) | a victim's K/V copied to host memory and back instead of recomputed; its prompt pages still cached are shared on return, not copied (ch. 06) |
# | `reject_when_full` | (none) | (none) | turn an arrival away (HTTP 503) when the free pages cannot take its prompt (ch. 06) |
# | `preemption="priority"`, `priority=` per request | `scheduling_policy="priority"`, `priority=` per request | `--enable-priority-scheduling` with `priority` per request; `schedule_policy` (`fcfs`, `lpm` longest prefix match, …) orders the queue | who waits and who is preempted (ch. 06) |
# | `num_speculative_tokens`, `prompt_lookup_max`, `prompt_lookup_min` (section 5) | `speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": …, "prompt_lookup_min": …}` | n-gram speculation (see its docs for the flags) | guessed tokens a decode step may check (ch. 08) |
# | `use_cuda_graphs` (decode-only steps, buckets of 1–64 requests) | on unless `enforce_eager`; capture sizes configurable, mixed steps too | on unless `disable_cuda_graph`; `cuda_graph_max_bs` | steps replayed as CUDA graphs (ch. 07) |
#
# Where the analogy stops:
#
# - vLLM's V1 scheduler has no separate prefill and decode phases: it walks the running requests
#   (decodes and half-done prompts alike), gives each what it still needs capped by
#   `long_prefill_token_threshold` and the remaining budget, then admits waiting requests. With
#   one long prompt that is minicb's `pd` step. vLLM's older V0 engine could cap how many prompts
#   are half-prefilled at once (`max_num_partial_prefills`); V1, like minicb, lets any number
#   continue.
# - SGLang plans prefill batches and decode batches separately by default, a prefill-first
#   design close to minicb's `chunked`; `enable_mixed_chunk` puts decodes into the chunk's batch.
#   Its `lpm` policy orders the queue by longest cached prefix, something minicb's FCFS queue
#   does not do.
# - Defaults differ a lot: vLLM's budget is in the thousands of tokens and `max_num_seqs` in the
#   hundreds on a GPU, sized for the hardware. The contract of chapter 06 applies: sweep your own
#   traffic, never copy a configuration.
#
# As code: a minicb configuration written out as the nearest vLLM and SGLang flags.

# %%
# NBVAL_CHECK_OUTPUT
def as_vllm(cfg: EngineConfig) -> list[str]:
    args = [f"--max-num-batched-tokens {cfg.max_num_batched_tokens}",
            f"--max-num-seqs {cfg.max_num_seqs}", f"--block-size {cfg.page_size}"]
    if cfg.policy in ("chunked", "pd"):
        args += ["--enable-chunked-prefill",
                 f"--long-prefill-token-threshold {cfg.chunk_size}"]
    else:
        args += ["--no-enable-chunked-prefill"]
    args += ["--enable-prefix-caching" if cfg.enable_prefix_caching
             else "--no-enable-prefix-caching"]
    if cfg.preemption == "priority":
        args += ["--scheduling-policy priority"]
    return args


def as_sglang(cfg: EngineConfig) -> list[str]:
    # SGLang's chunk is what is left of the step's budget: chunk_size has no counterpart
    budget = cfg.max_num_batched_tokens if cfg.policy in ("chunked", "pd") else -1
    args = [f"--chunked-prefill-size {budget}",
            f"--max-prefill-tokens {cfg.max_num_batched_tokens}",
            f"--max-running-requests {cfg.max_num_seqs}", f"--page-size {cfg.page_size}"]
    if cfg.policy == "pd":
        args += ["--enable-mixed-chunk"]
    if not cfg.enable_prefix_caching:
        args += ["--disable-radix-cache"]
    return args


mine = EngineConfig(policy="pd", max_num_seqs=64, max_num_batched_tokens=2048, chunk_size=512)
print("minicb:", {k: getattr(mine, k) for k in ("policy", "max_num_seqs",
                                                 "max_num_batched_tokens", "chunk_size")})
print("vllm serve MODEL", " ".join(as_vllm(mine)))
print("python -m sglang.launch_server --model-path MODEL", " ".join(as_sglang(mine)))

# %% [markdown]
# Check the flags against the version you run (`vllm serve --help`, `python -m
# sglang.launch_server --help`): both projects rename and add options between releases.
#
# ## 2. Serving minicb over the OpenAI API
#
# An engine is used through a server, and a benchmark should be measured where the user sits: at
# the client. `python -m minicb serve --model smollm2-135m --policy pd --port 8000` starts an
# OpenAI-compatible server (`/v1/completions`, `/v1/chat/completions`, streamed or not,
# `/v1/models`, `/health`, `/metrics`). One engine thread owns the engine; every HTTP request
# from every client joins the same running batch, so continuous batching happens across clients.
#
# Here the same server runs inside the notebook, on a free local port:

# %%
# NBVAL_IGNORE_OUTPUT
import json

import httpx

from minicb import LLM
from minicb.serving.server import ServerThread, create_app

llm = LLM("smollm2-135m", policy="pd", max_num_seqs=8, max_num_batched_tokens=128)
server = ServerThread(create_app(llm, model_name="smollm2-135m"))
url = server.__enter__()  # `with ServerThread(...) as url:` in a script
print(url, httpx.get(url + "/v1/models").json())

# %% [markdown]
# A chat completion, exactly as an OpenAI client sends it (the `openai` Python package works
# too, with `base_url=url + "/v1"`):

# %%
# NBVAL_IGNORE_OUTPUT
reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={
    "model": "smollm2-135m", "max_tokens": 24, "temperature": 0,
    "messages": [{"role": "user", "content": "What is the capital of France?"}]}).json()
print(reply["choices"][0]["message"]["content"])
print(reply["usage"], reply["choices"][0]["finish_reason"])

# %% [markdown]
# Streamed, each step's new token arrives as one server-sent event:

# %%
# NBVAL_IGNORE_OUTPUT
with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
        "model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 8,
        "temperature": 0, "stream": True}) as stream:
    for line in stream.iter_lines():
        if line.startswith("data: {"):
            print(repr(json.loads(line[6:])["choices"][0]["text"]), end=" ")
        elif line:
            print("\n" + line)

# %% [markdown]
# ## 3. Benchmarking a server from the client
#
# `minicb.serving.client` sends a workload (the same arrival processes and length distributions as
# chapter 06) as streamed `/v1/completions` calls with token-id prompts, `ignore_eos` and a fixed
# `max_tokens`, so output lengths are exact on minicb, vLLM and SGLang alike. TTFT is timed when
# the first token's chunk arrives, ITL between chunks: what a user sees, network and server
# included. Six requests, Poisson at 3 requests/s (in a script, `bench_endpoint(url, workload)`
# does this and adds the declaration):

# %%
# NBVAL_IGNORE_OUTPUT
from minicb.benchmark import metrics
from minicb.serving.client import report, run_client
from minicb.benchmark.workload import make_workload

demo = make_workload(6, prompt_lengths="uniform:16:64", output_lengths="uniform:8:24",
                     arrival="poisson", rate=3, seed=0, name="client-demo")
records = await run_client(url, demo.requests)  # a notebook already runs an event loop
summary = metrics.summarize([], records, slo={"ttft": 1.0})
print(report({"minicb pd (client side)": summary}))  # the table, then p50/p95/p99

# %% [markdown]
# From the shell, against any OpenAI-compatible server:
#
# ```bash
# python -m minicb serve --model smollm2-135m --policy pd --port 8000 &
# python -m minicb.serving.client --endpoint http://127.0.0.1:8000 --workload mixed-chat --rate 2 --out minicb.json
# vllm serve MODEL --port 8001 ... &
# python -m minicb.serving.client --endpoint http://127.0.0.1:8001 --workload mixed-chat --rate 2 --out vllm.json
# ```
#
# Same workload, same client, same metrics: the comparison the benchmark contract asks for.
# (These send in an open loop, each request at its arrival time; `--max-concurrency N` makes N
# users who each wait for their answer, as vLLM's `bench serve --max-concurrency` does. Give
# both servers the same one, and declare it: chapter 06 shows a closed loop hiding an overload.)
# The server also exports Prometheus metrics at `/metrics` (its latency histograms use vLLM's
# bucket edges), among them what the contract asks to watch when the KV cache runs full:
# preemptions, the work they lost and how much was computed again, evicted prefix pages, pages
# swapped to host memory and back (`--preemption-mode swap`), requests rejected with a 503
# (`--reject-when-full`), and the queue age:

# %%
# NBVAL_IGNORE_OUTPUT
text = httpx.get(url + "/metrics").text
print("\n".join(line for line in text.splitlines()
                if line.startswith("minicb_") and "bucket" not in line)[:1500])
server.__exit__(None, None, None)

# %% [markdown]
# ## 4. A next step, built: attention that reads the pages where they lie
#
# Here is one next step, done, so you can see the shape of the work: profile, find the waste,
# write the kernel, test it against the reference, measure.
#
# **Profile.** After the CPU changes of this course (prepacked projections, chapter 01; decode
# rows in sorted groups), a decode step with the torch reference spends only about half its time
# in matrix products. Profile five decode steps of 16 requests, once with the torch reference
# and once with the `cpu` backend this section is about:

# %%
# NBVAL_IGNORE_OUTPUT
import os
import tempfile
from collections import Counter
from contextlib import contextmanager

import numpy as np
from torch.profiler import ProfilerActivity, profile

from minicb import LLM, SamplingParams
from minicb.attention import cpu_kernel
from minicb.benchmark.workload import random_prompt


@contextmanager
def quiet_stderr():
    """The profiler's C++ side writes a start and a stop line straight to file descriptor 2."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


PARTS = {"mkldnn::_linear_pointwise": "matrix products (prepacked)",
         "aten::mm": "matrix products (F.linear)", "aten::addmm": "matrix products (F.linear)",
         "aten::index_select": "copying K/V rows out of their pages",
         "aten::_scaled_dot_product_flash_attention_for_cpu": "attention (on the copy)",
         cpu_kernel.PROFILE_NAME: "attention (C kernel, pages in place)"}


def profile_decode_steps(backend: str) -> tuple[Counter, float]:
    """Share of CPU time per part over five decode steps of 16 requests, and ms per step."""
    llm = LLM("smollm2-135m", policy="continuous", max_num_seqs=16, enable_prefix_caching=False,
              attention_backend=KERNEL if backend == "cpu" else backend, device="cpu")
    rng = np.random.default_rng(0)
    for n in rng.integers(16, 512, size=16):
        llm.engine.add_request(random_prompt(int(n), rng),
                               SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    llm.engine.step()
    while llm.engine.trace[-1].num_prefill_tokens:  # 16 slots: every prompt is in once a
        llm.engine.step()                           # step carries no prefill tokens
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            llm.engine.step()
    spent = Counter()
    for event in prof.key_averages():
        spent[PARTS.get(event.key, "everything else")] += event.self_cpu_time_total
    return spent, sum(spent.values()) / 5 / 1000


# a machine without a C compiler cannot build the kernel: there every 'cpu' below is the reference
KERNEL = "cpu" if cpu_kernel.unavailable_reason() is None else "torch"
if KERNEL == "torch":
    print("no kernel here:", cpu_kernel.unavailable_reason(), "\n(the cells below compare the "
          "torch reference with itself)")
profiles = {backend: profile_decode_steps(backend) for backend in ("torch", "cpu")}
print(f"{'':<40}{'torch':>8}{'cpu':>8}")
for part in dict.fromkeys([*PARTS.values(), "everything else"]):
    shares = [spent[part] / sum(spent.values()) for spent, _ in profiles.values()]
    if any(shares):
        print(f"{part:<40}" + "".join(f"{share:8.0%}" for share in shares))
print(f"{'CPU ms per decode step':<40}" + "".join(f"{ms:8.0f}" for _, ms in profiles.values()))
ATTENTION = ("copying K/V rows out of their pages", "attention (on the copy)",
             "attention (C kernel, pages in place)")
print(f"{'of which attention, ms':<40}" + "".join(
    f"{ms * sum(spent[p] for p in ATTENTION) / sum(spent.values()):8.0f}"
    for spent, ms in profiles.values()))

# %% [markdown]
# **The waste.** With the reference, about a fifth of the step copies each request's K/V rows
# out of their pages into a padded tensor (`index_select`), because
# `scaled_dot_product_attention` wants contiguous keys; attention then reads the copy again. A
# kernel that reads the keys where they lie, page by page, is what chapter 07's Triton kernel
# does on a GPU. On the CPU, minicb's `cpu` backend does it in under 200 lines of C,
# `minicb/attention/paged_decode.c`, compiled once with the system compiler on first use and
# cached (`minicb/attention/cpu_kernel.py`). Its first pass, the scores:

# %%
# NBVAL_IGNORE_OUTPUT
source = cpu_kernel.SOURCE.read_text().splitlines()
start = next(i for i, line in enumerate(source) if "pass 1" in line)
print("\n".join(source[start:start + 20]))

# %% [markdown]
# Three choices made it fast, each measured on the course machine:
#
# - **One request per work item, all its heads together.** A page holds
#   `[page_size, kv_heads, head_dim]`: reading it front to back is one contiguous block the
#   hardware prefetcher streams. Split by kv head, each thread read a third of every page, and
#   attention in the engine was no faster than the reference's copy.
# - **Ask for the next page early** (`__builtin_prefetch`): pages lie anywhere in the pool, so the
#   prefetcher cannot guess where the next one is, but the page table knows. About 20% off.
# - **A vectorizable exponential.** The C library's `expf` is a call per score the compiler
#   cannot vectorize; a polynomial (Cody-Waite reduction, Cephes' coefficients, 2e-7 relative)
#   in a `#pragma omp simd` loop is. About 20% off too.
#
# Threads come from OpenMP, the same `libgomp` PyTorch already loaded, and the kernel asks for
# `torch.get_num_threads()` of them, so `torch.set_num_threads` governs both. Prefill chunks still take the reference's path: there
# the copy is a small part of a long attention.
#
# **Test it against the reference.** The same kind of check as chapter 07's: a random paged
# problem with pages in shuffled order, decode rows of ragged lengths, NaN in every slot no row
# owns (the kernel must never read one), and then the whole engine's greedy tokens.
# `tests/test_cpu_kernel.py` does this over 40 random steps (hypothesis) with group sizes 1 to
# 5 and page sizes 4 and 16, plus fixed cases with groups of 7 and pages of 32.

# %%
# NBVAL_CHECK_OUTPUT
import random

import torch

from minicb.attention import build_metadata, get_backend, torch_ref

rng, gen = random.Random(0), torch.Generator().manual_seed(0)
page_size, kv_heads, group, head_dim = 16, 3, 3, 64  # SmolLM2's attention shape
contexts = [rng.randrange(1, 300) for _ in range(12)]
needed = [-(-n // page_size) for n in contexts]
order = rng.sample(range(sum(needed) + 4), sum(needed) + 4)  # shuffled pages, some unowned
tables = [[order.pop() for _ in range(n)] for n in needed]
shape = (sum(needed) + 4, page_size, kv_heads, head_dim)
k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
for table, n in zip(tables, contexts):
    for pos in range(n):
        k_cache[table[pos // page_size], pos % page_size] = torch.randn(kv_heads, head_dim,
                                                                        generator=gen)
        v_cache[table[pos // page_size], pos % page_size] = torch.randn(kv_heads, head_dim,
                                                                        generator=gen)
meta = build_metadata(tables, [n - 1 for n in contexts], [1] * len(contexts), page_size)
q = torch.randn(len(contexts), kv_heads * group, head_dim, generator=gen)
# both get the poisoned caches: neither may read a slot its rows do not own
kernel_out = get_backend(KERNEL).attend(q, k_cache, v_cache, meta, head_dim ** -0.5)
reference = torch_ref.attend(q, k_cache, v_cache, meta, head_dim ** -0.5)
print("kernel read no unowned slot (no NaN):", not kernel_out.isnan().any().item())
print("largest difference from the reference below 1e-5:",
      (kernel_out - reference).abs().max().item() < 1e-5)

# %%
# NBVAL_CHECK_OUTPUT
prompts = ["What is a KV cache?", "Name three colours.", "Write one sentence about the sea."]
greedy = SamplingParams(max_tokens=24, temperature=0.0)
tokens = {backend: [o.token_ids for o in LLM("smollm2-135m", attention_backend=backend,
                                             device="cpu")  # a CPU kernel, even beside a GPU
                    .generate(prompts, greedy, use_tqdm=False)] for backend in ("torch", KERNEL)}
print("same greedy tokens from both backends:", tokens["torch"] == tokens[KERNEL])

# %% [markdown]
# **Measure.** On an Intel Xeon with AMX, the course's build machine on 2026-12-01 (2 cores, both
# threads; on other days it was an AMD EPYC, as for one of chapter 07's bf16 figures, measured
# 2026-11-29), with 32 requests decoding over contexts of 16–600 tokens, attention took 60–125 ms
# of each decode step with the reference (copy plus attention; it swung with the machine's memory
# traffic across three runs) and
# 35–47 ms with the kernel. On the standard mixed-chat benchmark (32 requests arriving at once,
# prompts of 16–512 tokens, outputs of 8–256, greedy, `ignore_eos`), run with each backend in turn,
# `pd` made 104.8 and 113.2 output tokens/s with the reference and 127.1 and 132.7 with the kernel
# (1.17–1.21×), and its median time per output token fell from 0.15–0.17 to 0.13 s
# (`bench/README.md` has the commands and the files). In the profile above (16 requests, stored from `make test`'s one-thread run;
# one run, and these runs vary: compare the attention line, which the machine's load moves
# less than the totals) the copy and the attention on it give way to the kernel's smaller
# share, and the products are now most of the step.
#
# `attention_backend="auto"` now picks this kernel on the CPU wherever a C compiler builds it
# (and warns, then keeps the reference, where none does); `"torch"` or `MINICB_ATTENTION=torch`
# gives the reference back. It reads bfloat16 caches too (`dtype="bfloat16"`, widened to float32
# row by row). What would take it further: the same kernel for prefill chunks (a tiled, causal
# version, the CPU twin of chapter 07's); bfloat16 keys and values under float32 weights (a
# `kv_cache_dtype` knob, as vLLM has: half the bytes to read). bfloat16 weights are already
# prepacked for AMX, the matrix units of recent Xeons, where oneDNN runs bfloat16 products
# (`dtype="bfloat16"`: 1.3–1.5× float32 on the whole benchmark on such a machine,
# `bench/README.md`).
#
# ## 5. A second step, built: steps that yield several tokens
#
# The benchmark contract's FAQ asks: "每个请求在一次迭代中都只推进一个 Token 吗？不一定。标准
# Decode 常让每个活跃序列推进一个 Token，但 Speculative Decoding 可以接受多个 Token，Chunked
# Prefill 也会处理多个输入位置。Iteration 是调度器的执行边界，实际处理的 Token 类型和数量必须测量。"
# (Does every request advance one token per iteration? Not necessarily: a standard decode
# advances each active sequence by one token, but speculative decoding can accept several, and
# chunked prefill processes many input positions. The iteration is the scheduler's boundary;
# what kinds of tokens it processes, and how many, must be measured.)
#
# A decode step reads every weight of the model to produce one token per request. Where that
# read dominates the step (a GPU at small batches; this CPU at batch 1), a few more query rows
# cost little. So **guess** the next `k` tokens cheaply, run the request's last token and the
# guesses as one causal chunk, and keep the guesses the model agrees with, plus the token the
# model itself predicts after the last kept one. Every step still yields at least one token; a
# good guess yields up to `k + 1`.
#
# The cheapest guesser needs no second model. **Prompt lookup** (the idea behind vLLM's `ngram`
# method) finds an earlier place where the request's last few tokens occurred, in its prompt or
# its own output, and proposes what followed them there. Which place is a choice: minicb takes
# the latest if `k` tokens follow it (in a run like `a a a a` the latest overlaps the end and
# has too few after it, so minicb falls back to the earliest; the by-hand version below keeps
# only the first rule); vLLM's proposer takes the earliest occurrence of its longest match.
# Nothing here measures which guesses better. Text that repeats its input (copying,
# extraction, code edits, quoting) gets long runs of right guesses; free text gets few.
#
# By hand first, on a sentence that asks for a list it contains:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.model.loader import load_model
from minicb.speculative import propose_ngram, verify

smollm2 = load_model("smollm2-135m")  # (model, info): the engines below share its weights
tokenizer = smollm2[1].tokenizer
text = ("Copy this list: apples, pears, plums, cherries, grapes, lemons.\n"
        "List: apples, pears,")
ids = tokenizer.encode(text, add_special_tokens=False)


def lookup_by_hand(ids: list[int], k: int, n: int) -> list[int]:
    """What followed the latest earlier occurrence of the last n tokens (k tokens at most)."""
    suffix = ids[-n:]
    for start in range(len(ids) - n - 1, -1, -1):  # latest first, never the suffix itself
        if ids[start:start + n] == suffix:
            return ids[start + n:start + n + k]
    return []


print("last 2 tokens:", [tokenizer.decode([t]) for t in ids[-2:]])
guess = lookup_by_hand(ids, k=4, n=2)
print("by hand:      ", repr(tokenizer.decode(guess)))
print("minicb:       ", repr(tokenizer.decode(propose_ngram(ids, k=4, n_max=2, n_min=2))))

# %% [markdown]
# Checking the guesses takes no new kernel. The request's last token and its `k` guesses are
# `k + 1` query rows over its cached context: to the attention backends, a small prefill chunk,
# exactly what chapter 05's mixed batch already carries next to one-row decodes:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.attention import build_metadata

# one plain decode, then two decodes checking 3 guesses each (4 query rows: the last token and
# 3 guesses)
meta = build_metadata([[4], [0, 1], [2, 3]], [9, 20, 17], [1, 4, 4], page_size=16)
print("query lengths", meta.query_lens, "| contexts", meta.context_lens_list,
      "| query_start_loc", meta.query_start_loc.tolist())
print("one-row members:", meta.num_decodes, "| the checking members are attended like "
      "prefill chunks: causally over their own pages")

# %% [markdown]
# The model returns logits at every one of those rows: row `i` is its prediction after the last
# token and the first `i` guesses. `verify` keeps guesses while they equal the model's greedy
# choice, then adds the model's own token. (A sampled request draws its token at each row from
# the model's distribution with its own random generator, one number per token as without
# guesses, and goes on while the draw equals the guess: its tokens are exactly what they would
# be without guesses, seed for seed, whatever shares its batch, and guess `d` is kept with
# probability p(d), which `tests/test_speculative.py` checks over 20,000 draws. Exactly so in
# float32: in bfloat16 or int8, a row computed in a chunk of guesses rounds differently from
# the same row alone, so where two tokens nearly tie the pick can differ.)

# %%
# NBVAL_CHECK_OUTPUT
import torch

from minicb import SamplingParams

logits = torch.full((4, 10), -1.0)
for row, token in enumerate([3, 4, 7, 6]):  # the model's greedy choice after each row
    logits[row, token] = 1.0
greedy = SamplingParams(temperature=0.0)
for guesses in ([3, 4, 5], [3, 4, 7], [9, 4, 7]):
    print(f"guesses {guesses} -> kept {verify(logits, guesses, greedy)}")

# %% [markdown]
# In the engine, `num_speculative_tokens=k` turns it on (`prompt_lookup_max` and
# `prompt_lookup_min` bound the run of last tokens looked up, as in vLLM). After the policy has
# scheduled a step, `Engine._propose_drafts` gives each decode member up to `k` guesses, within
# the token budget the policy left and the free pages: the policy itself is unchanged, so `pd`
# still serves every decode first, and guesses are the first thing a busy step goes without.
# `_forward` asks for logits at each guessing member's rows, `_sample` calls `verify`, and the
# request's cache advances by what was kept; rejected guesses' K/V stay in the pages, past the
# request's length, and are overwritten by the next step. Each `StepRecord.speculated` says
# what was guessed and kept.
#
# Three chat requests on SmolLM2, one at a time, greedy, with and without 4 guesses a step: a
# list to copy, a record to rewrite as JSON, and a poem (free text):

# %%
# NBVAL_IGNORE_OUTPUT
import time

from minicb.benchmark import metrics

tasks = {
    "copy": "Copy this list exactly, one item per line: apples, pears, plums, cherries, grapes, "
            "lemons, limes, oranges, peaches, apricots, figs, dates.",
    "json": "Here is a record: name: Ada Lovelace; born: 10 December 1815; died: 27 November "
            "1852; known for: the first published algorithm. Rewrite it as JSON with the keys "
            "name, born, died and known_for.",
    "poem": "Write a short poem about the sea.",
}
params = SamplingParams(max_tokens=64, temperature=0.0)
alone = {k: LLM(smollm2, policy="pd", num_speculative_tokens=k) for k in (0, 4)}
spec_runs = {}
print(f"{'task':<6}{'k':>3}{'tokens':>7}{'steps':>6}{'guessed':>8}{'kept':>6}{'tok/step':>9}"
      f"{'seconds':>8}")
for name, task in tasks.items():
    for k, spec_llm in alone.items():
        engine = spec_llm.engine
        start_step = len(engine.trace)
        t0 = time.perf_counter()
        out = spec_llm.chat([{"role": "user", "content": task}], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        steps = engine.trace[start_step:]
        s = metrics.speculation(steps)
        spec_runs[name, k] = (out.token_ids, len(steps), seconds)
        print(f"{name:<6}{k:>3}{len(out.token_ids):>7}{len(steps):>6}{s['draft_tokens']:>8}"
              f"{s['accepted_draft_tokens']:>6}{len(out.token_ids) / len(steps):>9.2f}"
              f"{seconds:>8.2f}")
for name in tasks:
    print(f"{name}: {spec_runs[name, 0][2] / spec_runs[name, 4][2]:.2f}x faster with guesses")

# %%
# NBVAL_CHECK_OUTPUT
for name in tasks:
    same = spec_runs[name, 0][0] == spec_runs[name, 4][0]
    fewer = spec_runs[name, 4][1] < spec_runs[name, 0][1]
    print(f"{name}: same tokens with and without guesses: {same}; fewer steps: {fewer}")

# %% [markdown]
# Now the same three tasks and five more (code to rename, days of the week, a story, a quote to
# repeat, facts about the Moon) in one batch of 8 under `pd`, each with and without guesses:

# %%
# NBVAL_IGNORE_OUTPUT
tasks.update({
    "code": "Rename the variable x to total in this Python code:\nx = 0\nfor price in "
            "prices:\n    x = x + price\nprint(x)",
    "days": "List the days of the week, one per line.",
    "story": "Tell me a story about a cat who learns to fly.",
    "quote": "Repeat after me: The quick brown fox jumps over the lazy dog. The quick brown fox "
             "jumps over the lazy dog.",
    "facts": "Give three facts about the Moon.",
})
conversations = [[{"role": "user", "content": t}] for t in tasks.values()]
batch_runs, batch_speed = {}, {}
for k in (0, 4):
    batch_llm = LLM(smollm2, policy="pd", max_num_seqs=8, num_speculative_tokens=k)
    t0 = time.perf_counter()
    outs = batch_llm.chat(conversations, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    engine = batch_llm.engine
    s = metrics.summarize(engine.trace, engine.request_records())
    batch_runs[k] = [o.token_ids for o in outs]
    tokens = sum(len(o.token_ids) for o in outs)
    batch_speed[k] = (tokens / seconds, s["e2e_s"]["p50"], s["tpot_s"]["p50"])
    print(f"k={k}: {tokens} tokens in {len(engine.trace)} steps, {seconds:.1f} s, "
          f"{tokens / seconds:.1f} tok/s, E2E p50 {s['e2e_s']['p50']:.2f} s "
          f"({s['e2e_steps']['p50']:.1f} steps), TPOT p50 {s['tpot_s']['p50'] * 1000:.0f} ms, "
          f"kept {s['accepted_draft_tokens']} of {s['draft_tokens']} guesses")
print("with guesses / without: " + ", ".join(
    f"{name} {batch_speed[4][i] / batch_speed[0][i]:.2f}x"
    for i, name in enumerate(("tok/s", "E2E p50", "TPOT p50"))))
print("same tokens:", batch_runs[0] == batch_runs[4])

# %% [markdown]
# One request at a time (one run each; the seconds move with the machine's load, the steps do
# not): copying the list, every guess was kept (20 of 20), 32 tokens in 12 steps instead of 32,
# and it gained by far the most in seconds (the `copy` ratio printed above): at batch 1 on this
# CPU a step of 5 query rows costs little more than a step of 1, since the weights are read once
# either way. The JSON rewrite kept 14 guesses of 52 and the poem 16 of 50, about a quarter to a
# third,
# 1.33–1.34 tokens a step, so they need about a quarter fewer steps; in seconds free text gains
# much less than copying, and how much varies from run to run (the `json` and `poem` ratios above
# have ranged from barely faster to about a third faster across builds of this notebook): the
# little more each step costs, and the machine's load, can eat much of a saving that small. The
# greedy text is the same, token for token, in every case.
#
# In the batch of 8 the picture changes. The steps are the longest request's (65 either way: a
# free-text reply gets few guesses), and a step carrying 8 requests' guesses is no longer
# nearly free: throughput does not improve (the tok/s ratio printed above has come out on both
# sides of 1x across builds, within the noise). What the guesses buy is latency for the requests
# they fit: the median request finishes in about a quarter fewer steps (E2E p50 in steps, in
# brackets above), and E2E p50 and TPOT p50 in seconds come out lower too, by an amount that
# moves with the machine's load (their ratios printed above). That is the trade vLLM's
# documentation states: speculation pays most at low load, where the
# hardware waits on memory, and least in a full batch. Tokens kept in one step reach the user
# together: ITL counts one gap per delivery, as a client timing its stream does, and TPOT
# averages over every token. What the contract asks ("实际处理的 Token 类型和数量必须测量": measure how
# many tokens of which kind each iteration processed) is in `StepRecord.speculated`, and
# `summarize` reports `draft_tokens`, `accepted_draft_tokens` and `draft_acceptance_rate`, as
# does `python -m minicb bench --num-speculative-tokens 4`.
#
# ## 6. What to build next
#
# Each idea below names the part of minicb it changes. They are ordered roughly by size.
#
# **CUDA graphs for mixed steps** (`cuda_graphs.py`, `engine.py`). minicb replays decode-only
# steps from CUDA graphs (chapter 07); any step with a prefill chunk runs eagerly, so under `pd`
# every step that admits work pays the eager cost. vLLM captures "piecewise" graphs: the
# parts of the forward whose shapes depend only on the token count (projections, MLP, norms)
# are captured for padded token counts, and attention, whose shape depends on the members, runs
# eagerly between them. On an H200 (chapter 07) the decode graphs already made pd's mixed-chat
# run 4.6× faster (2,210 against 479 output tok/s without them), yet its 363 steps still
# averaged 4.6 ms against 2.1 ms for static's, nearly all replayed decode graphs: the eager
# steps with prefill chunks are what is left. Measure ITL before and after with
# `bench --no-cuda-graphs` and `bench/gpu_check.sh`.
#
# **Prefix-aware scheduling** (`scheduler.py`). SGLang's `lpm` orders the waiting queue by the
# longest cached prefix, so requests that share a system prompt run while its pages are still
# cached. minicb's `PagePool.match_prefix` already answers "how many tokens are cached"; a
# scheduler that sorts by it is a few lines. Watch fairness: chapter 06's `max_queue_age`.
#
# **Admission by deadline** (`scheduler.py`, `sim.py`). minicb's requests may carry deadlines,
# and `preemption="deadline"` serves the earliest first (chapter 06), but a request that can no
# longer make it still runs until its deadline passes, and that work is wasted. A scheduler that
# estimates each request's finish (its remaining tokens times the step cost, from a cost model:
# `python -m minicb profile` fits one on this machine; chapter 06's simulations use the
# `h100-like` preset) can refuse or defer it at admission instead. Compare with chapter 06's
# table: completions, wasted tokens, worst E2E.
#
# **Better guesses** (`speculative.py`, `engine.py`). Section 5's prompt lookup guesses only
# text that repeats. A small draft model of the same tokenizer (SmolLM2-135M drafting for a
# 1.7B model), EAGLE-style heads on the big model's hidden states, or suffix trees over past
# responses guess free text too; `verify` stays as it is. A scheduler that budgets guesses per
# request, as vLLM's does, instead of giving them what the policy left, is the other half.

# %% [markdown]
# **Disaggregated prefill and decode** (a new process boundary around `engine.py`, and a KV
# transfer in `kv_cache.py`). PD interleaving shares one GPU between the two phases and trades
# one against the other through the budget. Disaggregation (DistServe, Splitwise, Mooncake) runs
# prefill on one set of GPUs and decode on another, and ships each request's KV pages from the
# first to the second. Prefill never stalls a decode again, and each pool can be sized and
# parallelised for its own phase; the price is moving the KV cache over the network and a second
# scheduler. In vLLM this is the `kv_transfer_config` of its disaggregated prefill; in SGLang,
# `--disaggregation-mode prefill` / `decode`. A first minicb version: two engines in one process,
# one `policy="chunked"` that stops each request after its first token, one `policy="pd"` that
# admits requests with their pages copied in.
#
# **Tensor parallelism** (`model/llama.py`). A model too big for one GPU is split across several:
# each GPU holds a slice of every weight matrix (query/key/value heads and MLP columns), computes
# its share, and the partial results are summed with an all-reduce after the attention output
# and MLP down projections (Megatron-LM's layout). The KV cache splits by kv head, so each GPU's
# page pool holds its heads only; page tables, the scheduler and the trace do not change at all.
# vLLM: `tensor_parallel_size`; SGLang: `--tp`. With `torch.distributed` on one machine with two
# GPUs, or two CPU processes with the gloo backend, this is a weekend project.
#
# **Data parallelism and routing.** Several independent engines behind a router. The router's
# policy (round robin, least loaded, or prefix-aware so that shared prompts land where their
# pages are cached) is chapter 06's benchmark problem again, one level up.
#
# **Memory**: KV cache quantisation (fp8 pages: twice the requests per GPU), a host-memory
# tier for cached prefix pages (evicted pages copied out, as chapter 06's swap copies a
# victim's, and reused from there instead of recomputed), sliding-window attention (pages
# that fall out of the window go back to the pool).
#
# For each: write down what you expect to improve (which percentile of which metric, at which
# load), measure it with chapter 06's contract, and compare against the version without it.
#
# ## Recap
#
# - minicb's knobs map onto vLLM's and SGLang's nearly one for one: the token budget, the running
#   batch limit, the chunk size, prefix caching, the page size, the memory fraction, preemption
#   and priority. The behaviour behind them differs in details; check the version you run.
# - `python -m minicb serve` puts the engine behind the OpenAI API; `python -m minicb.serving.client`
#   measures any such server from the user's side with the benchmark contract's metrics.
# - A next step is a loop: profile, find the waste (here a copy of every context per layer),
#   build the fix (a C kernel over the pages), test it against the reference, measure.
# - A step can yield several tokens per request: speculative decoding by prompt lookup checks
#   guessed tokens as a small causal chunk, keeps what the model agrees with (the same tokens
#   as without guesses, greedy or seeded), and pays most at batch 1 (here copying a list gained
#   most; free text gained much less, by an amount that varies from run to run; in a batch of 8,
#   lower latency, no more tokens/s).
# - Next steps grow the same engine: CUDA graphs for mixed steps, prefix-aware scheduling and
#   better guessers on one GPU; disaggregated prefill/decode, tensor and data parallelism
#   beyond one GPU.
#
# ## Further reading
#
# The sources the course follows cite these; each is worth reading next to the chapter named.
#
# - Yu et al., **Orca: A Distributed Serving System for Transformer-Based Generative Models**,
#   OSDI 2022 ([paper](https://www.usenix.org/conference/osdi22/presentation/yu)):
#   iteration-level scheduling and selective batching (chapter 03).
# - Kwon et al., **Efficient Memory Management for Large Language Model Serving with
#   PagedAttention**, SOSP 2023 (the vLLM paper): pages, page tables and continuous batching
#   over them (chapters 01 and 03).
# - Agrawal et al., **SARATHI: Efficient LLM Inference by Piggybacking Decodes with Chunked
#   Prefills**, 2023 ([arXiv:2308.16369](https://arxiv.org/abs/2308.16369)): decode-maximal
#   batches (chapters 04 and 05).
# - DigitalOcean, *Continuous Batching Mechanics*; 持续批处理：提升 GPU 利用率; 大白话解说
#   Continuous Batching (Tencent Cloud): the explainers the seed chapter text lists.
#
# That is the whole course: from one request at a time (chapter 01) to a scheduler that keeps
# every chat flowing while a long document is read in (chapter 05), measured the way production
# measures it (chapter 06). For this chapter, pick one of the projects above, and do
# [`exercises/08_speculative_decoding.ipynb`](../exercises/08_speculative_decoding.ipynb): write
# prompt lookup and greedy verification yourself (section 5), checked against minicb's.
