"""Run a batch file without a server (``llmkit batch run``), through the same runner.

The input is uploaded to a temporary ``local`` storage, run by a :class:`BatchRunner` exactly as
``POST /v1/batches`` would, and the output and error lines are merged into one file in input
order (the format of vLLM's ``run_batch``: each line has ``response`` or ``error``).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from llmkit.core.batches.runner import BatchRunner, Executor
from llmkit.core.batches.storage import BLOB_CHUNK, BatchRecord, FileRecord, new_file_id, open_storage
from llmkit.core.batches.validation import iter_lines, normalize_url
from llmkit.core.plugins import registry


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(BLOB_CHUNK):
            yield chunk


def detect_endpoint(path: Path) -> str:
    """The ``url`` of the first request line (default ``/v1/chat/completions``)."""
    for _, raw in iter_lines(_file_chunks(path)):
        try:
            url = json.loads(raw).get("url")
        except (ValueError, AttributeError):
            break
        return normalize_url(url) if isinstance(url, str) else "/v1/chat/completions"
    return "/v1/chat/completions"


async def run_batch_file(
    input_path: Path,
    output_path: Path,
    execute: Executor,
    *,
    endpoint: str | None = None,
    max_in_flight: int = 64,
    on_progress: Callable[[BatchRecord], None] | None = None,
) -> BatchRecord:
    """Run ``input_path`` and write every result line to ``output_path``; return the batch."""
    endpoint = endpoint or detect_endpoint(input_path)
    with tempfile.TemporaryDirectory(prefix="llmkit-batch-") as tmp:
        # A throwaway store of the default backend (local files) under the temporary directory.
        storage = open_storage(registry().default("storage"), file_storage_path=tmp)
        try:
            fid = new_file_id()
            size = await asyncio.to_thread(storage.write_blob, fid, _file_chunks(input_path))
            storage.put_file(FileRecord(fid, size, int(time.time()), input_path.name, "batch"))
            runner = BatchRunner(storage, execute, max_in_flight=max_in_flight, on_progress=on_progress)
            rec = await runner.create(fid, endpoint, "24h")
            try:
                rec = await runner.wait(rec.id)
            finally:
                await runner.stop()  # its lease renewals, before the storage closes
            # A batch that failed validation ran nothing (as POST /v1/batches): no output file, so
            # an empty one is never mistaken for a result.
            if rec.status != "failed":
                await asyncio.to_thread(_write_merged, storage, rec, input_path, output_path)
            return rec
        finally:
            storage.close()


def _write_merged(storage, rec: BatchRecord, input_path: Path, output_path: Path) -> None:
    def lines(file_id: str | None) -> Iterator[bytes]:
        if file_id is not None:
            yield from (line for _, line in iter_lines(storage.read_blob(file_id)))

    # Both files are in input order, so one pass over the input's custom_ids merges them.
    outs, errs = lines(rec.output_file_id), lines(rec.error_file_id)
    heads = {"out": next(outs, None), "err": next(errs, None)}
    tmp = output_path.with_name(output_path.name + ".tmp")
    with open(tmp, "wb") as f:
        for _, raw in iter_lines(_file_chunks(input_path)):
            try:
                cid = json.loads(raw).get("custom_id")
            except (ValueError, AttributeError):
                break  # the batch failed validation; nothing was run
            for key, it in (("out", outs), ("err", errs)):
                head = heads[key]
                if head is not None and json.loads(head)["custom_id"] == cid:
                    f.write(head + b"\n")
                    heads[key] = next(it, None)
                    break
    tmp.replace(output_path)
