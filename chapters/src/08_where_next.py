# %% [markdown]
# # 08 · Where next: from minicb to vLLM, SGLang and beyond one machine
#
# minicb is small on purpose, but its knobs are the ones production engines expose, under nearly the same names.
# This chapter maps them, serves minicb over the OpenAI API, and makes a CPU step faster four ways.
# Then it builds speculative decoding by prompt lookup, and lists what to build next.
#
# **After this chapter you will be able to**
#
# - translate a minicb configuration into vLLM and SGLang settings, and say where the analogy stops;
# - start minicb's OpenAI-compatible server, call it, and benchmark it from the client;
# - say what int8 weights, prepacked weights, a C attention kernel and a one-row C layer do to a CPU decode step, and check each against the reference;
# - run steps that yield several tokens per request, check that greedy text does not change, and measure when guesses pay;
# - pick a next project and say which part of minicb it touches.

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
# And their counterparts (vLLM's engine arguments; SGLang's server arguments):
#
# | minicb | vLLM | SGLang | what it bounds |
# |---|---|---|---|
# | `max_num_batched_tokens` | `max_num_batched_tokens` | `chunked_prefill_size` (a step's prefill tokens) | tokens per step (ch. 04–05) |
# | `max_num_seqs` | `max_num_seqs` | `max_running_requests` | requests in the running batch (ch. 03) |
# | `chunk_size` | `long_prefill_token_threshold` | (none per request) | one request's chunk (ch. 04) |
# | `policy="chunked"` / `"pd"` | `enable_chunked_prefill` (V1 serves running requests first, close to `pd`) | `enable_mixed_chunk` mixes a chunk with decodes | whether prompts are cut and share steps with decodes (ch. 04–05) |
# | `min_chunk` | (none) | (none) | the smallest chunk worth running (ch. 05) |
# | `enable_prefix_caching` | `enable_prefix_caching` | radix cache | reuse of cached prompt pages (ch. 01) |
# | `page_size` | `block_size` | `page_size` | tokens per KV page (ch. 01) |
# | `num_pages` / `gpu_memory_utilization` | `gpu_memory_utilization` | `mem_fraction_static` | the KV pool's size (ch. 07) |
# | `preemption`, `max_preemptions`, `preemption_mode`, `reject_when_full` | recompute (V1); priority scheduling | retraction, recomputed later | what happens when pages run out (ch. 06) |
# | `num_speculative_tokens`, `prompt_lookup_max/min` | `speculative_config={"method": "ngram", ...}` | n-gram speculation | guessed tokens a step may check (section 5) |
# | `use_cuda_graphs` | on unless `enforce_eager` | on unless `disable_cuda_graph` | steps replayed as CUDA graphs (ch. 07) |
#
# Where the analogy stops:
#
# - vLLM's V1 scheduler has no separate prefill and decode phases. With one long prompt its step is minicb's `pd` step.
# - SGLang plans prefill and decode batches apart by default, close to `chunked`. Its `lpm` policy orders the queue by longest cached prefix.
# - Defaults differ a lot: on a GPU vLLM's budget is in the thousands. Sweep your own traffic (chapter 06).
#
# As code, a configuration written out as the nearest flags:

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
# Check the flags against the version you run: both projects rename options between releases.
#
# ## 2. Serving minicb over the OpenAI API
#
# `python -m minicb serve --model smollm2-135m --policy pd --port 8000` starts an OpenAI-compatible server.
# One engine thread owns the engine, and every HTTP request joins the same running batch.
# [docs/serving.md](../docs/serving.md) lists the endpoints. Here the server runs inside the notebook:

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
# A chat completion, as an OpenAI client sends it (the `openai` package works too, with `base_url=url + "/v1"`):

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
# `python -m minicb bench serve` takes the command line of vLLM's `vllm bench serve`.
# It sends streamed `/v1/completions` calls at their arrival times, each run to a fixed output length.
# It times TTFT and ITL where the user sits, network and server included.
# vLLM's random dataset, six prompts, Poisson at 3 requests/s; median, P95 and P99 as in chapter 06:

# %%
# NBVAL_IGNORE_OUTPUT
import subprocess
import sys

command = ["python", "-m", "minicb", "bench", "serve", "--base-url", url,
           "--num-prompts", "6", "--request-rate", "3", "--random-input-len", "32",
           "--random-output-len", "16", "--random-range-ratio", "0.5",
           "--metric-percentiles", "95,99", "--goodput", "ttft:1000", "--disable-tqdm"]
print(" ".join(command))
done = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True)
print(done.stdout + done.stderr)

# %% [markdown]
# From the shell, with a chapter-06 scenario instead of random prompts:
#
# ```bash
# python -m minicb serve --model smollm2-135m --policy pd --port 8000 &
# python -m minicb bench serve --base-url http://127.0.0.1:8000 --workload mixed-chat --request-rate 2 --save-result
# ```
#
# Point it at vLLM or SGLang: same workload, same metrics. `--save-result` writes vLLM's result keys.
# The server exports Prometheus metrics at `/metrics`: vLLM's, named `minicb:` where vLLM says `vllm:`, then minicb's own.
# Among them is what a full cache costs:

# %%
# NBVAL_IGNORE_OUTPUT
text = httpx.get(url + "/metrics").text
print("\n".join(line for line in text.splitlines()
                if line.startswith("minicb:") and "_bucket" not in line)[:1500])
server.__exit__(None, None, None)

# %% [markdown]
# ## 4. Faster CPU steps: fewer bytes, a better layout, pages read in place
#
# A decode step reads every weight for one token per request (chapter 01). Four things in minicb make that step cheaper on a CPU.
# [docs/benchmarks.md](../docs/benchmarks.md) points at the committed measurements; the cells below measure this machine.
#
# **Fewer bytes per weight.** `quantization="int8"` stores every projection as int8 with one scale per output row (`minicb/model/quant.py`).
# A step reads about a quarter of the bytes. The price is numbers: greedy decoding can take another branch at a near-tie.
# Same prompt, both ways:

# %%
# NBVAL_IGNORE_OUTPUT
import numpy as np

from minicb import LLM, SamplingParams
from minicb.benchmark.workload import random_prompt
from minicb.model.loader import load_model

model = load_model("smollm2-135m")  # float32; prepacked on an x86-64 CPU (below)

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
# The printed lines give this run's speeds and how many greedy tokens agreed.
# int8 reads fewer bytes, but a lone float32 request takes the one-row C path of part four, which int8 weights do not.
# That is why minicb stays float32 by default, where its tokens equal transformers' exactly.
#
# **The same bytes, a better layout.** `F.linear` lets PyTorch's matrix multiply re-read the weight in its own layout on every call.
# oneDNN can store a weight once in its blocked layout instead.
# minicb does this for float32 weights on an x86-64 CPU (`minicb/model/prepack.py`); `prepack=False` or `MINICB_PREPACK=0` keeps `F.linear`.
# Both ways, at 4 and 16 requests per decode step (one to three rows take the path of part four, below):

# %%
# NBVAL_IGNORE_OUTPUT
model_plain = load_model("smollm2-135m", prepack=False)
print("prepacked:", model[0].prepacked, "| plain:", model_plain[0].prepacked)
print(model[0].layers[0].mlp.down_proj, "vs", model_plain[0].layers[0].mlp.down_proj)


def decode_ms(pair, rows: int, backend: str = "auto") -> float:
    """Median forward time of the decode steps that ran `rows` requests together."""
    batch_llm = LLM(pair, policy="continuous", max_num_seqs=rows, enable_prefix_caching=False,
                    attention_backend=backend)
    prompts = [random_prompt(32, np.random.default_rng(i)) for i in range(rows)]
    batch_llm.generate(prompts, SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    steps = [r.t_forward for r in batch_llm.engine.trace
             if len(r.members) == rows and all(m.kind == "decode" for m in r.members)]
    return float(np.median(steps)) * 1e3


print(f"\n{'rows':>5}{'F.linear ms':>13}{'prepacked ms':>14}{'speed-up':>10}")
for rows in (4, 16):
    plain_ms, packed_ms = decode_ms(model_plain, rows), decode_ms(model, rows)
    print(f"{rows:>5}{plain_ms:>13.1f}{packed_ms:>14.1f}{plain_ms / packed_ms:>9.1f}x")

# %% [markdown]
# How much the layout gains depends on the CPU's own default path; the table above is this machine's.
# The products are the same sums in another order, so the numbers differ only in the last bits. The greedy tokens agree:

# %%
# NBVAL_CHECK_OUTPUT
answers_plain = LLM(model_plain, policy="single").chat(question, greedy, use_tqdm=False)[0]
print("same 24 greedy tokens, F.linear and prepacked:",
      answers_plain.token_ids == answers["float32"].token_ids)

# %% [markdown]
# **Pages read in place.** With the torch reference, attention first copies each request's K/V out of its pages (`index_select`), then reads the copy.
# Profile five decode steps of 16 requests with the reference and with the `cpu` backend:

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
# The waste is in the copy. The `cpu` backend reads the keys where they lie, page by page: `minicb/attention/paged_decode.c`, compiled on first use.
# Its first pass, the scores:

# %%
# NBVAL_IGNORE_OUTPUT
source = cpu_kernel.SOURCE.read_text().splitlines()
start = next(i for i, line in enumerate(source) if "pass 1" in line)
print("\n".join(source[start:start + 20]))

# %% [markdown]
# It works one request at a time with all its heads, so each page is read front to back.
# It prefetches the next page from the page table, and uses a vectorizable exponential.
# Threads come from OpenMP, governed by `torch.set_num_threads`. Prefill chunks still take the reference's path.
#
# Test it like chapter 07's kernels: shuffled pages, ragged rows, NaN in every slot no row owns, then the whole engine's greedy tokens:

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
# `attention_backend="auto"` picks this kernel on the CPU wherever a C compiler builds it; `"torch"` or `MINICB_ATTENTION=torch` gives the reference back.
#
# **One row at the memory's speed.** One request alone is the demo's case, and a chat's.
# Its decode step multiplies one row by every weight: 135 M float32 numbers, about 540 MB read for one token.
# The arithmetic is tiny, so the step lasts as long as the memory takes to deliver those bytes: the yardstick is GB/s.
# Per operation, PyTorch loses that race twice. oneDNN's product is built for many rows and streams one row's weights slowly, and a layer's thirty small operations each pay Python and dispatch.
# minicb changes three things, all behind `PackedLinear` and the `cpu` backend, none in the engine:
#
# - up to three rows, a C product (`gemv` in `minicb/attention/cpu_ops.c`) reads each weight row once while every input row dots it;
# - a lone decoded row runs each layer as one C call (`decode_layer`: norms, projections, RoPE, paged attention, MLP);
# - the plain weights live on 2 MB pages (`MADV_HUGEPAGE`), so the CPU's prefetchers do not stop at every 4 KB page edge.
#
# The sums are the reference's, to float32 rounding. Three ways, one request, on this machine:

# %%
# NBVAL_IGNORE_OUTPUT
weight_bytes = sum(p.numel() * p.element_size() for p in model[0].parameters())
print(f"weights read per token: {weight_bytes / 1e6:.0f} MB")
for label, pair, backend in (("F.linear, attention per operation", model_plain, "torch"),
                             ("prepacked: C product per operation", model, "torch"),
                             (f"prepacked, {KERNEL} backend: C layer", model, KERNEL)):
    ms = decode_ms(pair, 1, backend)  # the layout table's timer, at one request
    print(f"{label:<38}{ms:6.1f} ms/token {1e3 / ms:6.1f} tokens/s"
          f" {weight_bytes / ms / 1e6:5.1f} GB/s")

# %% [markdown]
# Read the GB/s against what this machine's memory gives one or two cores: a few tens of GB/s on a current server, less on a busy one.
# That bandwidth, not arithmetic, bounds every engine's single stream; llama.cpp, the engine most people run on a CPU, meets the same limit.
# `bench/llama_cpp.py` runs it beside `minicb serve` on the same requests: in `bench/results/llama-cpp-2026-12-07.json`, one request ran at 0.94–0.99× llama.cpp's speed with two threads, and 16 or 32 at once at 1.33–1.70× ([docs/benchmarks.md](../docs/benchmarks.md)).
#
# ## 5. A second step, built: steps that yield several tokens
#
# The contract's FAQ: "每个请求在一次迭代中都只推进一个 Token 吗？不一定…Speculative Decoding 可以接受多个 Token" (does every request advance one token per iteration? Not necessarily: speculative decoding can accept several).
#
# Where reading the weights dominates a step, a few more query rows cost little.
# So **guess** the next `k` tokens cheaply, run the last token and the guesses as one causal chunk, and keep the guesses the model agrees with.
# Every step still yields at least one token; a good guess yields up to `k + 1`.
#
# **Prompt lookup** (vLLM's `ngram` method) needs no second model. It finds an earlier place where the last few tokens occurred and proposes what followed.
# Text that repeats its input (copying, extraction, code edits) gets long runs of right guesses; free text gets few. By hand first:

# %%
# NBVAL_CHECK_OUTPUT
from minicb.model.loader import load_model
from minicb.speculative import NgramIndex, verify

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
print("minicb:       ", repr(tokenizer.decode(NgramIndex(n_max=2, n_min=2).propose(ids, k=4))))

# %% [markdown]
# Checking the guesses takes no new kernel. The last token and `k` guesses are `k + 1` query rows over the request's context: a small prefill chunk, as in chapter 05's mixed batch.

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
# Row `i` of the logits is the model's prediction after the last token and the first `i` guesses.
# `verify` keeps guesses while they equal the model's greedy choice, then adds the model's own token.
# A sampled request draws each row's token with its own generator, so its tokens are exactly what they would be without guesses (`tests/test_speculative.py`).

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
# In the engine, `num_speculative_tokens=k` turns it on.
# After the policy schedules a step, `Speculator.propose` (`minicb/speculative.py`) gives each decode member up to `k` guesses within the budget and pages left.
# The policy is unchanged, so `pd` still serves every decode first. `StepRecord.speculated` records what was guessed and kept.
#
# Three chat requests, one at a time, with and without 4 guesses a step:

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
# Now eight tasks in one batch under `pd`, with and without guesses:

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
    s = metrics.summarize(engine.trace, metrics.request_records(engine))
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
# One request at a time, copying the list keeps nearly every guess and needs far fewer steps; free text keeps a quarter to a third.
# The seconds follow the steps only partly: each step of guesses costs a little more, and this machine's load moves single runs.
# The greedy text is the same, token for token.
#
# In a batch of 8 a step carrying 8 requests' guesses is no longer nearly free, so throughput does not improve.
# What the guesses buy is latency for the requests they fit. Speculation pays most at low load and least in a full batch.
#
# ## 6. What to build next
#
# Each idea names the part of minicb it changes.
#
# **CUDA graphs for mixed steps** (`cuda_graphs.py`, `engine.py`). Steps with a prefill chunk run eagerly today.
# vLLM captures "piecewise" graphs: the token-count-shaped parts captured, attention eager between them.
#
# **Prefix-aware scheduling** (`scheduler.py`). Order the queue by longest cached prefix, as SGLang's `lpm` does; watch `max_queue_age`.
#
# **Admission by deadline** (`scheduler.py`, `benchmark/sim.py`). Refuse at admission a request whose estimated finish misses its deadline.
#
# **Better guesses** (`speculative.py`). A small draft model or EAGLE-style heads guess free text too; `verify` stays as it is.

# %% [markdown]
# **Disaggregated prefill and decode** (around `engine.py`, and a KV transfer in `kv_cache.py`).
# Prefill runs on one set of GPUs and decode on another, and each request's KV pages move between them (DistServe, Splitwise, Mooncake).
#
# **Tensor parallelism** (`model/llama.py`). Split every weight matrix across GPUs and sum partial results with an all-reduce (Megatron-LM's layout).
# The KV cache splits by kv head; page tables, the scheduler and the trace do not change.
#
# **Data parallelism and routing.** Several engines behind a router: chapter 06's benchmark problem one level up.
#
# **Memory**: fp8 KV pages, a host-memory tier for cached prefix pages, sliding-window attention.
#
# For each: write down which percentile of which metric should improve at which load, and measure it with chapter 06's contract.
#
# ## Recap
#
# - minicb's knobs map onto vLLM's and SGLang's nearly one for one; the behaviour behind them differs in details.
# - `python -m minicb serve` puts the engine behind the OpenAI API; `python -m minicb bench serve`, with vLLM's flags, measures any such server from the user's side.
# - A CPU decode step gets cheaper with fewer bytes (int8), a better layout (prepacked weights) and attention over the pages in place (a C kernel), each checked against the reference.
# - Speculative decoding by prompt lookup checks guesses as a small causal chunk and keeps the same tokens; it pays most at batch 1.
#
# ## Further reading
#
# - Yu et al., **Orca**, OSDI 2022 ([paper](https://www.usenix.org/conference/osdi22/presentation/yu)): iteration-level scheduling (chapter 03).
# - Kwon et al., **PagedAttention**, SOSP 2023 (the vLLM paper): pages and page tables (chapters 01, 03).
# - Agrawal et al., **SARATHI**, 2023 ([arXiv:2308.16369](https://arxiv.org/abs/2308.16369)): decode-maximal batches (chapters 04, 05).
# - DigitalOcean, *Continuous Batching Mechanics*; 持续批处理：提升 GPU 利用率; 大白话解说 Continuous Batching: the explainers the seed lists.
#
# For this chapter, pick a project above and do [`exercises/08_speculative_decoding.ipynb`](../exercises/08_speculative_decoding.ipynb): prompt lookup and greedy verification (section 5).
