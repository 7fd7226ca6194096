"""The K/V pages of sliding-window layers, kept apart so that a request holds only its window.

A window layer's query at position p reads keys at positions ``> p - window`` only, so once a
request has computed ``n`` tokens no later step reads its window K/V below ``n - window + 1``.
Those layers keep their K/V in pages of their own (this allocator, with page 0 the zeroed padding
as in :class:`~llmkit.core.kvcache.kv_pool.KVCachePool`) mapped by a slot table of their own (a
:class:`~llmkit.core.kvcache.kv_pool.ReqToTokenPool` indexed by the same rows as the full
layers'). A request holds window pages from the first position its window can still reach up to
the end of the chunk in flight, and gives back every page its window has moved past. Full
layers keep every page, as before (llama.cpp's SWA cache and vLLM's sliding-window manager do
the same; ``--swa-full`` keeps full-length window K/V instead).

Pages are freed only where no step can read them again: the reach is taken from
``num_computed`` (accepted tokens: a speculative step's rejected draft never moves it), so a
rollback or a preemption never needs a page already given back. A freed page's table entries
are pointed at page 0 before the page can be handed out again: a window layer's attention may
still gather them (masked), and must read finite zeros, not a page another request is filling.
The reach is rounded down to a page boundary first, so the K/V behind a request's last whole
page is still held when it leaves and the prefix cache can resume there
(``core/kvcache/window_radix_cache.py``).

A page given back is "parked", not wiped: it counts as free and is handed out after the never
used ones, oldest first; until then its K/V is intact, and when its request leaves the prefix
cache takes it back (vLLM's freed-but-still-cached blocks). So with memory to spare every prefix a
request computed stays reusable, as with full-length K/V; under pressure the window pool fills
with the running requests' windows only.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from llmkit.core.kvcache.kv_pool import ReqToTokenPool


class WindowPages:
    """The window layers' page allocator and slot table, and each request's window pages.

    A request's own window pages sit in ``req.window_pages``, page ``i`` holding positions
    ``req.window_base + i * page_size ...``; those before ``req.window_lo`` are parked. The
    first ones hold a copy of the cached prefix's window, when a request starts after one."""

    def __init__(
        self,
        *,
        layers: list[int],
        window: int,
        num_pages: int,
        page_size: int,
        max_requests: int,
        max_context: int,
        device: torch.device,
    ) -> None:
        if num_pages < 2:
            raise ValueError("the window K/V pool needs at least 2 pages")
        self.layers = frozenset(layers)  # the K/V layers whose pages live here
        self.window = window  # the largest window of those layers: what a request must hold
        self.page = page_size
        self.num_pages = num_pages
        self.table = ReqToTokenPool(max_requests, max_context, device)  # (rows: the full table's)
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        # given back with their K/V intact, oldest first: page -> (its request's admission, index)
        self._parked: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._admissions = itertools.count(1)
        self.cache = None  # the WindowRadixCache, where prefixes are cached (set by the builder)
        self.buffers: list[torch.Tensor] = []  # the window layers' K and V buffers (set by the builder)

    # -- the allocator -------------------------------------------------------------------------
    @property
    def capacity_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free) + len(self._parked)

    @property
    def evictable_pages(self) -> int:
        return self.cache.evictable_window_pages if self.cache is not None else 0

    def available_pages(self) -> int:
        return self.num_free_pages + self.evictable_pages

    def allocate(self, n: int) -> list[int] | None:
        """``n`` pages: never used ones first, then parked ones (oldest first), then the prefix
        cache's evicted; None (and nothing taken) if there are not enough."""
        if n > self.num_free_pages and self.cache is not None:
            self.cache.evict_window(n - self.num_free_pages)
        if n > self.num_free_pages:
            return None
        if n == 0:
            return []
        take = min(n, len(self._free))
        pages = self._free[len(self._free) - take :]
        del self._free[len(self._free) - take :]
        while len(pages) < n:
            pages.append(self._parked.popitem(last=False)[0])
        return pages

    def free(self, pages) -> None:
        self._free.extend(int(p) for p in pages if p)

    def page_slots(self, pages: list[int]) -> torch.Tensor:
        base = torch.tensor(pages, dtype=torch.int64).unsqueeze(1) * self.page
        return (base + torch.arange(self.page, dtype=torch.int64)).reshape(-1)

    # -- a request's window ----------------------------------------------------------------------
    def reach(self, num_computed: int) -> int:
        """The first position a step of a request that has computed ``num_computed`` tokens can
        read (a resume from its last whole page included)."""
        return max(0, num_computed - num_computed % self.page - self.window + 1)

    def held_pages(self, req) -> int:
        """Window pages ``req`` owns now (the bound the tests check)."""
        return len(req.window_pages) - req.window_lo

    def drop_passed(self, req) -> None:
        """Give back (park) ``req``'s pages that lie wholly below its reach."""
        pages = req.window_pages
        first, page = req.window_base, self.page
        i = req.window_lo
        limit = self.reach(req.num_computed)
        while i < len(pages) and first + (i + 1) * page <= limit:
            self._parked[pages[i]] = (req.window_admission, i)
            self.table.write(req.req_pool_idx, first + i * page, [0] * page)
            i += 1
        req.window_lo = i

    def _intact(self, req, i: int) -> bool:
        """Whether ``req``'s parked page ``i`` still holds its K/V (not handed out since)."""
        return self._parked.get(req.window_pages[i]) == (req.window_admission, i)

    def need(self, req, end: int) -> int:
        """Pages ``req`` must still take to hold positions up to ``end``."""
        covered = req.window_base + len(req.window_pages) * self.page
        return max(0, -(-(end - covered) // self.page))

    def assign(self, req, end: int) -> bool:
        """Give back what ``req``'s window passed, then own window pages for positions up to
        ``end``; False (nothing taken) if pages ran out."""
        self.drop_passed(req)
        need = self.need(req, end)
        if need:
            pages = self.allocate(need)
            if pages is None:
                return False
            self._take(req, pages)
        return True

    def assign_decode(self, reqs: list) -> bool:
        """:meth:`assign` for one new token of each of ``reqs`` (a decode step), all or none:
        False, with nothing taken, if the free pages are short (freeing passed pages always
        happens: it only helps)."""
        needs = []
        for req in reqs:
            self.drop_passed(req)
            needs.append(self.need(req, req.num_computed + 1))
        if sum(needs) > self.num_free_pages:
            return False
        for req, n in zip(reqs, needs):
            if n:
                self._take(req, self.allocate(n))
        return True

    def _take(self, req, pages: list[int]) -> None:
        first = req.window_base + len(req.window_pages) * self.page
        req.window_pages.extend(pages)
        self.table.write(req.req_pool_idx, first, pages if self.page == 1 else self.page_slots(pages))

    def admit(self, req, prefix_len: int, prefix_slots: torch.Tensor | None) -> bool:
        """``req`` starts on its row after a cached prefix of ``prefix_len`` tokens whose window
        slots are ``prefix_slots`` (0 where not held). The window its first query reads is copied
        into pages of its own, so no running request reads the cache's window pages (the cache
        may give them back whenever it likes, even under a lock). False (nothing taken) if the
        pages ran out."""
        req.window_pages, req.window_lo = [], 0
        req.window_admission = next(self._admissions)
        base = max(0, prefix_len - self.window + 1)
        base = req.window_base = base - base % self.page
        if not prefix_len:
            return True
        pages = self.allocate((prefix_len - base) // self.page)  # (prefix_len is page-aligned)
        if pages is None:
            return False
        row = req.req_pool_idx
        self.table.write(row, 0, [0] * base)  # (a row's earlier user left slots there)
        self._take(req, pages)
        dst = self.table.read(row, prefix_len)[base:]
        src, dst = prefix_slots[base:prefix_len].to(self.table.table.device), dst.to(self.table.table.device)
        for buf in self.buffers:
            raw = buf.view(torch.uint8)  # (any pool dtype, fp8 included)
            raw.index_copy_(0, dst, raw.index_select(0, src))
        return True

    def cache_slots(self, req, n: int) -> torch.Tensor:
        """The window slots of ``req``'s positions ``[0, n)`` for the prefix cache: its row of the
        table, with its parked pages that are still intact put back (0 where none is held)."""
        slots = self.table.read(req.req_pool_idx, n)
        first, page = req.window_base, self.page
        for i in range(req.window_lo):
            pos = first + i * page
            if pos + page <= n and self._intact(req, i):
                slots[pos : pos + page] = self.page_slots([req.window_pages[i]])
        return slots

    def release(self, req, kept: tuple[int, int] = (0, 0)) -> None:
        """``req`` leaves: give back its window pages but those of positions ``kept`` ``[a, b)``,
        which the prefix cache took (held or parked intact: what :meth:`cache_slots` showed it)."""
        first, page = req.window_base, self.page
        a, b = kept
        for i, p in enumerate(req.window_pages):
            pos = first + i * page
            taken = a <= pos and pos + page <= b
            if i < req.window_lo:
                if taken and self._intact(req, i):
                    del self._parked[p]  # (the cache's now)
            elif not taken:
                self._free.append(p)
        req.window_pages, req.window_lo = [], 0
