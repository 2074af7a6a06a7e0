# %% [markdown]
# # 00 · Setup and a tour of minicb
#
# This course grows **minicb**, a small but real LLM inference engine: it loads a real checkpoint,
# keeps the KV cache in fixed-size pages, and schedules many requests at once. The chapters follow
# one text, the chapter *Continuous Batching 与 Chunked Prefill*, from a single request at a time
# (v1) to 连续批处理 continuous batching, Chunked Prefill and PD 交错 prefill/decode
# interleaving (v2).
#
# Two words the chapters use for their sources. **The seed** is that chapter text (written in
# Chinese): "seed §2.3" means its section 2.3, and a passage the course relies on is quoted in the
# chapter with a translation, so you never need the text itself. It has nothing to do with the
# `seed=` of a random workload. **The benchmark contract** is a second text, the rules for
# measuring a serving engine the way production traffic would: arrival processes, percentiles,
# goodput at an SLO, preemption and cancellation. Chapter 06 follows it.
#
# Chinese words in the course are the sources' own: a term is given in Chinese where the sources
# use Chinese (页池 page pool, 队头阻塞 head-of-line blocking, 抢占 preemption) and in English
# where they do (Prefill, Decode, Chunked Prefill, Iteration-level Scheduling, Goodput).
#
# **After this chapter you will be able to**
#
# - open and run the course (`make lab`, `make test`) and say what each chapter adds;
# - load the default model and get an answer through minicb with `LLM.chat`;
# - read a first timeline picture: which request ran at which engine step;
# - find your way around the engine's source, one concept per module.

# %% [markdown]
# ## What the course builds
#
# | chapter | seed section | what you build or measure |
# |---|---|---|
# | **00** setup and tour | | the default model answering through minicb, a first timeline |
# | **01** single request, paged KV | v1, 2.1 | Prefill vs Decode measured; pages, the 页池 page pool, page tables, the 前缀索引 prefix index, int8 and prepacked weights |
# | **02** static batching | 1.1, 1.2, 2.2 | v1 under concurrency; 静态批处理 static batching and request-level dynamic batching; the R1/R2/R3 example and its dead slots; a steady stream whose queue keeps growing |
# | **03** continuous batching | 1.3, 2.3, 2.5 | Iteration-level Scheduling, the four phases of a step, R4 taking R1's 槽位 slot at step 31, which workloads gain |
# | **04** chunked prefill | 2.4, 3 (problem one, two) | a long prompt blocking every decode; chunks; prefill-first still starving decodes |
# | **05** PD interleaving | 3 | the decode-first token budget, mixed `[B_dec, 1]` + `[1, N_chunk]` batches, dec@P and short_P |
# | **06** benchmarking like production | the benchmark contract | arrival processes, percentiles, goodput at an SLO, how long a run must be, every answer to a full cache (wait, reserve, evict, preempt and recompute, swap, reject) and a bound on preemption loss, cancellation, fairness, priority, deadlines and tenants, a sweep and a replayed trace |
# | **07** GPU kernels | | paged attention, the KV store, fused RMSNorm and RoPE in Triton, checked on the CPU in Triton's interpreter |
# | **08** where next | | minicb's knobs beside vLLM's and SGLang's, serving, a C decode-attention kernel built and measured, speculative decoding by prompt lookup |
#
# Each chapter imports the engine from the `minicb` package; none pastes engine code. Where a
# chapter builds an idea by hand first (a toy page allocator, a toy batch loop), a cell then checks
# that minicb gives the same answer.

# %% [markdown]
# ## How to run it
#
# From the repository root:
#
# ```bash
# make lab    # creates .venv on first use, installs everything, opens this notebook in JupyterLab
# make test   # the whole test suite, including every chapter executed by nbval
# make demo   # a few chat prompts answered with continuous batching, printed with a timeline
# ```
#
# Every chapter runs top to bottom in at most three minutes on two CPU cores (most in under two)
# with the default model, SmolLM2-135M-Instruct (135 M parameters, float32 on the CPU; its
# package ships the weights quantized to 4 bits, Q4_1 GGUF, which minicb dequantizes once, so its
# answers differ a little from the original weights'). With a
# CUDA build of torch and a GPU, engines go to the GPU by default (`device="auto"`; `device="cpu"`
# keeps them here) and the notebooks are meant to run unchanged, much faster per step, though so
# far they have been checked on the CPU only; chapter 07 says how to install the CUDA build.
# The stored outputs are the CPU's: on a GPU, weights default to bfloat16 (other tokens, other
# schedules where text sets a length) and the page pool is sized from free memory, so to check a
# notebook against them there, hide the GPU (`CUDA_VISIBLE_DEVICES= make test`).
#
# `make test` runs each notebook with `nbval`: cells that print schedule tables and counts start
# with `# NBVAL_CHECK_OUTPUT` and must reproduce their stored output, apart from numbers with
# time, rate or percent units, which `tests/sanitize.cfg` masks. That is possible
# because a schedule is counted in **engine steps**, not seconds, and greedy sampling with fixed
# output lengths makes it independent of the generated text. Wall-clock numbers and generated text
# are marked `# NBVAL_IGNORE_OUTPUT`.

# %% [markdown]
# ## The default model answers a question
#
# `LLM` is a vLLM-style façade: the name of the bundled model (or a local Hugging Face checkpoint
# directory) plus engine options. The very first load converts the bundled GGUF file into a
# float32 checkpoint once (about a minute); after that it loads in one to two seconds (the
# weights read from the cache and prepacked, and transformers imported for the tokenizer).

# %%
# NBVAL_IGNORE_OUTPUT
import time

from minicb import LLM, SamplingParams

t0 = time.perf_counter()
llm = LLM("smollm2-135m", policy="continuous", max_num_seqs=4)
print(f"loaded in {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# The engine keeps what it loaded: the model's shape, its tokenizer and the end-of-sequence ids.

# %%
# NBVAL_CHECK_OUTPUT
cfg = llm.engine.info.config
n_params = sum(p.numel() for p in llm.engine.model.parameters())
print(f"{cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
      f"{cfg.num_heads} query heads / {cfg.num_kv_heads} KV heads of {cfg.head_dim}, "
      f"vocabulary {cfg.vocab_size}")
print(f"{n_params / 1e6:.1f} M parameters, dtype {next(llm.engine.model.parameters()).dtype}")
print(f"policy={llm.engine.config.policy}, page_size={llm.engine.config.page_size}, "
      f"num_pages={llm.engine.pool.num_pages}, max_num_seqs={llm.engine.config.max_num_seqs}")

# %% [markdown]
# `LLM.chat` applies the checkpoint's chat template and generates. `temperature=0.0` is greedy
# decoding: the same prompt always gives the same tokens.

# %%
# NBVAL_IGNORE_OUTPUT
greedy = SamplingParams(max_tokens=40, temperature=0.0)
t0 = time.perf_counter()
[out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy,
                 use_tqdm=False)
print(out.text)
print(f"{len(out.token_ids)} tokens, finish_reason={out.finish_reason!r}, "
      f"{time.perf_counter() - t0:.2f} s")

# %% [markdown]
# An output carries more than text: the prompt and output token ids, why it stopped (`"stop"`
# at an end-of-sequence token, `"length"` at `max_tokens`), and its milestones, both as engine
# step numbers and as wall-clock seconds.

# %%
# NBVAL_IGNORE_OUTPUT
m = out.metrics
print("prompt tokens :", len(out.prompt_token_ids))
print("output tokens :", out.token_ids[:12], "...")
print("steps         : arrived", m.arrival_step, "| first token", m.first_token_step,
      "| finished", m.finish_step)
print(f"seconds       : time to first token {m.first_token_time - m.arrival_time:.3f}, "
      f"end to end {m.finish_time - m.arrival_time:.3f}")

# %% [markdown]
# ## A first timeline
#
# Now four questions at once. The engine advances in **steps**; each step runs the model once
# over a batch of requests. `llm.engine.trace` holds one `StepRecord` per step: who was in the
# batch, what each member did (prefill its prompt, or decode one token), who finished. Every
# picture in the course is drawn from that plain data by `minicb.course.viz`.

# %%
# NBVAL_IGNORE_OUTPUT
questions = ["What is the capital of France?",
             "Give me three tips for staying focused while studying.",
             "Explain in one sentence what a GPU is.",
             "Write a haiku about autumn leaves."]
llm = LLM("smollm2-135m", policy="continuous", max_num_seqs=4)
t0 = time.perf_counter()
outs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                SamplingParams(max_tokens=48, temperature=0.0), use_tqdm=False)
elapsed = time.perf_counter() - t0
for q, o in zip(questions, outs):
    print(f">>> {q}\n{o.text.strip()}\n")
tokens = sum(len(o.token_ids) for o in outs)
print(f"{tokens} tokens in {elapsed:.1f} s = {tokens / elapsed:.1f} tokens/s "
      f"over {len(llm.engine.trace)} steps")

# %%
%matplotlib inline
from minicb.course import viz

viz.plot_timeline(llm.engine.trace, title="four chat requests under continuous batching")

# %% [markdown]
# Read it row by row. Each request starts with one orange **prefill** cell: its whole prompt
# (a few dozen tokens of chat template and question) goes through the model in one step and
# yields the first output token. Then come blue **decode** cells, one token per step, until
# the black bar where it finishes (an end-of-sequence token or `max_tokens`). All four run side
# by side: one forward per step serves the whole batch. Which request stops first depends on
# what the model writes, so the exact shape can differ on another machine; the later chapters
# fix output lengths (`ignore_eos=True`) whenever a schedule is checked.
#
# The same trace also prints as text, the way the seed draws its timelines:

# %%
# NBVAL_IGNORE_OUTPUT
print(viz.render_text(llm.engine.trace, width=90))

# %% [markdown]
# ## Where the code lives
#
# One concept per module; the chapter column says where each is explained.
#
# | module | what it holds | chapter |
# |---|---|---|
# | `minicb/config.py` | `EngineConfig`: every knob (policy, page_size, num_pages, max_num_seqs, max_num_batched_tokens, chunk_size…) | all |
# | `minicb/request.py` | `Request` (WAITING → RUNNING → FINISHED), `SamplingParams`, `RequestOutput` | 01 |
# | `minicb/kv_cache.py` | `PagePool` (pages, free list, ref counts) and `PrefixIndex` | 01 |
# | `minicb/model/`, `minicb/attention/` | the Llama-family model over the paged cache; attention backends (the PyTorch reference, Triton kernels for GPUs, a C kernel for CPUs) | 01, 07, 08 |
# | `minicb/scheduler.py` | one class per policy: single, static, dynamic, continuous, chunked, pd | 02–05 |
# | `minicb/engine.py` | `Engine.step()`: schedule → forward → sample → reclaim | 03 |
# | `minicb/trace.py` | `StepRecord`, `Member`: what every picture and metric reads | 02–06 |
# | `minicb/course/viz.py` | timelines, slots, pages, token budget, the step-through widget | 02–05 |
# | `minicb/benchmark/workload.py`, `minicb/benchmark/metrics.py`, `minicb/benchmark/bench.py` | workloads, latency metrics, the benchmark | 05, 06 |
#
# The rules between them are strict: schedulers decide from requests, token counts and pages and
# never touch a tensor; the model sees one flat batch of tokens and never a request; `viz` reads
# traces and the engine never draws. You can open any of these files next to a chapter.

# %%
# NBVAL_IGNORE_OUTPUT
import inspect

import minicb

root = inspect.getfile(minicb).rsplit("/", 1)[0]
print("minicb is imported from", root)
print("Engine.step is defined at", f"{inspect.getsourcefile(minicb.Engine).split('/minicb/')[-1]}"
      f":{inspect.getsourcelines(minicb.Engine.step)[1]}")

# %% [markdown]
# ## Recap
#
# - minicb is a real engine: `LLM("smollm2-135m", policy=...)`, then `generate` or `chat`.
# - It works in **steps**; `engine.trace` records each one as plain data, and `minicb.course.viz` draws
#   it. Checked outputs in this course count steps, so they do not depend on which CPU runs
#   them (a GPU defaults to bfloat16 and a larger pool: `CUDA_VISIBLE_DEVICES=` hides it).
# - The next chapter opens v1: one request, its prefill and its decodes, and the paged KV cache
#   underneath.
#
# **Exercises:** none for this chapter; the graded exercises start after chapter 01, with
# [`exercises/01_paged_kv.ipynb`](../exercises/01_paged_kv.ipynb).
#
# **Try this (not graded):** ask the model questions of your own in the cells above, read the
# text timeline by hand to find which request finished first and at which step, then check your
# answer against `llm.engine.trace` (each `StepRecord` lists the ids that `finished` at it).
