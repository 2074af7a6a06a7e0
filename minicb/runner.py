"""The model runner (chapters 01, 03, 07): it loads the model, sizes the pool, runs and samples."""
# as nano-vllm's `model_runner`: the engine keeps the books, the runner computes

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import warnings

import torch

from minicb.attention import build_metadata, int_tensor, resolve_backend
from minicb.config import EngineConfig, resolve_device, torch_dtype
from minicb.kv_cache import PagePool, page_bytes
from minicb.request import Request
from minicb.sampler import TokenCounts, sample, top_logprobs
from minicb.speculative import verify

BOOKKEEPING_BYTES = 64  # host bytes a page's ref count and free-list entry take


def default_num_pages(model_config, config: EngineConfig, dtype: torch.dtype) -> int:
    """1024 pages on the CPU; on CUDA, what `gpu_memory_utilization` of the free memory holds
    once the weights are loaded (as vLLM does), at most what every slot's longest context needs."""
    if not str(config.device).startswith("cuda"):
        return 1024
    # an earlier engine's pool, dropped, still sits in torch's cache, which the driver counts
    # as used: each engine made in turn in one process would get a tenth of the one before
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(torch.device(config.device))
    per_page = page_bytes(model_config.num_layers, config.page_size, model_config.num_kv_heads,
                          model_config.head_dim, dtype)
    budget = free * config.gpu_memory_utilization - 512 * 2**20  # headroom for activations
    enough = config.max_num_seqs * -(-model_config.max_position_embeddings // config.page_size)
    num_pages = max(16, min(enough, int(budget // per_page)))
    if num_pages * config.page_size < model_config.max_position_embeddings:
        warnings.warn(f"{free / 2**30:.1f} GiB of free GPU memory hold {num_pages} pages, less than"
                      f" one {model_config.max_position_embeddings}-token context: free GPU "
                      f"memory (another engine still held?) or pass num_pages", stacklevel=4)
    return num_pages


def host_memory() -> tuple[int, int] | None:
    """(total, available) bytes of host memory, from /proc/meminfo; None elsewhere."""
    try:
        with open("/proc/meminfo") as lines:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines}
        return info["MemTotal"], info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError, IndexError):
        return None


def check_pool_fits(num_pages: int, num_swap_pages: int, per_page: int, device: str) -> None:
    """ValueError, before anything is allocated, if the pool and swap space cannot fit."""
    books = (num_pages + num_swap_pages) * BOOKKEEPING_BYTES
    host = books + num_swap_pages * per_page
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        if num_pages * per_page > free:
            raise ValueError(f"num_pages={num_pages} needs {num_pages * per_page / 2**30:.1f} GiB"
                             f" of GPU memory, {free / 2**30:.1f} GiB is free: lower it or None")
    else:
        host += num_pages * per_page
    memory = host_memory()
    if memory is not None and (host > memory[0] or books > memory[1]):
        raise ValueError(f"num_pages={num_pages} and num_swap_pages={num_swap_pages} need "
                         f"{host / 2**30:.1f} GiB of host memory, this machine has "
                         f"{memory[0] / 2**30:.1f} ({memory[1] / 2**30:.1f} available); lower them")


def load(model, config: EngineConfig):
    """(config, model, info, KV dtype) for `model`; a loaded `(model, info)` pair is checked."""
    # config.device="auto" becomes where a loaded model lies
    from minicb.model.loader import load_model
    if isinstance(model, torch.nn.Module):  # str(model) would be its repr as a path
        raise ValueError("model is a loaded module without its info: pass the pair "
                         "load_model(...) returned, (model, info), or a name or a path")
    # the loaded model's weights (the simulated model has none)
    embed = getattr(model[0], "embed_tokens", None) if isinstance(model, tuple) else None
    if config.device == "auto":
        config = dataclasses.replace(config, device=str(embed.weight.device) if embed is not None
                                     else resolve_device("auto", config.quantization))
    device, dtype = config.device, torch_dtype(config.dtype, config.device)
    if not isinstance(model, tuple):
        return (config, *load_model(str(model), device=device, dtype=dtype,
                                    quantization=config.quantization), dtype)
    loaded = getattr(model[0], "quantization", None)
    if config.quantization and loaded != config.quantization:  # None takes it as loaded
        # quantizing in place would change a model other engines share
        raise ValueError(f"quantization={config.quantization!r} but the model passed in was loaded "
                         f"with {loaded!r}; load_model(..., quantization={config.quantization!r})")
    want = torch.device(device)
    if embed is not None and (embed.weight.device.type != want.type or (
            want.index is not None and embed.weight.device.index != want.index)):
        raise ValueError(f"device={device!r} but the model passed in is on "
                         f"{embed.weight.device}; load it with load_model(..., device={device!r})")
    if embed is not None and embed.weight.dtype != dtype:
        if config.dtype != "auto":  # a KV cache in another dtype than the model fails each step
            raise ValueError(f"dtype={config.dtype!r} but the model passed in is "
                             f"{embed.weight.dtype}; load it in that dtype or leave dtype='auto'")
        dtype = embed.weight.dtype
    return (config, *model, dtype)


class ModelRunner:
    """The model, its page pool and the CUDA graphs of one engine (chapter 03)."""

    def __init__(self, model, config: EngineConfig, now=time.perf_counter) -> None:
        self.config, self.model, self.info, dtype = load(model, config)
        config = self.config
        self.now = now  # the engine's clock: a simulated forward takes simulated seconds
        self.attention_backend = resolve_backend(config.attention_backend, config.device)
        self.model.set_attention_backend(self.attention_backend)
        mc = self.info.config
        num_pages = config.num_pages or default_num_pages(mc, config, dtype)
        num_swap_pages = (config.num_swap_pages or num_pages
                          if config.preemption_mode == "swap" else 0)
        check_pool_fits(num_pages, num_swap_pages, page_bytes(
            mc.num_layers, config.page_size, mc.num_kv_heads, mc.head_dim, dtype), config.device)
        self.pool = PagePool(num_pages, config.page_size, mc.num_layers, mc.num_kv_heads,
                             mc.head_dim, dtype, config.device, config.enable_prefix_caching,
                             num_swap_pages)
        self.graph_runner = None  # CUDA graphs for decode-only steps (chapter 07)
        if (config.device.startswith("cuda") and config.use_cuda_graphs
                and self.attention_backend == "triton"):
            with self.on_device():
                self.graph_runner = self.make_graph_runner(capture=True)

    def on_device(self) -> contextlib.AbstractContextManager:
        """Make the engine's CUDA device torch's current one (Triton and graphs use it)."""
        device = torch.device(self.config.device)
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    def make_graph_runner(self, capture: bool = True):
        """Static buffers (and, on CUDA, captured graphs) for decode-only steps."""
        from minicb.cuda_graphs import DecodeGraphRunner, graph_buckets
        max_tokens = min(self.info.config.max_position_embeddings,
                         self.pool.num_pages * self.pool.page_size)
        return DecodeGraphRunner(self.model, self.pool.kv_caches, self.pool.page_size,
                                 self.pool.pages_needed(max_tokens), self.config.device,
                                 graph_buckets(self.config.max_num_seqs), capture=capture)

    def copy_pages(self, batch) -> tuple[int, int]:
        """Run the planned swap copies (chapter 06), out before in: (pages out, pages in)."""
        with self.on_device():
            self.pool.swap_out(batch.swap_out)
            self.pool.swap_in(batch.swap_in)
        self.pool.release_swap(batch.swap_release)
        return len(batch.swap_out), len(batch.swap_in)

    def forward(self, items: list[tuple[Request, int]], drafts: dict[str, list[int]]
                ) -> tuple[list[Request], torch.Tensor, float]:
        """One forward over all members: who to sample, their logits, the forward's seconds."""
        if not items:  # no forward at all: even an empty one takes time
            return [], torch.empty(0), 0.0
        start = self.now()
        with self.on_device():
            to_sample, logits = self._forward(items, drafts)
        if logits.is_cuda:  # kernels run asynchronously: time them, not their launch
            torch.cuda.synchronize(logits.device)
        return to_sample, logits, self.now() - start

    def _forward(self, items, drafts):
        runner = self.graph_runner
        if runner is not None and len(items) <= runner.max_batch and all(
                n == 1 and not r.is_prefill for r, n in items):
            reqs, page_size = [r for r, _ in items], self.pool.page_size
            positions = [r.num_computed_tokens for r in reqs]
            slots = [r.page_table[p // page_size] * page_size + p % page_size
                     for r, p in zip(reqs, positions)]
            tokens = [r.token_ids_slice(p, p + 1)[0] for r, p in zip(reqs, positions)]
            return reqs, runner.run(tokens, positions, slots, [p + 1 for p in positions],
                                    [r.page_table for r in reqs])
        input_ids, positions, logit_rows, to_sample = [], [], [], []
        for req, n in items:
            start, draft = req.num_computed_tokens, drafts.get(req.request_id, [])
            input_ids.extend(req.token_ids_slice(start, start + n - len(draft)) + draft)
            positions.extend(range(start, start + n))
            if start + n - len(draft) == req.num_tokens:
                logit_rows.extend(range(len(input_ids) - len(draft) - 1, len(input_ids)))
                to_sample.append(req)
        if self.model.attention_backend_name != self.attention_backend:
            self.model.set_attention_backend(self.attention_backend)  # engines may share a model
        device = self.config.device
        meta = build_metadata([r.page_table for r, _ in items],
                              [r.num_computed_tokens for r, _ in items],
                              [n for _, n in items], self.pool.page_size, device)
        with torch.inference_mode():
            logits = self.model(int_tensor(input_ids, device=device),
                                int_tensor(positions, device=device), meta,
                                self.pool.kv_caches, int_tensor(logit_rows, device=device))
        return to_sample, logits

    @staticmethod
    def sample(reqs: list[Request], logits: torch.Tensor, drafts: dict[str, list[int]]
               ) -> list[list[int]]:
        """Each request's new tokens: one sampled, or the kept guesses and one more (`verify`)."""
        if not reqs:
            return []
        for r in reqs:  # the penalties' counts, from here on kept as tokens are appended
            if r.params.penalised and r.token_counts is None:
                r.token_counts = TokenCounts(r.prompt_token_ids, r.output_token_ids,
                                             logits.shape[-1], logits.device)
        banned = [list(r.stop_tokens) if len(r.output_token_ids) < r.params.min_tokens else []
                  for r in reqs]
        if not drafts:  # one logit row each
            out = [[t] for t in sample(logits, [r.params for r in reqs],
                                       [r.generator for r in reqs], banned,
                                       [r.token_counts for r in reqs])]
            last = list(range(len(reqs)))
        else:
            out, last, row = [], [], 0
            for req, ban in zip(reqs, banned):
                draft = drafts.get(req.request_id, [])
                rows = logits[row:row + len(draft) + 1]
                out.append(verify(rows, draft, req.params, req.generator) if draft else
                           sample(rows, [req.params], [req.generator], [ban], [req.token_counts]))
                row += len(draft) + 1
                last.append(row - 1)
        asked = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if asked:  # nothing to compute when no request asked (never one with guesses)
            for i, pairs in zip(asked, top_logprobs(
                    logits[[last[i] for i in asked]], [out[i][0] for i in asked],
                    [reqs[i].params.logprobs for i in asked])):
                reqs[i].output_logprobs.append(pairs)
        return out
