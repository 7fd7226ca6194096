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

from llmkit.core.batches.storage import ACTIVE_STATUSES, BatchRecord, NotFoundError, StorageBackend

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
        if batch_id not in self._until:
            return False  # released (or never held): renewing would revive it
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


class LeaseKeeping:
    """The part of :class:`~llmkit.core.batches.runner.BatchRunner` that deals with other
    replicas: renewing its leases, taking over orphaned batches, cancels asked elsewhere."""

    storage: StorageBackend
    leases: BatchLeases
    _active: dict[str, Any]  # batch id -> the runner's _Active
    _maintainer: asyncio.Task | None

    def _spawn(self, rec: BatchRecord, start: bool = True) -> Any:
        raise NotImplementedError

    async def _start_cancel(self, a: Any) -> None:
        raise NotImplementedError

    def _ensure_maintainer(self) -> None:
        if self.leases.enabled and (self._maintainer is None or self._maintainer.done()):
            self._maintainer = asyncio.create_task(self._maintain())

    async def _maintain(self) -> None:
        """Renew the leases held every ``interval``; take over orphaned batches every ``ttl``."""
        last_scan = time.monotonic()
        while True:
            await asyncio.sleep(self.leases.interval)
            try:
                await self._renew_all()
                if time.monotonic() - last_scan >= self.leases.ttl:
                    last_scan = time.monotonic()
                    await self._claim_orphans()
            except Exception:  # the storage failed: the next round tries again
                log.exception("batch leases: renewal or takeover failed")

    async def _renew_all(self) -> None:
        for a in list(self._active.values()):
            batch_id = a.record.id
            if self._active.get(batch_id) is not a:
                continue  # finished meanwhile
            if not await self.leases.renew(batch_id):
                log.warning("batch %s: lease lost (another replica runs it now); stopping here", batch_id)
                a.abort.set()
                if a.task is not None:
                    a.task.cancel()  # no status is written: the batch is the new holder's
                elif self._active.get(batch_id) is a:
                    del self._active[batch_id]
            elif a.record.status in ("validating", "in_progress") and await self.leases.cancel_requested(batch_id):
                log.info("batch %s: cancel asked through another replica", batch_id)
                await self._start_cancel(a)

    async def _claim_orphans(self) -> None:
        """Claim and resume the unfinished batches whose lease is free or expired."""
        for listed in await asyncio.to_thread(self.storage.list_batches, statuses=ACTIVE_STATUSES):
            if listed.id not in self._active and (rec := await self._claim(listed.id)) is not None:
                log.info("batch %s: claimed, resuming (status %s)", rec.id, rec.status)
                self._spawn(rec)

    async def _claim(self, batch_id: str) -> BatchRecord | None:
        """Take the batch's lease and read the batch afresh (its last holder may have finished it
        since it was listed); None if another replica holds it or it has finished."""
        if not await self.leases.acquire(batch_id):
            return None
        try:
            rec = await asyncio.to_thread(self.storage.get_batch, batch_id)
        except BaseException:
            await self.leases.release(batch_id)
            raise
        if rec.status in ACTIVE_STATUSES:
            return rec
        await self.leases.release(batch_id)
        return None

    async def _ask_holder_to_cancel(self, batch_id: str) -> BatchRecord:
        rec = await asyncio.to_thread(self.storage.get_batch, batch_id)
        if rec.status not in ("validating", "in_progress"):
            return rec  # it got further since
        await self.leases.request_cancel(batch_id, int(time.time()))
        log.info("batch %s: cancel asked of the replica running it", batch_id)
        return await self._with_cancel_request(rec)

    async def _with_cancel_request(self, rec: BatchRecord) -> BatchRecord:
        """A batch another replica runs reads as cancelling once a cancel was asked, before that
        replica applies it."""
        if rec.status in ("validating", "in_progress") and (req := await self.leases.cancel_requested(rec.id)):
            rec.status, rec.cancelling_at = "cancelling", req["at"]
        return rec
