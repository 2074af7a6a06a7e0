"""Paged KV memory (chapter 01): a `PagePool` of pages with a free list and ref counts, and a
`PrefixIndex` to reuse full prompt pages. A page is free, used or cached (unreferenced, indexed)."""

from __future__ import annotations

import hashlib
import itertools
import math
from array import array
from collections import Counter, OrderedDict, deque

import numpy as np
import torch


def page_hash(previous: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Chained hash of a full page: it names the page's tokens *and* everything before them."""
    # 8 bytes per id: no two id lists give the same bytes
    data = (previous or b"") + array("q", token_ids).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def prompt_page_hashes(token_ids: list[int], page_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        hashes.append(page_hash(hashes[-1] if hashes else None, token_ids[start:start + page_size]))
    return hashes


class PrefixIndex:
    """hash -> page for full prompt pages; unreferenced ones in LRU order, for eviction."""

    def __init__(self) -> None:
        self.page_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, oldest first

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Pages of the longest run of leading hashes that are cached."""
        return [self.page_of[h] for h in itertools.takewhile(self.page_of.__contains__, hashes)]

    def register(self, h: bytes, page: int) -> None:
        """Index `page` as the full page `h`, unless either is indexed (it then stays private)."""
        if h not in self.page_of and page not in self.hash_of:
            self.page_of[h], self.hash_of[page] = page, h

    def forget(self, page: int) -> None:
        del self.page_of[self.hash_of.pop(page)]
        self.lru.pop(page, None)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zero tensor for a page pool: on the CPU from calloc, only the pages a run writes."""
    # numpy's zeros come from calloc; torch.zeros would write every byte at load
    num_bytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or not num_bytes:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)


def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> int:
    """Bytes of one page of K and V over every layer (chapters 06, 07)."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize


class PagePool:
    """K/V storage for all layers in `num_pages` pages of `page_size` tokens, with bookkeeping.
    `k[layer]` and `v[layer]` are [num_pages, page_size, num_kv_heads, head_dim]; token position
    p of a page table lies in slot table[p // page_size] * page_size + p % page_size."""

    def __init__(self, num_pages: int, page_size: int, num_layers: int = 0, num_kv_heads: int = 0,
                 head_dim: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", enable_prefix_caching: bool = True,
                 num_swap_pages: int = 0) -> None:
        if num_pages < 1 or page_size < 1 or num_swap_pages < 0:
            raise ValueError(f"num_pages and page_size must be >= 1 and num_swap_pages >= 0, got "
                             f"{num_pages}, {page_size}, {num_swap_pages}")
        self.num_pages, self.page_size = num_pages, page_size
        self.ref_count = [0] * num_pages
        self.free: deque[int] = deque(range(num_pages))
        self.prefix = PrefixIndex() if enable_prefix_caching else None
        self.num_evicted = 0  # cached prefix pages taken back for new work, since the start
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.every_layer = zeroed((num_layers, 2, *shape), dtype, device)  # K, V of each layer
        self.k = [self.every_layer[layer, 0] for layer in range(num_layers)]
        self.v = [self.every_layer[layer, 1] for layer in range(num_layers)]
        self.kv_caches = list(zip(self.k, self.v))  # what the model's forward takes
        # swap space (chapter 06): host pages a swapped-out request's K/V wait in, all layers
        self.num_swap_pages = num_swap_pages
        self.swap_free: deque[int] = deque(range(num_swap_pages))
        self.swap_store = zeroed((num_layers, 2, num_swap_pages, *shape[1:]), dtype, "cpu")
        self.stage_swaps = self.every_layer.is_cuda  # through page-locked buffers (_staging)

    # --- counts -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        """Unreferenced pages kept for prefix reuse (evictable)."""
        return len(self.prefix.lru) if self.prefix is not None else 0

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Pages an allocation can get: free ones plus evictable cached ones."""
        return self.num_free + self.num_cached

    def pages_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.page_size - 1) // self.page_size

    def pages_to_take(self, hit: list[int], total: int, claimed: set[int] | None = None) -> int:
        """Available pages a table of `total` pages with hits `hit` takes: its new pages and the
        cached hits no one holds (those not in `claimed`, which they then join)."""
        cached = {p for p in hit if self.ref_count[p] == 0}
        if claimed is not None:
            cached -= claimed
            claimed |= cached
        return total - len(hit) + len(cached)

    # --- allocation ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` fresh pages, evicting cached ones (LRU) if need be; MemoryError if too few."""
        if n > self.num_available:
            raise MemoryError(f"need {n} pages, only {self.num_available} available")
        for _ in range(n - self.num_free):  # evict the least recently used cached pages
            victim, _ = self.prefix.lru.popitem(last=False)
            self.prefix.forget(victim)
            self.free.append(victim)
            self.num_evicted += 1
        pages = [self.free.popleft() for _ in range(n)]
        for page in pages:
            self.ref_count[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add a reference to each page (prefix hits); ValueError, changing none, if one is free."""
        for page in pages:
            if self.ref_count[page] == 0 and (self.prefix is None
                                               or page not in self.prefix.hash_of):
                raise ValueError(f"page {page} is free, it cannot be shared")
        for page in pages:
            if self.ref_count[page] == 0:
                self.prefix.lru.pop(page, None)
            self.ref_count[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page; at zero it is cached if indexed, else free."""
        for page, times in Counter(pages).items():
            if self.ref_count[page] < times:
                raise ValueError(f"page {page} released more often than it was taken")
        for page in reversed(pages):  # later pages of a sequence are evicted first
            self.ref_count[page] -= 1
            if self.ref_count[page] == 0:
                if self.prefix is not None and page in self.prefix.hash_of:
                    self.prefix.lru[page] = None  # the newest: evicted last
                else:
                    self.free.append(page)

    # --- swap space ---------------------------------------------------------------------------
    def allocate_swap(self, n: int) -> list[int]:
        if n > len(self.swap_free):
            raise MemoryError(f"need {n} swap pages, only {len(self.swap_free)} free")
        return [self.swap_free.popleft() for _ in range(n)]

    def release_swap(self, pages: list[int]) -> None:
        self.swap_free.extend(pages)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (device page, host page) pairs' K/V of every layer to host memory."""
        pages = [device_page for device_page, _ in pairs]
        if pairs and self.stage_swaps:  # one gather on the device, one DMA to page-locked memory
            sources = self._staging(len(pairs)).copy_(self.every_layer[:, :, pages]).unbind(2)
        else:
            sources = [self.every_layer[:, :, page] for page in pages]
        # page by page: one indexed assignment of them all would go element by element
        for source, (_, host_page) in zip(sources, pairs):
            self.swap_store[:, :, host_page].copy_(source)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (host page, device page) pairs' K/V of every layer back into the pool."""
        if pairs and self.stage_swaps:  # gathered into page-locked memory, one DMA, one scatter
            host_pages, device_pages = zip(*pairs)
            pages = torch.index_select(self.swap_store, 2, torch.tensor(host_pages),
                                       out=self._staging(len(pairs)))
            self.every_layer[:, :, list(device_pages)] = \
                pages.to(self.every_layer.device, non_blocking=True)
        else:
            for host_page, device_page in pairs:
                self.every_layer[:, :, device_page].copy_(self.swap_store[:, :, host_page])

    def _staging(self, num_pages: int) -> torch.Tensor:
        """Page-locked host memory for `num_pages` pages in flight: a GPU swap's bounce buffer."""
        shape = (*self.swap_store.shape[:2], num_pages, *self.swap_store.shape[3:])
        return torch.empty(shape, dtype=self.swap_store.dtype, pin_memory=True)

    # --- prefix reuse -------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], hashes: list[bytes] | None = None) -> list[int]:
        """Cached pages of the leading full pages of `token_ids`, leaving a token to compute."""
        if self.prefix is None:
            return []
        usable = (len(token_ids) - 1) // self.page_size
        if hashes is None:
            hashes = prompt_page_hashes(token_ids[:usable * self.page_size], self.page_size)
        return self.prefix.lookup(hashes[:usable])

    def register_prompt_pages(self, token_ids: list[int], page_table: list[int],
                              num_computed: int, hashes: list[bytes] | None = None) -> None:
        """Index every full prompt page whose tokens are all computed."""
        if self.prefix is None:
            return
        full = min(num_computed, len(token_ids)) // self.page_size
        if hashes is None:
            hashes = prompt_page_hashes(token_ids[:full * self.page_size], self.page_size)
        for h, page in zip(hashes[:full], page_table):
            self.prefix.register(h, page)

    # --- checks -------------------------------------------------------------------------------
    def check(self, page_tables: list[list[int]], swapped: list[list[int]] = ()) -> None:
        """AssertionError unless ref counts, page states and host pages all balance."""
        host = [p for pages in swapped for p in pages] + list(self.swap_free)
        if sorted(host) != list(range(self.num_swap_pages)):
            raise AssertionError(f"swap pages do not balance: {len(self.swap_free)} free, "
                                 f"{len(host) - len(self.swap_free)} held of {self.num_swap_pages}")
        held = Counter(page for table in page_tables for page in table)
        # an unreferenced page is free or cached, once; a referenced one neither
        idle = Counter([*self.free, *(self.prefix.lru if self.prefix is not None else ())])
        for page, have in enumerate(self.ref_count):
            if have != held[page]:
                raise AssertionError(f"page {page}: ref count {have}, held by {held[page]} tables")
            if idle[page] != (have == 0):
                raise AssertionError(f"page {page}: ref count {have} but on the free and cached "
                                     f"lists {idle[page]} times (leaked or listed twice)")
