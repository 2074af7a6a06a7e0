"""Tiny random Hugging Face checkpoints for tests: real config.json + model.safetensors written by
transformers' own classes, a few hundred kilobytes each, no tokenizer; and the greedy loops that
drive a model directly (ours over a shuffled paged cache, transformers' `generate`)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from minicb.attention import build_metadata

ARCHS = ("llama", "qwen2", "qwen3", "llama3-rope")


def make_tiny_checkpoint(path: str | Path, arch: str = "llama", tie: bool = False, seed: int = 0,
                         vocab: int = 256, hidden: int = 64, layers: int = 2, heads: int = 4,
                         kv_heads: int = 2, intermediate: int = 128,
                         max_positions: int = 2048) -> Path:
    """Write a random checkpoint of `arch` (one of ARCHS) into `path` and return the path.

    Weights are drawn with a larger std than transformers' default so that logits are spread
    out and greedy decoding does not sit on near-ties."""
    from transformers import (
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
                  initializer_range=0.2)
    if arch == "llama":
        config = LlamaConfig(**common, rope_theta=10000.0)
    elif arch == "llama3-rope":
        # original context below max_positions, so low, medium and high bands all appear
        config = LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif arch == "qwen2":
        config = Qwen2Config(**common, rope_theta=1000000.0)
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=hidden // heads, rope_theta=1000000.0)
    else:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    return save_random_checkpoint(config, path, seed)


def save_random_checkpoint(config, path: str | Path, seed: int = 0) -> Path:
    """A random model of a transformers `config`, norms and biases randomized too (they start
    at 1 and 0), saved into `path` with BOS 1 and EOS 2."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(path)
    return Path(path)


def random_jobs(workload: list[tuple[int, int, int]], seed: int, params: dict) -> list[tuple]:
    """(prompt, SamplingParams, arrival_step) for each (prompt length, max_tokens, arrival) of a
    hypothesis workload: random token ids, three in ten sharing a prefix with the prompt before
    (so prefix-cache pages are shared too). `params`: the other SamplingParams fields."""
    from minicb import SamplingParams
    rng = random.Random(seed)
    jobs: list[tuple] = []
    for prompt_len, max_tokens, arrival in workload:
        prompt = [rng.randrange(3, 250) for _ in range(prompt_len)]
        if rng.random() < 0.3 and jobs:  # share a prefix with an earlier prompt
            prompt = jobs[-1][0][:prompt_len] + prompt[len(jobs[-1][0][:prompt_len]):]
        jobs.append((prompt, SamplingParams(max_tokens=max_tokens, **params), arrival))
    return jobs


def run_beside_single(engine, reference, jobs: list[tuple]) -> list[str]:
    """Add `jobs` [(prompt, params, arrival_step)] to `engine` and, arriving at once, to a
    `single` `reference`; run both and check that every request got the same tokens (batching,
    preemption and guessing never change greedy results). Returns the engine's request ids."""
    ids = [engine.add_request(p, sp, arrival_step=a) for p, sp, a in jobs]
    ref_ids = [reference.add_request(p, sp) for p, sp, _ in jobs]
    engine.run()
    reference.run()
    for i, r in zip(ids, ref_ids):
        assert engine.requests[i].output_token_ids == reference.requests[r].output_token_ids
    return ids


def guessable_model(tokenizer) -> tuple[tuple, object]:
    """The simulated model (always token 100) with `tokenizer` (test_serve's word tokenizer:
    "w100"), for an engine whose guesses (chapter 08) are all right, so each decode step
    brings k + 1 tokens: ((model, info), clock), to pass as `Engine(model, clock=clock)`."""
    import dataclasses

    from minicb.benchmark.sim import CostModel, SimClock, SimModel, sim_model_info
    clock = SimClock()
    info = dataclasses.replace(sim_model_info(256), tokenizer=tokenizer)
    return (SimModel(CostModel(a=0.01), clock, 256), info), clock


def three_in_six(**options):
    """A simulated pd engine with swap: three 6-token prompts, 12 tokens each, in 6 pages of 4;
    r2 is preempted at step 4 with 8 computed tokens (2 pages), r1 at step 8 with 12 (3)."""
    from minicb import SamplingParams
    from minicb.benchmark.sim import make_sim_engine
    engine = make_sim_engine(policy="pd", num_pages=6, page_size=4, max_num_seqs=3,
                             preemption_mode="swap", enable_prefix_caching=False,
                             check_invariants=True, **options)
    for i in range(3):
        engine.add_request([3 + i] * 6, SamplingParams(max_tokens=12, ignore_eos=True),
                           request_id=f"r{i}")
    return engine


# --- driving a model directly: our greedy loop over the paged cache, and transformers' --------

PAGE_SIZE = 4
CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "List three uses of a paperclip."]


def paged_greedy(model, prompt: list[int], max_new: int, eos_ids=(), page_size: int = PAGE_SIZE,
                 seed: int = 0) -> tuple[list[int], list[torch.Tensor]]:
    """One request, greedy: prefill the prompt in one forward, then one token per forward. Its
    pages are a shuffled subset of a larger pool. Returns new tokens and each step's logits."""
    total = len(prompt) + max_new
    num_pages = -(-total // page_size)
    table = random.Random(seed).sample(range(num_pages + 5), num_pages)
    caches = model.allocate_kv_cache(num_pages + 5, page_size)
    tokens, all_logits, ids, start = [], [], list(prompt), 0
    with torch.inference_mode():
        while len(tokens) < max_new:
            meta = build_metadata([table], [start], [len(ids)], page_size)
            logits = model(torch.tensor(ids), torch.arange(start, start + len(ids)), meta, caches,
                           torch.tensor([len(ids) - 1]))
            all_logits.append(logits[0])
            tokens.append(int(logits[0].argmax()))
            start, ids = start + len(ids), tokens[-1:]
            if tokens[-1] in eos_ids:
                break
    return tokens, all_logits


def hf_greedy(hf, prompt: list[int], max_new: int) -> tuple[list[int], list[torch.Tensor]]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=max_new, return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), [x[0] for x in out.logits]


def load_hf(path, ignore_eos: bool = False):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if ignore_eos:  # tiny random models: always run the full length
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
    return hf


def tiny_config(cls, **overrides):
    """A tiny transformers config of class `cls` (for fields `make_tiny_checkpoint` never varies);
    write it with `save_random_checkpoint`."""
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6, initializer_range=0.2,
                  tie_word_embeddings=False)
    return cls(**(common | overrides))
