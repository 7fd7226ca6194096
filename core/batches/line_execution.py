"""The part of :class:`~llmkit.core.batches.runner.BatchRunner` that runs a batch's lines: each
handed to the executor under the runner's in-flight bound, its result stored before it is counted
(a line with a stored result is skipped on resume), until all are done, the batch is cancelled or
its completion window passes."""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import time
from typing import Any, Callable, Iterable

from llmkit.core.batches.lines import error_line, output_line
from llmkit.core.batches.storage import BatchRecord, StorageBackend
from llmkit.core.batches.validation import iter_lines

log = logging.getLogger("llmkit.batch")


class LineExecution:
    """Mixed into the runner, whose ``_Active`` records (``a``) it works on."""

    storage: StorageBackend
    execute: Callable  # the runner's Executor
    log_interval: float
    on_progress: Callable[[BatchRecord], None] | None
    _slots: asyncio.Semaphore
    _in_flight: int

    async def _persist(self, a: Any, force: bool = False) -> None:
        raise NotImplementedError

    async def _execute_until_done(self, a: Any) -> str:
        """Run the lines until all are done, the batch is cancelled, or its window passes."""
        a.exec_task = asyncio.create_task(self._execute(a))
        try:
            remaining = max(0.0, a.record.expires_at - time.time())
            done, _ = await asyncio.wait({a.exec_task}, timeout=remaining)
        finally:
            if not a.exec_task.done():
                a.exec_task.cancel()
            await asyncio.gather(a.exec_task, return_exceptions=True)
            await asyncio.gather(*a.stores, return_exceptions=True)
        if a.record.status == "cancelling":
            return "cancelled"
        if not done:
            log.info("batch %s: completion window passed", a.record.id)
            return "expired"
        a.exec_task.result()  # re-raise an internal error
        return "completed"

    async def _execute(self, a: Any) -> None:
        rec = a.record
        finished = await asyncio.to_thread(self.storage.result_indices, rec.id)
        kinds = list(finished.values())
        rec.request_counts.update(completed=kinds.count("output"), failed=kinds.count("error"))
        in_flight: set[asyncio.Task] = set()
        try:
            async for index, raw in _aiter(iter_lines(self.storage.read_blob(rec.pinned_input_id))):
                if rec.status != "in_progress":
                    break  # cancelled before this task could be
                if index in finished:
                    continue
                await self._slots.acquire()
                task = asyncio.create_task(self._run_line(a, index, raw))
                in_flight.add(task)
                self._in_flight += 1
                task.add_done_callback(in_flight.discard)
                task.add_done_callback(lambda _t: self._slots.release())
                task.add_done_callback(self._line_done)
            await asyncio.gather(*in_flight)
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    def _line_done(self, _task) -> None:
        self._in_flight -= 1

    async def _run_line(self, a: Any, index: int, raw: bytes) -> None:
        rec = a.record
        obj = json.loads(raw)
        custom_id = obj["custom_id"]
        try:
            status, body = await self.execute(rec.endpoint, obj["body"])
            result = output_line(rec.id, index, custom_id, status, body)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one bad line must not sink the batch
            log.warning("batch %s: line %d raised %s", rec.id, index, type(exc).__name__)
            result = error_line(rec.id, index, custom_id, "server_error", "The request failed inside the server.")
        key = "completed" if result.kind == "output" else "failed"

        def landed(task: asyncio.Task) -> None:  # counted once stored, even for a line cancelled meanwhile
            a.stores.discard(task)
            if not task.cancelled() and task.exception() is None and task.result():
                rec.request_counts[key] += 1

        stored = asyncio.create_task(asyncio.to_thread(self.storage.put_result, rec.id, result))
        a.stores.add(stored)
        stored.add_done_callback(landed)
        await asyncio.shield(stored)  # (a storage error fails the line: the batch fails, as before)
        await self._persist(a)
        self._log_progress(a)
        if self.on_progress:
            self.on_progress(copy.deepcopy(rec))

    def _log_progress(self, a: Any) -> None:
        now = time.monotonic()
        if now - a.last_log >= self.log_interval:
            a.last_log = now
            c = a.record.request_counts
            log.info(
                "batch %s: %d/%d done (%d failed)", a.record.id, c["completed"] + c["failed"], c["total"], c["failed"]
            )


async def _aiter(items: Iterable, batch: int = 256):
    """Iterate a blocking iterator from worker threads, ``batch`` items per hop."""
    it = iter(items)
    while chunk := await asyncio.to_thread(lambda: list(itertools.islice(it, batch))):
        for item in chunk:
            yield item
