"""Random paged-attention problems shared by the kernel tests (test_triton.py, test_cpu_kernel.py):
ragged decode rows, prefill chunks after prefix-cache hits, pages in shuffled order, and every
slot that holds no token poisoned with NaN."""

from __future__ import annotations

import random

import torch

from minicb.attention import build_metadata

HEAD_DIM, NUM_KV_HEADS = 16, 2


def make_case(members, page_size, group, shared_pages=0, sharers=(0, 1), seed=0,
              dtype=torch.float32, head_dim=HEAD_DIM, device="cpu"):
    """Random caches and a step for `members`, a list of (num_computed, num_new).

    Pages are handed out in a shuffled order, the two members `sharers` start with the same
    `shared_pages` pages (a prefix-cache hit), and every slot that holds no token is NaN."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-(c + n) // page_size) for c, n in members]
    num_pages = sum(need) + 3  # a few pages nobody owns
    order = list(range(num_pages))
    rng.shuffle(order)
    shared, free = order[:shared_pages], order[shared_pages:]
    tables = []
    for b, pages in enumerate(need):
        own = shared_pages if b in sharers else 0
        tables.append(shared[:own] + [free.pop() for _ in range(pages - own)])
    shape = (num_pages, page_size, NUM_KV_HEADS, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for table, (computed, _) in zip(tables, members):
        for pos in range(computed):  # what earlier steps stored
            page, off = table[pos // page_size], pos % page_size
            k_cache[page, off] = torch.randn(NUM_KV_HEADS, head_dim, generator=gen)
            v_cache[page, off] = torch.randn(NUM_KV_HEADS, head_dim, generator=gen)
    meta = build_metadata(tables, [c for c, _ in members], [n for _, n in members], page_size,
                          device)
    tokens = sum(n for _, n in members)
    heads = NUM_KV_HEADS * group
    # q, k, v as views of one fused projection output, as the model hands them over
    kv_cols = NUM_KV_HEADS * head_dim
    qkv = torch.randn(tokens, heads * head_dim + 2 * kv_cols, generator=gen).to(device, dtype)
    q, k, v = qkv.split([heads * head_dim, kv_cols, kv_cols], -1)
    return (q.view(tokens, heads, head_dim), k.view(tokens, -1, head_dim),
            v.view(tokens, -1, head_dim), k_cache.to(device), v_cache.to(device), meta)


def ragged_decodes(rng, n, page_size):
    return [(rng.randrange(0, 5 * page_size), 1) for _ in range(n)]


def batch(kind: str, page_size: int, seed: int):
    """(members, shared prefix pages, the two members sharing them) for a batch kind. Lengths
    are in units of the page size so both page sizes get the same shapes of problem: chunks
    after a two-page prefix-cache hit, a fresh prompt, a chunk that starts mid-page."""
    rng = random.Random(seed)
    p = page_size
    prefill = [(2 * p, p + 5), (2 * p, 7), (0, 2 * p + 3), (p + 5, max(p - 2, 1))]
    if kind == "decode":
        return [(2 * p + 3, 1), (2 * p + 9, 1)] + ragged_decodes(rng, 4, p), 2, (0, 1)
    if kind == "prefill":
        return prefill, 2, (0, 1)
    # a decode row and a prefill chunk on the same prefix pages
    return [(2 * p + 4, 1)] + ragged_decodes(rng, 3, p) + prefill, 2, (0, 4)


def assert_close(actual, expected):
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=1e-5, atol=2e-6)
