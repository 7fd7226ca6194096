"""Which batches this runner holds: leases taken, renewed and given up in the storage backend,
and the cancel requests that reach the holder through the storage.

Replicas sharing one storage run each batch exactly once: a runner runs a batch only while it
holds the batch's lease, renews it every third of its duration, and gives it up when the batch
finishes or the server stops. A replica that dies stops renewing; once its lease expires another
replica takes the batch over and resumes it from the stored line results. A runner writes nothing
for a batch once its lease may have expired (``holds`` is False), so a holder that stalled past
its expiry cannot overwrite the state written by the replica that took over.

A cancel asked through a replica that does not hold the batch is stored as a record
(``batch_cancel``) that only such replicas write and only the holder acts on, at its next renewal:
the holder never overwrites it, so it cannot be lost.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from typing import Any, Callable

from llmkit.core.batches.storage import NotFoundError, StorageBackend

CANCEL_KIND = "batch_cancel"
log = logging.getLogger("llmkit.batch")


class BatchLeases:
    """This runner's leases. With a backend that stores no leases (or no records) every batch
    counts as held: one server per storage, as before leases existed."""

    def __init__(self, storage: StorageBackend, ttl: float, holder: str | None = None) -> None:
        self.storage = storage
        self.ttl = ttl
        self.enabled = storage.stores_leases and storage.stores_records
        # Unique per runner, so a restarted server never mistakes its predecessor's leases for its own.
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._until: dict[str, float] = {}  # batch id -> monotonic time its lease surely lasts until

    @property
    def interval(self) -> float:
        """Seconds between renewals: a third of the lease, so two may fail before it expires."""
        return self.ttl / 3

    def holds(self, batch_id: str) -> bool:
        """Whether this runner surely still holds the lease (it may write the batch's state)."""
        return not self.enabled or time.monotonic() < self._until.get(batch_id, 0.0)

    async def acquire(self, batch_id: str) -> bool:
        """Take the lease if it is free or expired."""
        return not self.enabled or await self._call(self.storage.acquire_lease, batch_id)

    async def renew(self, batch_id: str) -> bool:
        """Extend the lease; False once it is lost (another replica holds it, or renewals kept
        failing until it expired)."""
        if not self.enabled:
            return True
        try:
            return await self._call(self.storage.renew_lease, batch_id)
        except Exception as exc:  # a storage hiccup: the next renewal may succeed in time
            log.warning("batch %s: renewing the lease failed (%s)", batch_id, type(exc).__name__)
            return self.holds(batch_id)

    async def release(self, batch_id: str) -> None:
        """Give the lease up, so another replica may take the batch at once."""
        if self.enabled and self._until.pop(batch_id, None) is not None:
            try:
                await asyncio.to_thread(self.storage.release_lease, batch_id, self.holder)
            except Exception as exc:  # it expires on its own
                log.warning("batch %s: releasing the lease failed (%s)", batch_id, type(exc).__name__)

    async def _call(self, method: Callable[[str, str, float], bool], batch_id: str) -> bool:
        start = time.monotonic()  # the stored expiry is at least this plus ttl
        ok = await asyncio.to_thread(method, batch_id, self.holder, self.ttl)
        if ok:
            self._until[batch_id] = start + self.ttl
        else:
            self._until.pop(batch_id, None)
        return ok

    # -- cancel requests ---------------------------------------------------------------------
    async def request_cancel(self, batch_id: str, at: int) -> None:
        """Ask the replica holding ``batch_id`` to cancel it."""
        await asyncio.to_thread(self.storage.put_record, CANCEL_KIND, batch_id, {"at": at})

    async def cancel_requested(self, batch_id: str) -> dict[str, Any] | None:
        """The pending cancel request of ``batch_id`` (``{"at": time}``), or None."""
        if not self.enabled:
            return None
        try:
            return await asyncio.to_thread(self.storage.get_record, CANCEL_KIND, batch_id)
        except NotFoundError:
            return None

    def forget_cancel(self, batch_id: str) -> None:
        """Delete the cancel request of a finished batch (blocking)."""
        if self.enabled:
            self.storage.delete_record(CANCEL_KIND, batch_id)
