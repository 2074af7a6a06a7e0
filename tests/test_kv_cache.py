"""The page pool and prefix index (chapter 01): allocation, ref counts, LRU eviction, no leaks."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minicb.kv_cache import PagePool, prompt_page_hashes


def test_allocate_and_release_balance():
    """Pages allocated and released keep num_free and num_used in balance; allocating past the pool
    raises MemoryError, and releasing a page more often than it was taken raises ValueError."""
    pool = PagePool(8, 4)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert sorted(a + b) == list(range(8)) and pool.num_free == 0
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.check([a, b])
    pool.release(a)
    assert pool.num_free == 3 and pool.num_used == 5
    pool.check([b])
    with pytest.raises(ValueError, match="released more often"):
        pool.release(a)


def test_allocation_is_all_or_nothing():
    """A request for more pages than are free raises MemoryError and takes none."""
    pool = PagePool(4, 4)
    pool.allocate(3)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    assert pool.num_free == 1


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_refused_share_or_release_changes_nothing(prefix_caching):
    """A free page among the pages given, or a page released more often than it is held
    (listed twice), is the caller's bug: ValueError, and the pages before it keep their
    counts, so the pool stays usable and its books balance."""
    pool = PagePool(6, 4, enable_prefix_caching=prefix_caching)
    held = pool.allocate(2)
    free = [p for p in range(6) if p not in held]
    for bad in ([held[0], free[0]], [held[1], held[1]]):
        with pytest.raises(ValueError, match="released more often"):
            pool.release(bad)
        assert pool.ref_count == [1 if p in held else 0 for p in range(6)]
        assert pool.num_free == 4
    with pytest.raises(ValueError, match="is free"):
        pool.share([held[0], free[0]])
    assert pool.ref_count == [1 if p in held else 0 for p in range(6)]
    pool.release(held)
    pool.check([])


def test_chained_hash_depends_on_everything_before():
    """A page's hash covers every token before it: a different first page changes the second page's
    hash, and a prompt shorter than one page has no hashes."""
    a = prompt_page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = prompt_page_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0]
    assert a[1] != b[1], "same second page after a different first page must hash differently"
    assert prompt_page_hashes([1, 2, 3], 4) == []


def test_prefix_hit_shares_pages_and_is_capped():
    """A prefix match returns the longest run of cached full pages but leaves at least one prompt
    token to compute, and sharing a matched page raises its reference count."""
    pool = PagePool(16, 4)
    prompt = list(range(12))
    table = pool.allocate(3)
    pool.register_prompt_pages(prompt, table, 12)
    # the identical prompt may reuse only 2 of its 3 full pages: one token must be computed
    assert pool.match_prefix(prompt) == table[:2]
    assert pool.match_prefix(prompt + [99]) == table
    assert pool.match_prefix([0, 1, 2, 3, 7, 7, 7, 7, 8]) == table[:1]
    pool.share(table[:2])
    assert pool.ref_count[table[0]] == 2
    pool.check([table, table[:2]])


def test_lru_eviction_of_unreferenced_cached_pages():
    """Released prompt pages stay cached and matchable; allocation takes free pages first, then
    evicts the least recently used cached page (a match refreshes it) and counts the eviction."""
    pool = PagePool(5, 2)
    old = pool.allocate(2)
    pool.register_prompt_pages([1, 2, 3, 4], old, 4)
    pool.release(old)
    assert pool.num_cached == 2 and pool.num_free == 3 and pool.num_available == 5
    newer = pool.allocate(2)
    pool.register_prompt_pages([5, 6, 7, 8], newer, 4)
    pool.release(newer)
    pool.share(pool.match_prefix([1, 2, 3, 4, 0]))  # touch the old prefix: it becomes used
    pool.release(old)  # ...and unreferenced again, now the most recently used
    taken = pool.allocate(2)
    # the free page goes first, then the least recently used cached page: newer's last page
    assert taken == [4, newer[1]]
    assert pool.num_evicted == 1  # the free page cost nothing; the cached one is counted
    assert pool.match_prefix([5, 6, 7, 8, 0]) == newer[:1]
    assert pool.match_prefix([1, 2, 3, 4, 0]) == old
    pool.check([taken])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "release", "register"]),
                          st.integers(0, 5)), max_size=60), st.integers(0, 2**16))
def test_random_operations_never_leak(ops, seed):
    """Any sequence of matched, shared, allocated, registered and released tables keeps the pool
    consistent, and releasing them all leaves no page used."""
    rng = random.Random(seed)
    pool = PagePool(12, 2)
    tables: list[list[int]] = []
    for op, n in ops:
        if op == "alloc" and n <= pool.num_available:
            tokens = [rng.randrange(3) for _ in range(2 * (n + 1))]
            hit = pool.match_prefix(tokens)
            evictable = sum(1 for p in hit if pool.ref_count[p] == 0)
            if n <= pool.num_available - evictable:
                pool.share(hit)
                table = hit + pool.allocate(n)
                pool.register_prompt_pages(tokens, table, 2 * len(table))
                tables.append(table)
        elif op == "release" and tables:
            pool.release(tables.pop(rng.randrange(len(tables))))
        pool.check(tables)
    for table in tables:
        pool.release(table)
    pool.check([])
    assert pool.num_used == 0 and pool.num_free + pool.num_cached == 12


def test_only_computed_prompt_pages_are_indexed():
    """Only prompt pages whose tokens are all computed are registered for prefix matching."""
    from minicb.kv_cache import PagePool
    pool = PagePool(8, 4)
    prompt = list(range(12))
    table = pool.allocate(3)
    pool.register_prompt_pages(prompt, table, 5)  # a first chunk: only page 0 is computed
    assert pool.match_prefix(prompt + [99]) == table[:1]


def test_the_pool_is_zeros_each_layer_its_own_and_unused_pages_cost_no_memory():
    """Every K and V page starts at zero, writing one layer's K touches no other tensor, and on
    Linux a 1 GiB pool adds far less than that to the process's resident memory until its pages
    are written (calloc's lazily mapped zeros; torch.zeros would write all of it at once)."""
    import sys

    import torch
    pool = PagePool(8, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 and t.shape == (8, 4, 2, 8) and t.is_contiguous()
               and not t.any() for t in pool.k + pool.v)
    pool.k[1][3] = 1.0
    assert int(pool.k[1].count_nonzero()) == 4 * 2 * 8
    assert not any(t.any() for i, t in enumerate(pool.k + pool.v) if i != 1)
    if sys.platform != "linux":
        return

    def resident_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    before = resident_mib()
    big = PagePool(4096, 16, num_layers=16, num_kv_heads=4, head_dim=64)  # 1 GiB of float32
    assert resident_mib() - before < 100
    big.k[0][:16] = 1.0  # the first pages written become resident; the rest stay unmapped
    assert resident_mib() - before < 100 and float(big.k[0][:16].sum()) == 16 * 16 * 4 * 64


def test_a_page_already_indexed_is_not_indexed_again_under_other_tokens():
    """A page the index holds keeps its first prompt's hash: registering it again under a
    second prompt's tokens does nothing (else that prompt would hit pages holding another
    prompt's K/V), and once the page is evicted neither prompt hits it."""
    pool = PagePool(4, 2)
    table = pool.allocate(2)
    pool.register_prompt_pages([1, 2, 3, 4], table, 4)
    pool.register_prompt_pages([5, 6, 7, 8], table, 4)  # the same pages: already taken
    assert pool.match_prefix([5, 6, 7, 8, 0]) == []
    assert pool.match_prefix([1, 2, 3, 4, 0]) == table
    pool.release(table)
    fresh = pool.allocate(4)  # every page, the two cached ones evicted
    assert pool.match_prefix([1, 2, 3, 4, 0]) == [] and pool.match_prefix([5, 6, 7, 8, 0]) == []
    pool.check([fresh])


def test_the_swap_space_is_host_memory_whatever_the_pools_device():
    """The swap store is host memory, whatever the pool's device."""
    pool = PagePool(4, 2, num_layers=1, num_kv_heads=1, head_dim=2, device="meta",
                    num_swap_pages=2)
    assert pool.every_layer.device.type == "meta" and pool.swap_store.device.type == "cpu"
