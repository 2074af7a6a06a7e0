"""The Hugging Face transformers baseline of `bench --compare hf` (chapter 06): the same
requests through `model.generate` in static batches and through `generate_batch`
(transformers' continuous batching), at minicb's precision, timed the same way."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from minicb.benchmark.runs import progress_bar
from minicb.benchmark.workload import (
    Workload,
)


def hf_model(path: str | Path, device: str, dtype: Any) -> Any:
    """transformers' model of the same checkpoint, in minicb's dtype: same precision, same
    quality (the contract's condition for a comparison), warmed up (`hf_warm_up`)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model = model.to(device).eval()
    hf_warm_up(model, device)
    return model


def hf_warm_up(model: Any, device: str) -> None:
    """One untimed short `generate`, so first-use costs (kernel selection, allocator growth)
    fall outside the timed baseline, as they do for minicb's warmed-up engine (chapter 06)."""
    import torch
    ids = torch.ones((1, 8), dtype=torch.long, device=device)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                       do_sample=False, pad_token_id=0)


def _hf_prompts(workload: Workload, vocab: int) -> list[list[int]]:
    prompts = []
    for i, req in enumerate(workload.requests):
        ids = req.token_ids(i)
        prompts.append([t % vocab for t in ids] if max(ids) >= vocab else ids)
    return prompts


def _arrivals(workload: Workload) -> list[float]:
    """Arrival seconds for the HF baselines; step arrivals have no meaning there: time 0."""
    return [r.arrival_time or 0.0 for r in workload.requests]


def hf_static(model: Any, workload: Workload, batch_size: int, device: str = "cpu",
              progress: bool = True, tokens: dict[str, list[int]] | None = None) -> list[Any]:
    """The same requests through transformers' `model.generate` in static batches (chapter
    06): a batch forms from the requests that have arrived (up to `batch_size`), runs, with
    left padding, until its longest output is done, then the next forms. Greedy; EOS neither
    stops a row nor is kept from being chosen (eos_token_id=None: minicb's ignore_eos; the
    min_new_tokens of earlier versions banned it, and a request whose greedy answer holds an EOS
    then took another path). A logits processor stamps each step's time,
    so every request gets its token times, and its release time is the batch's end (E2E counts
    to it, as for minicb's static policy). Returns RequestRecords; `tokens`, if given, receives
    each request's output token ids."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from minicb.benchmark.metrics import RequestRecord

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):  # noqa: D401
            self.times.append(time.perf_counter())
            return scores

    vocab = model.config.vocab_size
    prompts = _hf_prompts(workload, vocab)
    arrivals = _arrivals(workload)
    order = sorted(range(len(prompts)), key=lambda i: (arrivals[i], i))
    pad = model.generation_config.pad_token_id
    pad = pad if isinstance(pad, int) else 0
    records = []
    bar = progress_bar(progress, len(prompts), "hf-static")
    t0 = time.perf_counter()
    pos = 0
    while pos < len(order):
        now = time.perf_counter() - t0
        if arrivals[order[pos]] > now:
            time.sleep(arrivals[order[pos]] - now)
            now = time.perf_counter() - t0
        batch = []
        while pos < len(order) and len(batch) < batch_size and arrivals[order[pos]] <= now:
            batch.append(order[pos])
            pos += 1
        width = max(len(prompts[i]) for i in batch)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch],
                           device=device)
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i])
                             for i in batch], device=device)
        new = max(workload.requests[i].max_tokens for i in batch)
        stamp = Stamp()
        start = time.perf_counter() - t0
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                 eos_token_id=None, do_sample=False, pad_token_id=pad,
                                 logits_processor=LogitsProcessorList([stamp]))
        times = [t - t0 for t in stamp.times]
        for row, i in enumerate(batch):
            n = workload.requests[i].max_tokens
            rid = workload.requests[i].request_id or f"req-{i}"
            if tokens is not None:
                tokens[rid] = out[row, width:width + n].tolist()
            records.append(RequestRecord(  # generate returns the batch whole, at its end
                rid, len(prompts[i]), n, "length", arrivals[i], start, times[0],
                times[n - 1], times[:n], None, None, None, None, [],
                released_time=times[-1], returned_whole=True))
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    return records


def hf_generate_batch(model: Any, workload: Workload, max_num_seqs: int,
                      max_batch_tokens: int, device: str = "cpu",
                      progress: bool = True, setup: dict | None = None,
                      tokens: dict[str, list[int]] | None = None,
                      cb_options: dict[str, Any] | None = None) -> list[Any]:
    """The same requests through transformers' own continuous batching (chapter 06), the
    engine behind `model.generate_batch`: its manager, so each request keeps its own
    max_new_tokens and is sent at its arrival time. Greedy, no EOS (eos_token_id=-1).
    Token times come from the manager's `record_timestamps`. Returns RequestRecords; `setup`,
    if given, receives what transformers chose (attention, CUDA graphs, async batching);
    `tokens`, each request's output token ids; `cb_options`, more ContinuousBatchingConfig
    fields (`use_cuda_graph=True` for `--hf-cuda-graphs`), refused if this transformers
    has no such field."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    from minicb.benchmark.metrics import RequestRecord

    vocab = model.config.vocab_size
    prompts = _hf_prompts(workload, vocab)
    arrivals = _arrivals(workload)
    order = sorted(range(len(prompts)), key=lambda i: (arrivals[i], i))
    longest = max(r.max_tokens for r in workload.requests)
    gen = GenerationConfig(do_sample=False, max_new_tokens=longest, eos_token_id=-1,
                           pad_token_id=0)
    total_tokens = sum(len(p) + r.max_tokens for p, r in zip(prompts, workload.requests))
    page = 16
    # transformers renamed block_size to page_size after 5.17 (a GPU image may hold the older)
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    unknown = sorted(set(cb_options or {}) - names)
    if unknown:
        raise ValueError(f"this transformers' ContinuousBatchingConfig has no {unknown}")
    cb = ContinuousBatchingConfig(**{"page_size" if "page_size" in names else "block_size": page},
                                  num_blocks=total_tokens // page + 2 * len(prompts) + 8,
                                  max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=max_num_seqs, **(cb_options or {}))
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                          max_generated_length=longest, num_requests=len(prompts))
    ids_of = {}
    results: dict[str, Any] = {}
    bar = progress_bar(progress, len(prompts), "hf-generate-batch")
    with model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, workload_hints=hints,
            block=True, timeout=5) as manager:
        if setup is not None:  # without flash-attn: paged|sdpa, no CUDA graphs, no async
            chosen = getattr(manager, "continuous_batching_config", None)
            setup.update(attn_implementation=getattr(model.config, "_attn_implementation", None),
                         use_cuda_graph=getattr(chosen, "use_cuda_graph", None),
                         use_async_batching=getattr(chosen, "use_async_batching", None))
        t0 = time.perf_counter()
        pos = 0
        while len(results) < len(prompts):
            now = time.perf_counter() - t0
            while pos < len(order) and arrivals[order[pos]] <= now:
                i = order[pos]
                rid = workload.requests[i].request_id or f"req-{i}"
                ids_of[rid] = i
                manager.add_request(prompts[i], request_id=rid,
                                    max_new_tokens=workload.requests[i].max_tokens,
                                    record_timestamps=True, eos_token_id=-1)
                pos += 1
            wait = 0.05 if pos >= len(order) else max(0.0, arrivals[order[pos]] - now)
            result = manager.get_result(timeout=min(wait, 0.05) or 0.001)
            if result is not None and result.is_finished():
                results[result.request_id] = result
                if bar is not None:
                    bar.update(1)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped early")
    if bar is not None:
        bar.close()
    records = []
    for rid, out in results.items():
        i = ids_of[rid]
        if tokens is not None:
            tokens[rid] = list(out.generated_tokens)
        times = [t - t0 for t in (out.timestamps or [])]
        reason = "error" if out.error else "length"
        start = out.lifespan[0] - t0 if out.lifespan[0] > 0 else None
        end = out.lifespan[1] - t0 if out.lifespan[1] > 0 else (times[-1] if times else None)
        records.append(RequestRecord(
            rid, len(prompts[i]), len(out.generated_tokens), reason, arrivals[i], start,
            times[0] if times else None, end, times, None, None, None, None, []))
    return records


def hf_single_stream(model: Any, num_prompts: int = 3, prompt_len: int = 128,
                     max_tokens: int = 32, device: str = "cpu") -> dict[str, Any]:
    """HF `generate` at batch 1 (chapter 01 baseline): prefill tokens/s from a one-token
    generate, decode tokens/s from the rest of a `max_tokens` generate."""
    import numpy as np
    import torch
    rng = np.random.default_rng(1234)
    vocab = model.config.vocab_size
    prefill_s = full_s = 0.0
    kw = dict(do_sample=False, pad_token_id=0)
    for _ in range(num_prompts):
        ids = torch.tensor([(rng.integers(100, 10000, prompt_len) % vocab).tolist()],
                           device=device)
        with torch.inference_mode():
            t = time.perf_counter()
            model.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, **kw)
            prefill_s += time.perf_counter() - t
            t = time.perf_counter()
            model.generate(input_ids=ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           **kw)
            full_s += time.perf_counter() - t
    decode_s = full_s - prefill_s
    return {"prompts": num_prompts, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "prefill_tokens_per_s": num_prompts * prompt_len / prefill_s,
            "decode_tokens_per_s": num_prompts * (max_tokens - 1) / decode_s
            if decode_s > 0 else None}
