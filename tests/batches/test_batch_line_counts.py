"""The batch runner's line counts behind ``llmkit:batch_lines_in_flight`` / ``_queued``: lines
handed to the executor are in flight (never more than ``max_in_flight``), the rest of a running
batch is queued, and both are 0 once it is done."""

from __future__ import annotations

import asyncio

from llmkit.core.batches.runner import BatchRunner
from llmkit.plugins.storage.local import LocalStorage

from batch_utils import fake_execute, jsonl, upload


def test_line_counts_follow_a_batch(tmp_path):
    storage = LocalStorage(str(tmp_path / "store"))
    gate = asyncio.Event()
    seen = []

    async def execute(endpoint, body):
        seen.append(runner.line_counts())
        await gate.wait()  # hold every line until the counts have been read
        return await fake_execute(endpoint, body)

    async def run():
        await runner.start()
        rec = await runner.create(upload(storage, jsonl(7)), "/v1/chat/completions", "24h")
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        during = runner.line_counts()
        gate.set()
        rec = await runner.wait(rec.id)
        after = runner.line_counts()
        await runner.stop()
        return rec, during, after

    runner = BatchRunner(storage, execute, max_in_flight=3)
    try:
        rec, during, after = asyncio.run(run())
    finally:
        storage.close()
    assert rec.status == "completed" and rec.request_counts["completed"] == 7
    assert during == {"batch_lines_in_flight": 3, "batch_lines_queued": 4}
    assert after == {"batch_lines_in_flight": 0, "batch_lines_queued": 0}
