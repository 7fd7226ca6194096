"""Prefix management, separate from KV storage.

A prefix cache maps token sequences to the KV slots that already hold them, so requests sharing a
prefix reuse pages instead of recomputing them. Matching and insertion work in whole pages.
A ``namespace`` keeps K/V that the same tokens produce differently apart (each LoRA adapter's
K/V differs from the base model's): a prefix is only ever matched within its own namespace.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch


class PrefixCache(ABC):
    """Interface of a prefix cache over a :class:`~llmkit.core.kvcache.kv_pool.KVCachePool`."""

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int], namespace: int = 0) -> tuple[torch.Tensor, Any]:
        """Return the slots of the longest cached page-aligned prefix of ``token_ids`` in
        ``namespace`` and a handle to it (pass the handle to :meth:`lock`/:meth:`unlock`)."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], slots: torch.Tensor, namespace: int = 0) -> int:
        """Cache ``token_ids`` (page-aligned length) stored at ``slots``. Returns how many leading
        tokens were cached already: the caller still owns (and must free) those slots' pages,
        which are duplicates; the cache owns the rest."""

    @abstractmethod
    def lock(self, handle: Any) -> None:
        """Protect the matched prefix from eviction while a request uses it."""

    @abstractmethod
    def unlock(self, handle: Any) -> None:
        """Release a :meth:`lock`."""

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` unlocked pages (least recently used first); return how many."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int:
        """Pages held only by the cache (freeable by :meth:`evict`)."""

    @property
    @abstractmethod
    def cached_pages(self) -> int:
        """All pages the cache holds, locked or not."""

    def reset(self) -> None:
        """Drop every unlocked entry."""
        self.evict(self.evictable_pages)


class NoPrefixCache(PrefixCache):
    """``--disable-radix-cache``: nothing is shared; every insert is declined."""

    def match_prefix(self, token_ids, namespace=0):
        return torch.empty(0, dtype=torch.int64), None

    def insert(self, token_ids, slots, namespace=0):
        return len(token_ids)  # the caller keeps (and frees) everything

    def lock(self, handle):
        pass

    def unlock(self, handle):
        pass

    def evict(self, num_pages):
        return 0

    @property
    def evictable_pages(self):
        return 0

    @property
    def cached_pages(self):
        return 0
