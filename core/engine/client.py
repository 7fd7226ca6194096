"""The one interface the HTTP server uses to talk to the engine.

``InProcessEngineClient`` runs the engine on a thread of this process; another implementation
could run it in another process without the server changing.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Protocol

from llmkit.core.engine.loop import Engine, RequestOutput
from llmkit.core.engine.request import Request


class QueueFullError(Exception):
    """The engine's queue is at ``--max-queued-requests``."""


class EngineClient(Protocol):
    tokenizer: object
    max_context: int
    vocab_size: int

    def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Submit ``req`` and yield its outputs until one has ``finished``. Cancelling the
        iteration (client gone) aborts the request and frees its KV pages."""

    async def abort(self, rid: str) -> None:
        """Stop a request; its last output has finish_reason "abort"."""


class InProcessEngineClient:
    def __init__(self, engine: Engine, max_queued: int) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_context = engine.max_context
        self.vocab_size = engine.vocab_size
        self.max_queued = max_queued
        self.draining = False
        self.active = 0  # requests reserved or running (event-loop thread only)

    def check_capacity(self, n: int = 1) -> None:
        """Reserve ``n`` request slots, or raise :class:`QueueFullError`; see :meth:`release`."""
        if self.active + n > self.max_queued:
            raise QueueFullError(f"the server is at its limit of {self.max_queued} queued requests")
        self.active += n

    def release(self, n: int = 1) -> None:
        self.active -= n

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.engine.submit(req, lambda out: loop.call_soon_threadsafe(q.put_nowait, out))
        finished = False
        try:
            while True:
                out = await q.get()
                if out.finished:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.engine.abort(req.rid)

    async def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def stats(self) -> dict:
        return self.engine.stats()

    def alive(self) -> bool:
        return self.engine.is_alive()
