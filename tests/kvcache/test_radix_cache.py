"""The radix prefix cache and the page allocator, on CPU without a model."""

from __future__ import annotations

import random

import pytest
import torch

from llmkit.core.kvcache.kv_pool import KVCachePool
from llmkit.core.kvcache.radix_cache import RadixCache


def _pool(pages=64, page=1):
    return KVCachePool(
        num_layers=1,
        num_pages=pages,
        page_size=page,
        num_kv_heads=1,
        head_dim=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def _store(pool, cache, tokens):
    """Allocate pages for ``tokens``, insert them, free duplicates as the scheduler does."""
    n = len(tokens) // pool.page_size
    pages = pool.allocate(n)
    slots = pool.page_slots(pages)
    already = cache.insert(tokens, slots)
    pool.free(pages[: already // pool.page_size])
    return slots


@pytest.mark.parametrize("page", [1, 4])
def test_match_insert_split(page):
    pool = _pool(page=page)
    cache = RadixCache(pool)
    a = list(range(16))
    slots_a = _store(pool, cache, a)
    got, _ = cache.match_prefix(a + [99, 100])
    assert torch.equal(got, slots_a)
    b = a[:8] + [50] * 8
    _store(pool, cache, b)
    got_b, _ = cache.match_prefix(b)
    assert torch.equal(got_b[:8], slots_a[:8]) and len(got_b) == 16
    got_a, _ = cache.match_prefix(a)
    assert torch.equal(got_a, slots_a)
    # a match never ends inside a page
    part, _ = cache.match_prefix(a[:10] + [7])
    assert len(part) % page == 0 and len(part) <= 10


def test_lock_prevents_eviction_and_accounting_is_exact():
    pool = _pool(pages=33)
    cache = RadixCache(pool)
    _store(pool, cache, list(range(16)))
    _store(pool, cache, list(range(8)) + list(range(100, 108)))
    assert cache.cached_pages == 24 and cache.evictable_pages == 24
    slots, handle = cache.match_prefix(list(range(16)))
    cache.lock(handle)
    assert cache.evictable_pages == 8
    freed = cache.evict(100)
    assert freed == 8 and pool.num_free_pages == 32 - 16
    cache.unlock(handle)
    assert cache.evict(100) == 16 and pool.num_free_pages == 32 and cache.cached_pages == 0


def test_random_workload_never_leaks_pages():
    rng = random.Random(0)
    pool = _pool(pages=257)
    cache = RadixCache(pool)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(6)]
    for _ in range(300):
        toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        slots, handle = cache.match_prefix(toks)
        cache.lock(handle)
        need = len(toks) - len(slots)
        if pool.num_free_pages < need:
            cache.evict(need - pool.num_free_pages)
        pages = pool.allocate(need)
        if pages is None:
            cache.unlock(handle)
            continue
        full = torch.cat([slots, pool.page_slots(pages)]) if pages else slots
        already = cache.insert(toks, full)
        dup = range(len(slots), already)
        pool.free([full[i].item() for i in dup])
        cache.unlock(handle)
        assert pool.num_free_pages + cache.cached_pages == 256
    cache.evict(10**6)
    assert pool.num_free_pages == 256


def test_allocator_all_or_nothing():
    pool = _pool(pages=5)
    assert pool.allocate(5) is None and pool.num_free_pages == 4
    got = pool.allocate(4)
    assert sorted(got) == [1, 2, 3, 4] and pool.allocate(1) is None
    pool.free(got)
    assert pool.num_free_pages == 4


@pytest.mark.parametrize("page", [1, 4])
def test_namespaces_share_nothing_and_evict_together(page):
    """The same tokens in two namespaces (two LoRA adapters) never match each other's K/V; each
    namespace still hits its own prefix, and eviction frees every namespace's pages."""
    pool = _pool(page=page)
    cache = RadixCache(pool)
    tokens = list(range(8))
    n = len(tokens) // page
    pages_a, pages_b = pool.allocate(n), pool.allocate(n)
    assert cache.insert(tokens, pool.page_slots(pages_a), namespace=1) == 0
    assert len(cache.match_prefix(tokens, namespace=0)[0]) == 0  # the base sees nothing
    assert len(cache.match_prefix(tokens, namespace=2)[0]) == 0  # nor does another adapter
    slots, handle = cache.match_prefix(tokens, namespace=1)
    assert slots.tolist() == pool.page_slots(pages_a).tolist()
    assert cache.insert(tokens, pool.page_slots(pages_b), namespace=2) == 0  # its own copy
    assert cache.match_prefix(tokens, namespace=2)[0].tolist() == pool.page_slots(pages_b).tolist()
    cache.lock(handle)
    assert cache.evictable_pages == n  # namespace 1's pages are locked
    cache.unlock(handle)
    free = pool.num_free_pages
    assert cache.evict(2 * n) == 2 * n
    assert pool.num_free_pages == free + 2 * n and cache.cached_pages == 0
