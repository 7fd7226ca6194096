"""/flush_cache over data-parallel replicas: every live replica flushes; one refusing (busy) makes
the whole answer a refusal; a dead replica (being restarted) is skipped."""

from __future__ import annotations

import asyncio

from llmkit.core.engine.procs.dp_client import DataParallelClient


class _Replica:
    tokenizer = max_context = vocab_size = model_dir = None

    def __init__(self, ok: bool, alive: bool = True) -> None:
        self.ok, self.up, self.flushed = ok, alive, 0

    def alive(self) -> bool:
        return self.up

    async def flush_cache(self) -> bool:
        self.flushed += 1
        return self.ok


def test_flush_reaches_every_live_replica():
    reps = [_Replica(True), _Replica(True), _Replica(False, alive=False)]
    assert asyncio.run(DataParallelClient(reps, 8).flush_cache()) is True
    assert [r.flushed for r in reps] == [1, 1, 0]


def test_one_busy_replica_refuses_the_flush():
    reps = [_Replica(True), _Replica(False)]
    assert asyncio.run(DataParallelClient(reps, 8).flush_cache()) is False
    assert [r.flushed for r in reps] == [1, 1]
