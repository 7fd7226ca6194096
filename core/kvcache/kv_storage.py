"""The storage tier's contract: a flat, content-addressed blob store for K/V pages.

A backend keeps opaque entries under hex keys; it never interprets them. Keys are hash chains over
tokens and everything the K/V depends on (``tier_keys.py``), and each entry carries its own key
and checksum (``tier_entry.py``), so a backend may be shared by servers of different models,
adapters and tenants, and may lose, truncate or corrupt entries without a wrong answer resulting.

Backends are plugins (``llmkit_register_kv_storage``): ``file`` (``--hicache-storage-path``) and
``redis`` and ``s3`` ship with llmkit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class KVStorage(ABC):
    """A blob store the storage tier reads and writes from its own threads (never the engine's).

    Methods may raise any exception when the store is unreachable or failing: the tier logs it,
    counts a miss (or a dropped write) and leaves the store alone for a while. They must not block
    without bound: a backend over the network sets timeouts on its connections.
    """

    def __init__(self, *, path: str | None = None, **extra) -> None:
        """``path``: ``--hicache-storage-path``; ``extra``: ``--hicache-storage-backend-extra-config``
        (a JSON object); a backend refuses keys it does not know with a ``ValueError``."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The entry stored under ``key`` (64 hex digits), or None if there is none."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``; a reader never sees a partial entry where the backend can
        avoid it (a torn one is still caught by the entry's checksum)."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an entry is stored under ``key`` (cheaper than :meth:`get`: writes skip it)."""

    def close(self) -> None:
        """Release connections and files (called once, at shutdown)."""
