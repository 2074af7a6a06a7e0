"""Random paged-attention problems shared by the attention tests (test_attention_ref.py,
test_triton.py, test_cpu_kernel.py): ragged decode rows, prefill chunks after prefix-cache
hits, pages in shuffled order, every slot that holds no token poisoned with NaN; and
`check_against_dense`, each member's rows against plain dense attention over its own K/V."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from minicb.attention import build_metadata, torch_ref

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


DENSE_GROUP, DENSE_HEAD_DIM, DENSE_PAGE_SIZE = 3, 8, 4  # check_against_dense's problems


def dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] at the last n positions of keys/values [ctx, Hkv, D], causal."""
    n, ctx = len(q), len(keys)
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
        scale=DENSE_HEAD_DIM ** -0.5, enable_gqa=True).transpose(0, 1)


def check_against_dense(members: list[tuple[int, int]], seed: int, attend=None,
                        group: int = DENSE_GROUP, page_size: int = DENSE_PAGE_SIZE) -> None:
    """Store every member's past and new K/V through shuffled pages, attend, and compare each
    member's rows with dense attention over its own contiguous K/V."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    pages = [-(-(c + n) // page_size) for c, n in members]
    free = rng.sample(range(sum(pages)), sum(pages))
    tables = [[free.pop() for _ in range(p)] for p in pages]
    meta = build_metadata(tables, [c for c, _ in members], [n for _, n in members], page_size)
    shape = (sum(pages), page_size, NUM_KV_HEADS, DENSE_HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    full_k = [torch.randn(c + n, NUM_KV_HEADS, DENSE_HEAD_DIM, generator=gen) for c, n in members]
    full_v = [torch.randn(c + n, NUM_KV_HEADS, DENSE_HEAD_DIM, generator=gen) for c, n in members]
    for b, (computed, _) in enumerate(members):  # earlier steps' tokens, then this step's
        past = build_metadata([tables[b]], [0], [computed], page_size)
        torch_ref.store_kv(full_k[b][:computed], full_v[b][:computed], k_cache, v_cache, past)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, members)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, members)])
    torch_ref.store_kv(new_k, new_v, k_cache, v_cache, meta)
    q = torch.randn(len(new_k), NUM_KV_HEADS * group, DENSE_HEAD_DIM, generator=gen)
    out = (attend or torch_ref.attend)(q, k_cache, v_cache, meta, DENSE_HEAD_DIM ** -0.5)
    start = 0
    for b, (_, n) in enumerate(members):
        expected = dense(q[start:start + n], full_k[b], full_v[b])
        torch.testing.assert_close(out[start:start + n], expected, rtol=1e-5, atol=1e-6,
                                   msg=f"member {b}")
        start += n
