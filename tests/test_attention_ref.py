"""The torch reference backend (chapter 01) against plain dense attention, member by member:
what the Triton kernels are then compared to (test_triton.py)."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minicb.attention import build_metadata, torch_ref

NUM_KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE = 2, 3, 8, 4


def dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] at the last n positions of keys/values [ctx, Hkv, D], causal."""
    n, ctx = len(q), len(keys)
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
        scale=HEAD_DIM ** -0.5, enable_gqa=True).transpose(0, 1)


def check_against_dense(members: list[tuple[int, int]], seed: int, attend=torch_ref.attend,
                        group: int = GROUP, page_size: int = PAGE_SIZE) -> None:
    """Store every member's past and new K/V through shuffled pages, attend, and compare each
    member's rows with dense attention over its own contiguous K/V."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    pages = [-(-(c + n) // page_size) for c, n in members]
    free = rng.sample(range(sum(pages)), sum(pages))
    tables = [[free.pop() for _ in range(p)] for p in pages]
    meta = build_metadata(tables, [c for c, _ in members], [n for _, n in members], page_size)
    shape = (sum(pages), page_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    full_k = [torch.randn(c + n, NUM_KV_HEADS, HEAD_DIM, generator=gen) for c, n in members]
    full_v = [torch.randn(c + n, NUM_KV_HEADS, HEAD_DIM, generator=gen) for c, n in members]
    for b, (computed, _) in enumerate(members):  # earlier steps' tokens, then this step's
        past = build_metadata([tables[b]], [0], [computed], page_size)
        torch_ref.store_kv(full_k[b][:computed], full_v[b][:computed], k_cache, v_cache, past)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, members)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, members)])
    torch_ref.store_kv(new_k, new_v, k_cache, v_cache, meta)
    q = torch.randn(len(new_k), NUM_KV_HEADS * group, HEAD_DIM, generator=gen)
    out = attend(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    start = 0
    for b, (_, n) in enumerate(members):
        expected = dense(q[start:start + n], full_k[b], full_v[b])
        torch.testing.assert_close(out[start:start + n], expected, rtol=1e-5, atol=1e-6,
                                   msg=f"member {b}")
        start += n


def test_decode_groups_and_chunks_match_dense_attention():
    """21 decode rows (sorted into six groups, contexts 1-120 tokens in shuffled order) and two
    prefill chunks, over pages handed out in random order."""
    rng = random.Random(0)
    members = [(rng.randrange(0, 120), 1) for _ in range(21)] + [(0, 9), (13, 6)]
    assert len(members) - 2 > 2 * torch_ref.DECODE_GROUP
    check_against_dense(members, seed=0)


@settings(max_examples=40, deadline=None)
@given(decodes=st.lists(st.integers(0, 40), min_size=0, max_size=12),
       chunks=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), max_size=2),
       group=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_any_grouping_matches_dense_attention(decodes, chunks, group, seed):
    """Whatever the group size, the decode contexts and the chunks, each member's rows equal
    dense attention over its own K/V."""
    if not decodes and not chunks:
        return
    saved, torch_ref.DECODE_GROUP = torch_ref.DECODE_GROUP, group
    try:
        check_against_dense([(c, 1) for c in decodes] + chunks, seed)
    finally:
        torch_ref.DECODE_GROUP = saved
