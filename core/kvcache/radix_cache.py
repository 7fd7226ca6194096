"""A radix tree over token ids whose nodes own KV pages (SGLang's RadixAttention cache)."""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence

import torch

from llmkit.core.kvcache.kv_pool import KVCachePool
from llmkit.core.kvcache.prefix_cache import PrefixCache

_clock = itertools.count()


class _Node:
    __slots__ = ("children", "parent", "key", "slots", "lock_ref", "last_access", "state", "wslots")

    def __init__(self, parent: "_Node | None", key: tuple[int, ...], slots: torch.Tensor):
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.key = key  # token ids on the edge into this node; length is a multiple of page_size
        self.slots = slots  # KV slots of those tokens
        self.lock_ref = 0
        self.last_access = next(_clock)
        self.state: int | None = None  # a hybrid model's state snapshot at this node's end (its slot)
        self.wslots: torch.Tensor | None = None  # window layers' slots, 0 where given back (window_radix_cache.py)


class RadixCache(PrefixCache):
    """Children are keyed by their first page of tokens, so every split falls on a page boundary.
    Each namespace has its own root (made on first insert), so trees of different namespaces
    share no node; eviction sees the leaves of all of them."""

    def __init__(self, pool: KVCachePool) -> None:
        self.pool = pool
        self.page = pool.page_size
        self.root = _Node(None, (), torch.empty(0, dtype=torch.int64))
        self.root.lock_ref = 1  # never evicted
        self._roots = {0: self.root}
        self._cached_tokens = 0
        self._evictable_tokens = 0
        # Called with each leaf about to be evicted, its pages still intact (the storage tier's
        # write_back policy copies them out); None: nothing to do
        self.on_evict = None

    # -- matching ---------------------------------------------------------------------------
    def _aligned(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        n = len(token_ids) - len(token_ids) % self.page
        return tuple(token_ids[:n])

    def _match_len(self, a: tuple[int, ...], b: tuple[int, ...]) -> int:
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i - i % self.page

    def _root(self, namespace: int, create: bool) -> _Node | None:
        root = self._roots.get(namespace)
        if root is None and create:
            root = self._roots[namespace] = _Node(None, (), torch.empty(0, dtype=torch.int64))
            root.lock_ref = 1
        return root

    def namespace_of(self, root: _Node):
        """The namespace whose root ``root`` is (None: not a root of this cache)."""
        return next((ns for ns, r in self._roots.items() if r is root), None)

    def _walk(self, key: tuple[int, ...], namespace: int) -> list[tuple[int, _Node]]:
        """The nodes ``key`` runs through, with the position each starts at: an edge matched in
        part is split there, and every node on the path is stamped as just used."""
        node, path, pos = self._root(namespace, create=False), [], 0
        while node is not None and pos < len(key):
            child = node.children.get(key[pos : pos + self.page])
            if child is None:
                break
            m = self._match_len(child.key, key[pos:])
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = next(_clock)
            path.append((pos, child))
            pos += m
            node = child
        return path

    def match_prefix(self, token_ids, namespace=0):
        path = self._walk(self._aligned(token_ids), namespace)
        if not path:
            return torch.empty(0, dtype=torch.int64), self._root(namespace, create=False)
        return torch.cat([n.slots for _, n in path]), path[-1][1]

    def _split(self, child: _Node, m: int) -> _Node:
        """Cut ``child``'s edge after ``m`` tokens; return the new upper node."""
        upper = _Node(child.parent, child.key[:m], child.slots[:m])
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        child.parent.children[child.key[: self.page]] = upper
        child.key, child.slots, child.parent = child.key[m:], child.slots[m:], upper
        upper.children[child.key[: self.page]] = child
        return upper

    # -- insertion ---------------------------------------------------------------------------
    def insert(self, token_ids, slots, namespace=0):
        key = self._aligned(token_ids)
        slots = slots[: len(key)]
        node, pos = self._root(namespace, create=True), 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + self.page])
            if child is None:
                new = _Node(node, key[pos:], slots[pos:].clone())
                node.children[new.key[: self.page]] = new
                self._cached_tokens += len(new.key)
                self._evictable_tokens += len(new.key)
                return pos
            m = self._match_len(child.key, key[pos:])
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = next(_clock)
            pos += m
            node = child
        return pos

    # -- locking -----------------------------------------------------------------------------
    def lock(self, handle):
        node = handle
        while node is not None and node.parent is not None:  # up to its namespace's root
            if node.lock_ref == 0:
                self._evictable_tokens -= len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle):
        node = handle
        while node is not None and node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_tokens += len(node.key)
            node = node.parent

    # -- eviction ----------------------------------------------------------------------------
    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self._roots.values())
        while stack:
            n = stack.pop()
            if not n.children and n.parent is not None:
                out.append(n)
            stack.extend(n.children.values())
        return out

    def evict(self, num_pages):
        return self._evict(lambda freed: freed >= num_pages)

    def _dropped(self, node: _Node) -> None:
        """Hook: ``node`` left the tree (its pages are freed already)."""

    def _evict(self, done) -> int:
        """Evict unlocked leaves, least recently used first, until ``done(pages freed)``."""
        freed = 0
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        while not done(freed) and heap:
            _, _, node = heapq.heappop(heap)
            pages = node.slots[:: self.page] // self.page
            if self.on_evict is not None:
                self.on_evict(node)
            self.pool.free(pages.tolist())
            freed += len(pages)
            self._cached_tokens -= len(node.key)
            self._evictable_tokens -= len(node.key)
            parent = node.parent
            del parent.children[node.key[: self.page]]
            self._dropped(node)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    @property
    def evictable_pages(self):
        return self._evictable_tokens // self.page

    @property
    def cached_pages(self):
        return self._cached_tokens // self.page
