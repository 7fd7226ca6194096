"""The window layers' page allocator and the radix cache over both kinds of pages, on CPU without
a model: a request holds only the pages its window reaches, a cached prefix is matched only where
the window pages its next query reads are held, and window pages leave on their own (tombstones)
or with their node."""

from __future__ import annotations

import torch

from llmkit.core.engine.messages import SamplingParams
from llmkit.core.engine.request import Request
from llmkit.core.kvcache.kv_pool import KVCachePool
from llmkit.core.kvcache.window_pages import WindowPages
from llmkit.core.kvcache.window_radix_cache import WindowRadixCache

PAGE, WINDOW = 2, 4


def _parts(window_pages: int = 16):
    pool = KVCachePool(
        num_layers=2,
        num_pages=64,
        page_size=PAGE,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
        layer_slots=[64 * PAGE, window_pages * PAGE],
    )
    windows = WindowPages(
        layers=[1],
        window=WINDOW,
        num_pages=window_pages,
        page_size=PAGE,
        max_requests=4,
        max_context=128,
        device=torch.device("cpu"),
    )
    cache = windows.cache = WindowRadixCache(pool, windows)
    windows.buffers = [pool.k_buffers[1], pool.v_buffers[1]]  # (as the builder sets them)
    return pool, windows, cache


def _req(row: int = 0) -> Request:
    r = Request(rid="r", prompt_ids=list(range(40)), params=SamplingParams())
    r.req_pool_idx = row
    return r


def test_the_window_buffers_are_sized_apart():
    pool, windows, _ = _parts()
    assert pool.k_buffers[0].shape[0] == 64 * PAGE and pool.k_buffers[1].shape[0] == 16 * PAGE
    assert float(pool.k_buffers[1][:PAGE].abs().sum()) == 0  # page 0: zeroed padding


def test_a_request_holds_its_window_and_gives_back_the_rest():
    _, windows, _ = _parts()
    req = _req()
    assert windows.admit(req, 0, None)
    assert windows.assign(req, 12)  # a 12-token prefill chunk: 6 pages, all in flight
    assert windows.held_pages(req) == 6
    req.num_computed = 12
    for n in range(12, 40):  # decode: a page a step at most, the passed ones given back
        assert windows.assign(req, n + 1)
        req.num_computed = n + 1
        assert windows.held_pages(req) <= -(-(WINDOW + PAGE) // PAGE) + 1
    row = windows.table.read(0, 40)
    reach = windows.reach(39)
    assert (row[: reach - reach % PAGE] == 0).all()  # passed positions read the zeroed page 0
    assert (row[reach:] != 0).all()
    windows.release(req)
    assert windows.num_free_pages == windows.capacity_pages


def test_a_prefix_is_matched_only_where_its_window_is_held():
    pool, windows, cache = _parts()
    ids = list(range(100, 120))
    full = pool.page_slots(pool.allocate(10))
    win = torch.zeros(20, dtype=torch.int64)
    win[14:20] = windows.page_slots(windows.allocate(3))  # the window a leaving request still held
    assert cache.insert(ids, full, 0, win) == 0
    assert cache.cached_window_pages == 3 and cache.evictable_window_pages == 3
    # a request resuming at 20 gets a copy of the window there (positions 16..19: 2 pages)
    pool.k_buffers[1][win[16:]] = torch.arange(4.0).view(4, 1, 1)
    req = _req(1)
    assert windows.admit(req, 20, win)
    own = windows.table.read(1, 20)
    assert (own[:16] == 0).all() and not (own[16:] == win[16:]).any()
    assert torch.equal(pool.k_buffers[1][own[16:]], pool.k_buffers[1][win[16:]])
    windows.release(req)
    slots, handle = cache.match_prefix(ids)
    assert len(slots) == 20 and torch.equal(cache.window_slots(handle), win)
    # a prefix ending at 16 needs window positions 13..15: 13 was given back
    slots, handle = cache.match_prefix(ids[:17])
    assert len(slots) == 0 and handle is None
    # at most 3 positions: position 0 on, all given back
    assert cache.match_prefix(ids[:3])[1] is None


def test_window_eviction_leaves_tombstones_and_node_eviction_frees_both():
    pool, windows, cache = _parts(window_pages=5)
    ids = list(range(20))
    full = pool.page_slots(pool.allocate(10))
    win = torch.zeros(20, dtype=torch.int64)
    win[16:] = windows.page_slots(windows.allocate(2))
    cache.insert(ids, full, 0, win)
    slots, handle = cache.match_prefix(ids)
    cache.lock(handle)  # (a request that matched it reads a copy of its window: no pin)
    assert cache.evictable_window_pages == 2
    pages = windows.allocate(4)  # evicts the cache's two window pages: a tombstone
    assert pages is not None and cache.cached_window_pages == 0
    cache.unlock(handle)
    assert cache.cached_pages == 10  # the full pages stay
    assert cache.match_prefix(ids)[1] is None  # but no window: no match
    windows.free(pages)
    cache.reset()  # the node leaves: its full pages go back (its window pages went already)
    assert pool.num_free_pages == pool.capacity_pages and cache.cached_pages == 0
    assert windows.num_free_pages == windows.capacity_pages


def test_a_leaving_node_gives_back_its_window_pages_too():
    pool, windows, cache = _parts()
    ids = list(range(8))
    win = torch.zeros(8, dtype=torch.int64)
    win[4:] = windows.page_slots(windows.allocate(2))
    cache.insert(ids, pool.page_slots(pool.allocate(4)), 0, win)
    assert cache.evict(4) == 4
    assert pool.num_free_pages == pool.capacity_pages
    assert windows.num_free_pages == windows.capacity_pages and cache.cached_window_pages == 0
