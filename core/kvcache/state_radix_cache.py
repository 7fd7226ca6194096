"""The radix prefix cache for hybrid models: K/V pages plus state snapshots.

A recurrent state exists only at the positions where a request's computation stopped, not at every
page, so a cached prefix is reusable only up to a node whose end holds a snapshot of the state there
(:class:`~llmkit.core.kvcache.state_pool.StatePool`). The scheduler takes snapshots at a request's
prefill checkpoints, at the end of its prompt and when it leaves, and :meth:`attach` hangs each on
the node ending at its position once the request's K/V are inserted. A match resumes from the
deepest such node. A snapshot leaves with its node (least recently used first, the same eviction as
the pages'), and :meth:`evict_snapshots` evicts leaves when the snapshot slots run out.
"""

from __future__ import annotations

import torch

from llmkit.core.kvcache.kv_pool import KVCachePool
from llmkit.core.kvcache.radix_cache import RadixCache, _Node
from llmkit.core.kvcache.state_pool import StatePool


class StateRadixCache(RadixCache):
    def __init__(self, pool: KVCachePool, states: StatePool) -> None:
        super().__init__(pool)
        self.states = states

    def match_prefix(self, token_ids, namespace=0):
        path = self._walk(self._aligned(token_ids), namespace)
        deepest = max((i for i, (_, n) in enumerate(path) if n.state is not None), default=None)
        if deepest is None:
            return torch.empty(0, dtype=torch.int64), None
        return torch.cat([n.slots for _, n in path[: deepest + 1]]), path[deepest][1]

    def attach(self, token_ids, n: int, slot: int, namespace: int = 0) -> bool:
        """Hang snapshot ``slot`` (the state after ``token_ids[:n]``) on the node ending at ``n``,
        splitting an edge there if needed. False (the caller frees the slot) where the tokens are
        not cached, ``n`` is not page-aligned, or the node holds a snapshot already."""
        if n <= 0 or n % self.page:
            return False
        node, pos = self._root(namespace, create=False), 0
        while node is not None and pos < n:
            child = node.children.get(tuple(token_ids[pos : pos + self.page]))
            if child is None:
                return False
            m = self._match_len(child.key, tuple(token_ids[pos:n]))
            if m == 0:
                return False
            if m < len(child.key):
                child = self._split(child, m)
            pos += m
            node = child
        if node is None or pos != n or node.state is not None:
            return False
        node.state = slot
        return True

    def _dropped(self, node: _Node) -> None:
        if node.state is not None:
            self.states.free_snapshot(node.state)
            node.state = None

    def evict_snapshots(self, num: int) -> None:
        """Evict leaves until ``num`` snapshot slots are free (or nothing is left to evict)."""
        self._evict(lambda _: self.states.num_free_snapshots >= num)

    @property
    def cached_snapshots(self) -> int:
        return self.states.num_snapshots - self.states.num_free_snapshots
