# %% [markdown]
# # 00 · Setup and a tour of minicb
#
# This course grows **minicb**, a small but real LLM inference engine.
# It loads a real checkpoint, keeps the KV cache in fixed-size pages, and schedules many requests at once.
#
# The chapters follow one text, the chapter *Continuous Batching 与 Chunked Prefill* (written in Chinese).
# The course calls it **the seed**: "seed §2.3" means its section 2.3.
# It goes from one request at a time (v1) to 连续批处理 continuous batching, Chunked Prefill and PD 交错 prefill/decode interleaving (v2).
# A second text, **the benchmark contract**, sets the rules for measuring an engine; chapter 06 follows it.
# Where the sources use Chinese terms, the course gives them beside the English (页池 page pool, 抢占 preemption).
#
# **After this chapter you will be able to**
#
# - run the course (`make lab`, `make test`) and say what each chapter adds;
# - get an answer from the default model through minicb with `LLM.chat`;
# - read a first timeline picture: which request ran at which engine step;
# - find your way around the engine's source, one concept per module.

# %% [markdown]
# ## What the course builds
#
# | chapter | seed section | what you build or measure |
# |---|---|---|
# | **00** setup and tour | | the default model answering, a first timeline |
# | **01** single request, paged KV | v1, 2.1 | Prefill vs Decode, the 页池 page pool, page tables, the 前缀索引 prefix index |
# | **02** static batching | 1.1, 1.2, 2.2 | v1 under load; 静态批处理 static batching and its dead slots (R1/R2/R3) |
# | **03** continuous batching | 1.3, 2.3, 2.5 | the four phases of a step; R4 takes R1's 槽位 slot at step 31 |
# | **04** chunked prefill | 2.4, 3 | a long prompt blocks every decode; chunks; prefill-first still stalls decodes |
# | **05** PD interleaving | 3 | the decode-first budget, the mixed batch as an attention mask, dec@P and short_P |
# | **06** benchmarking like production | the contract | arrivals, percentiles, goodput, a full cache, fairness, sweeps |
# | **07** GPU kernels | | paged attention and the KV store in Triton, checked on the CPU |
# | **08** where next | | vLLM and SGLang knobs, serving, CPU speed, speculative decoding |
#
# Each chapter imports the engine from the `minicb` package; none pastes engine code.

# %% [markdown]
# ## How to run it
#
# From the repository root:
#
# ```bash
# make lab    # creates .venv, installs everything, opens this notebook in JupyterLab
# make test   # the whole test suite, every chapter executed by nbval
# make demo   # a few chat prompts answered with continuous batching
# ```
#
# Every chapter runs in a few minutes on two CPU cores.
# The default model is SmolLM2-135M-Instruct, in float32 on the CPU.
# Its package ships 4-bit weights (Q4_1 GGUF), which minicb dequantizes once.
# On a GPU the engine defaults to bfloat16; [docs/gpu.md](../docs/gpu.md) says how to run there.
#
# `make test` checks stored outputs: a cell marked `# NBVAL_CHECK_OUTPUT` must print the same again.
# That works because a schedule is counted in **engine steps**, not seconds.
# Cells that print seconds or generated text are marked `# NBVAL_IGNORE_OUTPUT`.

# %% [markdown]
# ## The default model answers a question
#
# `LLM` is a vLLM-style façade: a model name (or a local Hugging Face checkpoint directory) plus engine options.
# The first load converts the bundled GGUF file once; later loads read the cache.

# %%
# NBVAL_IGNORE_OUTPUT
import time

from minicb import LLM, SamplingParams

t0 = time.perf_counter()
llm = LLM("smollm2-135m", policy="continuous", max_num_seqs=4)
print(f"loaded in {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# The engine keeps what it loaded: the model's shape, its tokenizer and its end-of-sequence ids.

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
# `LLM.chat` applies the chat template and generates.
# `temperature=0.0` is greedy decoding: the same prompt always gives the same tokens.

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
# An output carries the prompt and output token ids and why it stopped (`"stop"` or `"length"`).
# It also carries its milestones, as engine steps and as seconds.

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
# Now four questions at once. The engine advances in **steps**: each step runs the model once over a batch.
# `llm.engine.trace` holds one `StepRecord` per step: who was in the batch and what each did.
# Every picture in the course is drawn from that plain data by `minicb.course.viz`.

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
# Read it row by row. Each request starts with one orange **prefill** cell: its whole prompt in one step.
# Then come blue **decode** cells, one token per step, until the black bar where it finishes.
# All four run side by side: one forward per step serves the whole batch.
# Which request stops first depends on what the model writes.
# Later chapters fix output lengths (`ignore_eos=True`) whenever a schedule is checked.
#
# The same trace also prints as text, the way the seed draws its timelines:

# %%
# NBVAL_IGNORE_OUTPUT
print(viz.render_text(llm.engine.trace, width=90))

# %% [markdown]
# ## Where the code lives
#
# | module | what it holds | chapter |
# |---|---|---|
# | `minicb/config.py` | `EngineConfig`: every knob | all |
# | `minicb/request.py` | `Request` (WAITING → RUNNING → FINISHED), `SamplingParams` | 01 |
# | `minicb/kv_cache.py` | `PagePool` (pages, free list, ref counts) and `PrefixIndex` | 01 |
# | `minicb/model/`, `minicb/attention/` | the model over the paged cache; attention backends | 01, 07, 08 |
# | `minicb/scheduler.py` | one class per policy: single, static, dynamic, continuous, chunked, pd | 02–05 |
# | `minicb/engine.py` | `Engine.step()`: schedule → forward → sample → reclaim | 03 |
# | `minicb/trace.py` | `StepRecord`, `Member`: what every picture and metric reads | 02–06 |
# | `minicb/course/viz.py` | timelines, slots, pages, token budget, attention mask | 02–05 |
# | `minicb/benchmark/` | workloads, latency metrics, the simulator, the benchmark | 05, 06 |
#
# Schedulers decide from requests, token counts and pages; they never touch a tensor.
# The model sees one flat batch of tokens and never a request. `viz` reads traces; the engine never draws.

# %%
# NBVAL_IGNORE_OUTPUT
import inspect

import minicb

print("minicb is imported from", inspect.getfile(minicb).rsplit("/", 1)[0])
print("Engine.step is defined in", inspect.getsourcefile(minicb.Engine).split("/minicb/")[-1])

# %% [markdown]
# ## Recap
#
# - minicb is a real engine: `LLM("smollm2-135m", policy=...)`, then `generate` or `chat`.
# - It works in **steps**. `engine.trace` records each one as plain data, and `minicb.course.viz` draws it.
# - Checked outputs count steps, so they do not depend on the machine.
# - Next, chapter 01 opens v1: one request, its prefill and decodes, over a paged KV cache.
#
# **Exercises:** none for this chapter; they start with [`exercises/01_paged_kv.ipynb`](../exercises/01_paged_kv.ipynb).
#
# **Try this (not graded):** ask questions of your own above.
# Find in the text timeline which request finished first, then check it in `llm.engine.trace`.
