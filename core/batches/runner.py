"""Runs batches: validating -> in_progress -> finalizing -> completed, or failed / cancelled / expired.

The runner knows nothing about the engine: it calls an :data:`Executor` for each line. Each
finished line is stored as a result keyed by its index before it is counted, so after a crash
or restart (:meth:`BatchRunner.start`) a batch resumes with the lines that have no result yet and
every ``custom_id`` reaches the output exactly once. The runner is the only writer of the record
of a batch it runs: every change goes through the in-memory record of an active batch and is
persisted by one serialised writer, so a cancel can never be overwritten by a late update.

Replicas sharing one storage each run only the batches whose lease they hold
(:mod:`llmkit.core.batches.leases`): a batch created through one replica runs there, is listed,
retrieved and cancelled through any, and is taken over by another if its holder dies.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from llmkit.core.batches.leases import BatchLeases, LeaseKeeping
from llmkit.core.batches.line_execution import LineExecution
from llmkit.core.batches.lines import write_output_files
from llmkit.core.batches.storage import (
    TERMINAL_STATUSES,
    BatchRecord,
    NotFoundError,
    StorageBackend,
    check_batch_id,
    new_batch_id,
    new_file_id,
)
from llmkit.core.batches.validation import BatchValidator, BodyValidator

Executor = Callable[[str, dict], Awaitable[tuple[int, dict]]]
"""``await execute(endpoint, body) -> (status_code, json_body)``, the same body the HTTP endpoint
returns. Cancelling the awaiting task must abort the request."""

COMPLETION_WINDOWS = {"24h": 24 * 3600}
log = logging.getLogger("llmkit.batch")


class _Aborted(Exception):
    """Raised inside a validation thread when the batch is cancelled or the runner stops."""


@dataclass
class _Active:
    record: BatchRecord
    task: asyncio.Task | None = None
    exec_task: asyncio.Task | None = None
    abort: threading.Event = field(default_factory=threading.Event)
    persist_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_persist: float = 0.0
    last_log: float = 0.0
    # results being stored: a cancelled line's store runs on (shielded), and must land before the
    # batch is finalized and its results deleted, or it would be left behind in the storage
    stores: set[asyncio.Task] = field(default_factory=set)


class BatchRunner(LeaseKeeping, LineExecution):
    """Owns every running batch. Create one per app; ``await start()`` on startup, ``stop()`` on
    shutdown. ``max_in_flight`` bounds the lines of all batches handed to the engine at once."""

    def __init__(
        self,
        storage: StorageBackend,
        execute: Executor,
        *,
        max_in_flight: int = 8,
        body_validator: BodyValidator | None = None,
        persist_interval: float = 1.0,
        log_interval: float = 10.0,
        on_progress: Callable[[BatchRecord], None] | None = None,
        lease_ttl: float = 30.0,
        holder: str | None = None,
    ) -> None:
        self.storage = storage
        self.execute = execute
        self.body_validator = body_validator
        self.persist_interval = persist_interval
        self.log_interval = log_interval
        self.on_progress = on_progress
        self._slots = asyncio.Semaphore(max_in_flight)
        self._in_flight = 0  # lines handed to the executor and not yet done (for /metrics)
        self._active: dict[str, _Active] = {}
        self._ending: set[asyncio.Task] = set()  # batches taking their final status (see _finalize)
        self.leases = BatchLeases(storage, lease_ttl, holder)
        self._maintainer: asyncio.Task | None = None

    # -- lifecycle of the runner ---------------------------------------------------------------
    async def start(self) -> None:
        """Resume every unfinished batch that no live replica holds; from then on, renew the
        leases held and take over the batches whose holder stopped renewing."""
        await self._claim_orphans()
        self._ensure_maintainer()

    async def stop(self) -> None:
        """Stop all work without changing any status and give the leases up; :meth:`start`
        (here or on another replica) resumes it later."""
        if self._maintainer is not None:
            self._maintainer.cancel()
            await asyncio.gather(self._maintainer, return_exceptions=True)
            self._maintainer = None
        for a in list(self._active.values()):
            a.abort.set()
            if a.task:
                a.task.cancel()
        tasks = [a.task for a in self._active.values() if a.task]
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self._ending, return_exceptions=True)
        self._active.clear()

    def line_counts(self) -> dict:
        """Lines of running batches handed to the engine, and those still to hand over."""
        left = sum(
            a.record.request_counts["total"] - a.record.request_counts["completed"] - a.record.request_counts["failed"]
            for a in self._active.values()
            if a.record.status == "in_progress"
        )
        return {"batch_lines_in_flight": self._in_flight, "batch_lines_queued": max(0, left - self._in_flight)}

    # -- the API -------------------------------------------------------------------------------
    async def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None = None,
        owner: str | None = None,
    ) -> BatchRecord:
        """Create a batch (arguments already checked by the caller) and start it; ``owner`` is
        the owner id of the key that made it, and of its output files."""
        now = int(time.time())
        rec = BatchRecord(
            id=new_batch_id(),
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            created_at=now,
            expires_at=now + COMPLETION_WINDOWS[completion_window],
            metadata=metadata,
            pinned_input_id=new_file_id(),
            created_ns=time.time_ns(),
            owner=owner,
        )
        # Leased before it is stored, so no other replica's scan can claim it first.
        if not await self.leases.acquire(rec.id):
            raise RuntimeError(f"batch {rec.id}: a new batch's lease was taken")
        await asyncio.to_thread(self.storage.put_batch, rec)
        log.info("batch %s: created from %s for %s", rec.id, input_file_id, endpoint)
        return copy.deepcopy(self._spawn(rec).record)

    async def get(self, batch_id: str) -> BatchRecord:
        """The current batch object; :class:`NotFoundError` for unknown or malformed ids."""
        check_batch_id(batch_id)
        if (a := self._active.get(batch_id)) is not None:
            return copy.deepcopy(a.record)
        return await self._with_cancel_request(await asyncio.to_thread(self.storage.get_batch, batch_id))

    async def list(self) -> list[BatchRecord]:
        """Every batch, newest first, with live state for the running ones."""
        recs = await asyncio.to_thread(self.storage.list_batches)
        return [
            copy.deepcopy(self._active[r.id].record) if r.id in self._active else await self._with_cancel_request(r)
            for r in recs
        ]

    async def cancel(self, batch_id: str) -> BatchRecord:
        """Start cancelling; a batch that is finalizing or finished is returned unchanged. A batch
        another replica runs is cancelled by that replica, at its next lease renewal."""
        rec = await self.get(batch_id)
        if rec.status not in ("validating", "in_progress"):
            return rec
        if (a := self._active.get(batch_id)) is None:
            claimed = await self._claim(batch_id)
            if claimed is None:
                return await self._ask_holder_to_cancel(batch_id)
            if claimed.status not in ("validating", "in_progress"):  # its dead holder got further
                return copy.deepcopy(self._spawn(claimed).record)
            a = self._spawn(claimed, start=False)
        await self._start_cancel(a)
        return copy.deepcopy(a.record)

    async def wait(self, batch_id: str, poll: float = 0.05) -> BatchRecord:
        """Wait until the batch is finished (for the offline runner and tests)."""
        while True:
            a = self._active.get(batch_id)
            if a is None:
                return await self.get(batch_id)
            await asyncio.wait({a.task}) if a.task else await asyncio.sleep(poll)

    # -- internals -----------------------------------------------------------------------------
    def _spawn(self, rec: BatchRecord, start: bool = True) -> _Active:
        a = _Active(rec)
        self._active[rec.id] = a
        if start:
            a.task = asyncio.create_task(self._run(a))
        self._ensure_maintainer()
        return a

    async def _start_cancel(self, a: _Active) -> None:
        a.record.status, a.record.cancelling_at = "cancelling", int(time.time())
        await self._persist(a, force=True)
        log.info("batch %s: cancelling", a.record.id)
        a.abort.set()
        if a.exec_task:
            a.exec_task.cancel()  # cancels the lines in flight, which aborts their requests
        if a.task is None:
            a.task = asyncio.create_task(self._run(a))

    async def _persist(self, a: _Active, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - a.last_persist < self.persist_interval:
            return
        a.last_persist = now
        snapshot = copy.deepcopy(a.record)

        async def write() -> None:
            async with a.persist_lock:  # serialised, and finished even if the caller is cancelled
                if not self.leases.holds(snapshot.id):
                    return  # the lease may be another replica's by now: the batch's state is its to write
                await asyncio.to_thread(self.storage.put_batch, snapshot)

        await asyncio.shield(asyncio.create_task(write()))

    async def _transition(self, a: _Active, status: str, **fields) -> None:
        rec = a.record
        rec.status = status
        stamp = {"in_progress": "in_progress_at", "finalizing": "finalizing_at"}.get(status)
        stamp = stamp or {s: f"{s}_at" for s in TERMINAL_STATUSES}.get(status)
        if stamp:
            setattr(rec, stamp, int(time.time()))
        for k, v in fields.items():
            setattr(rec, k, v)
        await self._persist(a, force=True)
        log.info("batch %s: %s %s", rec.id, status, rec.request_counts)

    async def _run(self, a: _Active) -> None:
        rec = a.record
        try:
            if rec.status == "validating" and not await self._validate(a):
                return
            final = "cancelled" if rec.status == "cancelling" else "completed"
            if rec.status == "in_progress":
                final = await self._execute_until_done(a)
            if final == "completed" and rec.status != "finalizing":
                await self._transition(a, "finalizing")
            await self._finalize(a, final)
        except asyncio.CancelledError:
            raise  # the runner is stopping; the stored state resumes on the next start
        except Exception:
            log.exception("batch %s: internal error", rec.id)
            err = {
                "code": "internal_error",
                "message": "The batch failed inside the server.",
                "param": None,
                "line": None,
            }
            await self._transition(a, "failed", errors=[err])
        finally:
            if self._active.get(rec.id) is a:
                del self._active[rec.id]
            await self.leases.release(rec.id)

    async def _validate(self, a: _Active) -> bool:
        rec = a.record
        validator = BatchValidator(rec.endpoint, self.body_validator)

        def copy_and_validate() -> None:
            def tee():
                for chunk in self.storage.read_blob(rec.input_file_id):
                    if a.abort.is_set():
                        raise _Aborted
                    validator.feed(chunk)
                    if validator.full:
                        raise _Aborted  # no need to copy the rest of a file that failed
                    yield chunk

            self.storage.write_blob(rec.pinned_input_id, tee())

        try:
            await asyncio.to_thread(copy_and_validate)
            errors = validator.finish()
        except NotFoundError:
            errors = [
                {
                    "code": "invalid_input_file",
                    "param": "input_file_id",
                    "line": None,
                    "message": f"The input file {rec.input_file_id} no longer exists.",
                }
            ]
        except _Aborted:
            if a.abort.is_set() and rec.status != "cancelling":
                raise asyncio.CancelledError from None  # stopping
            errors = validator.errors
        if rec.status == "cancelling":
            return True  # _run finalizes as cancelled
        if errors:
            await asyncio.to_thread(self.storage.delete_blob, rec.pinned_input_id)
            await self._transition(a, "failed", errors=errors, pinned_input_id=None)
            return False
        rec.request_counts = {"total": validator.total, "completed": 0, "failed": 0}
        await self._transition(a, "in_progress", model=validator.model)
        return True

    async def _finalize(self, a: _Active, final: str) -> None:
        rec = a.record
        if rec.pending_output_file_id is None:
            rec.pending_output_file_id, rec.pending_error_file_id = new_file_id(), new_file_id()
            await self._persist(a, force=True)
        await asyncio.to_thread(write_output_files, self.storage, rec)
        if not self.leases.holds(rec.id):
            return  # taken over meanwhile: the new holder finalizes, from results kept for it
        # The final status, then the results and pinned input deleted: as one step that a stop (the
        # server shutting down) waits for. Past the final status nothing resumes the batch, so a
        # stop in between would leave its results in the storage for good.
        end = asyncio.create_task(self._end(a, final))
        self._ending.add(end)
        end.add_done_callback(self._ending.discard)
        await asyncio.shield(end)

    async def _end(self, a: _Active, final: str) -> None:
        await self._transition(a, final)
        await asyncio.to_thread(self._cleanup, a.record)
        a.record.pinned_input_id = None
        await self._persist(a, force=True)

    def _cleanup(self, rec: BatchRecord) -> None:
        self.storage.delete_results(rec.id)
        if rec.pinned_input_id:
            self.storage.delete_blob(rec.pinned_input_id)
        self.leases.forget_cancel(rec.id)
