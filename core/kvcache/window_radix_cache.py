"""The radix prefix cache for models whose window layers keep only their window.

Each node holds the full layers' slots of its tokens, as in :class:`RadixCache`, and the window
layers' slots beside them (``wslots``), 0 where those pages were given back: the positions a
request's window had passed before it left, or pages evicted from the window pool on their own.
A prefix of length ``m`` is reusable only where the window K/V its next query reads, positions
``[m - window + 1, m)``, are all held; :meth:`match_prefix` returns the longest such page-aligned
prefix. This is SGLang's SWA radix cache ("tombstone" nodes whose window pages are gone), chosen
over llama.cpp's ``--swa-checkpoints`` (copies of the whole window state at a few positions)
because it needs no copy at all: a request hands its pages over as it leaves, as the full layers'
are, and the common reuse (the next turn of a conversation resumes where the last one stopped)
finds its window held there. The pages a request's window passed are parked intact until the
pool needs them (``window_pages.py``) and the cache takes them back when the request leaves, so
with memory to spare any prefix stays reusable; under pressure, a shared prefix longer than the
window is reusable only where some request stopped (``--swa-full`` keeps every one).

The full pool's eviction removes leaves with both kinds of pages; the window pool's
(:meth:`evict_window`) gives back nodes' window pages only, least recently used first, locked or
not, and keeps their full pages (the node stays, a tombstone for window layers): a request that
matched a prefix reads a copy of the window there in pages of its own, so a prefix's window pages
are never pinned by the requests that use it (SGLang pins them with a second lock instead).
"""

from __future__ import annotations

import heapq

import torch

from llmkit.core.kvcache.kv_pool import KVCachePool
from llmkit.core.kvcache.radix_cache import RadixCache, _clock, _Node
from llmkit.core.kvcache.window_pages import WindowPages


def _held(node: _Node) -> int:
    return 0 if node.wslots is None else int((node.wslots != 0).sum())


class WindowRadixCache(RadixCache):
    def __init__(self, pool: KVCachePool, windows: WindowPages) -> None:
        super().__init__(pool)
        self.windows = windows
        self._win_held = 0  # tokens whose window slots the cache holds

    # -- matching ---------------------------------------------------------------------------
    def match_prefix(self, token_ids, namespace=0):
        empty = torch.empty(0, dtype=torch.int64)
        path = self._walk(self._aligned(token_ids), namespace)
        if not path:
            return empty, None
        pos = path[-1][0] + len(path[-1][1].key)
        held = torch.cat([n.wslots for _, n in path]) != 0
        missing = [0, *torch.cumsum(~held, 0).tolist()]  # missing[i]: window slots absent in [0, i)
        usable = pos
        while usable > 0 and missing[usable] != missing[max(0, usable - self.windows.window + 1)]:
            usable -= self.page
        if usable == 0:
            return empty, None
        start, handle = next((s, n) for s, n in reversed(path) if s < usable)
        if start + len(handle.key) > usable:
            handle = self._split(handle, usable - start)
        return torch.cat([n.slots for _, n in path])[:usable], handle

    def window_slots(self, handle) -> torch.Tensor:
        """The window slots of the prefix that ``handle`` (a :meth:`match_prefix` handle) ends."""
        pieces, node = [], handle
        while node is not None and node.parent is not None:
            pieces.append(node.wslots)
            node = node.parent
        return torch.cat(pieces[::-1]) if pieces else torch.empty(0, dtype=torch.int64)

    def _split(self, child: _Node, m: int) -> _Node:
        w = child.wslots
        upper = super()._split(child, m)
        upper.wslots, child.wslots = w[:m], w[m:]
        return upper

    # -- insertion ---------------------------------------------------------------------------
    def insert(self, token_ids, slots, namespace=0, window_slots: torch.Tensor | None = None):
        """:meth:`RadixCache.insert`, the window slots beside (0 where not held): the cache owns
        the held window pages of the tokens it did not have."""
        key = self._aligned(token_ids)
        slots = slots[: len(key)]
        wslots = window_slots[: len(key)] if window_slots is not None else torch.zeros_like(slots)
        node, pos = self._root(namespace, create=True), 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + self.page])
            if child is None:
                new = _Node(node, key[pos:], slots[pos:].clone())
                new.wslots = wslots[pos:].clone()
                node.children[new.key[: self.page]] = new
                self._cached_tokens += len(new.key)
                self._evictable_tokens += len(new.key)
                self._win_held += _held(new)
                return pos
            m = self._match_len(child.key, key[pos:])
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = next(_clock)
            pos += m
            node = child
        return pos

    # -- eviction ----------------------------------------------------------------------------
    def _dropped(self, node: _Node) -> None:
        self._give_back_window(node)

    def _give_back_window(self, node: _Node) -> int:
        """Free ``node``'s window pages; return how many."""
        held = _held(node)
        if not held:
            return 0
        firsts = node.wslots[:: self.page]
        pages = (firsts[firsts != 0] // self.page).tolist()
        self.windows.free(pages)
        node.wslots = torch.zeros_like(node.wslots)
        self._win_held -= held
        return len(pages)

    def evict_window(self, num_pages: int) -> int:
        """Give back up to ``num_pages`` window pages, least recently used first; the nodes keep
        their full layers' pages. A lock does not hold them: a request that matched a prefix
        reads a copy of its window (``WindowPages.admit``)."""
        heap, stack = [], list(self._roots.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.parent is not None and _held(n):  # (locked or not: no request reads them)
                heap.append((n.last_access, id(n), n))
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            freed += self._give_back_window(heapq.heappop(heap)[2])
        return freed

    @property
    def evictable_window_pages(self) -> int:
        return self._win_held // self.page

    @property
    def cached_window_pages(self) -> int:
        return self._win_held // self.page
