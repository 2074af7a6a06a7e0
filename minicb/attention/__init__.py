"""Attention over the paged KV cache (chapter 01; GPU kernels in chapter 07).

The model never sees a request: it sees one flat batch. `AttentionMetadata` says, for each
member of the step, where its query rows are, how long its context is after this step and which
pages hold that context. Decode members (one query row each) come first, then prefill chunks,
so a step is `[B_dec, 1]` decode rows followed by `[1, N_chunk]` chunks in one token batch.

A backend provides two functions with the same signatures:
  store_kv(k, v, k_cache, v_cache, meta)     write this step's new K/V through the slot mapping
  attend(q, k_cache, v_cache, meta, scale)   -> [T, num_heads, head_dim]
Caches are shaped [num_pages, page_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset for each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: member b owns rows [qsl[b], qsl[b+1])
    context_lens: torch.Tensor  # [B] int32: tokens in member b's cache once this step is stored
    page_tables: torch.Tensor  # [B, max_pages] int32, padded with 0
    query_lens: list[int]
    context_lens_list: list[int]
    num_decodes: int  # members [0, num_decodes) have exactly one query row
    page_size: int
    cache: dict = field(default_factory=dict)  # per-step tensors a backend derives once

    @property
    def num_members(self) -> int:
        return len(self.query_lens)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    def to(self, device: torch.device | str) -> AttentionMetadata:
        return AttentionMetadata(
            self.slot_mapping.to(device), self.query_start_loc.to(device),
            self.context_lens.to(device), self.page_tables.to(device), self.query_lens,
            self.context_lens_list, self.num_decodes, self.page_size)


def build_metadata(page_tables: list[list[int]], num_computed: list[int], num_new: list[int],
                   page_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    """Flatten members into metadata. Member b has `num_computed[b]` tokens already cached and
    advances `num_new[b]` tokens this step; its pages must cover `num_computed + num_new`.
    Members with num_new == 1 must come first (the decode rows)."""
    num_decodes = 0
    while num_decodes < len(num_new) and num_new[num_decodes] == 1:
        num_decodes += 1
    slots: list[int] = []
    for table, start, n in zip(page_tables, num_computed, num_new):
        if (start + n + page_size - 1) // page_size > len(table):
            raise ValueError(f"page table of {len(table)} pages cannot hold {start + n} tokens")
        for pos in range(start, start + n):
            slots.append(table[pos // page_size] * page_size + pos % page_size)
    qsl = [0]
    for n in num_new:
        qsl.append(qsl[-1] + n)
    ctx = [s + n for s, n in zip(num_computed, num_new)]
    width = max((len(t) for t in page_tables), default=1) or 1
    padded = [t + [0] * (width - len(t)) for t in page_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        page_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(
            len(page_tables), width),
        query_lens=list(num_new), context_lens_list=ctx, num_decodes=num_decodes,
        page_size=page_size)


def resolve_backend(name: str = "auto", device: str = "cpu") -> str:
    """'auto' picks Triton on CUDA and the torch reference elsewhere; MINICB_ATTENTION overrides
    'auto'."""
    if name == "auto":
        name = os.environ.get("MINICB_ATTENTION", "auto")
    if name == "auto":
        name = "triton" if str(device).startswith("cuda") else "torch"
    if name not in ("torch", "triton"):
        raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}")
    return name


def get_backend(name: str):
    """Return the module implementing `store_kv` and `attend` for a resolved backend name."""
    if name == "torch":
        from minicb.attention import torch_ref
        return torch_ref
    if name == "triton":
        from minicb.attention import triton_ops
        return triton_ops
    raise ValueError(f"unknown attention backend {name!r}")
