"""The one interface the HTTP server uses to talk to the engine.

Everything the server needs from the engine goes through :class:`EngineClient`, and everything
that crosses it is a plain message (:mod:`llmkit.core.engine.messages`) or a JSON-ready dict.
:class:`InProcessEngineClient` runs the engine on a thread of this process; another implementation
can run it in another process without the server changing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, AsyncIterator, Protocol

from llmkit.core.engine.messages import GenerateRequest, RequestOutput
from llmkit.core.grammar.contract import GrammarSpec

COMPILE_TIMEOUT_S = 5.0


class QueueFullError(Exception):
    """The engine's queue is at ``--max-queued-requests``."""


class EngineClient(Protocol):
    tokenizer: Any  # the model's tokenizer (the server tokenizes and renders templates)
    max_context: int
    vocab_size: int
    max_queued: int  # requests held at once (running plus waiting), --max-queued-requests
    draining: bool  # set by the server when it starts shutting down
    dead: str | None  # why the engine died; None while it runs or after a deliberate shutdown

    def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Submit ``req`` and yield its outputs until one has ``finished``. Cancelling the
        iteration (client gone) aborts the request and frees its KV pages."""

    async def abort(self, rid: str) -> None:
        """Stop a request; its last output has finish_reason "abort"."""

    def check_capacity(self, n: int = 1) -> None:
        """Reserve ``n`` request slots, or raise :class:`QueueFullError`; see :meth:`release`."""

    def release(self, n: int = 1) -> None:
        """Give back slots reserved by :meth:`check_capacity`."""

    async def check_grammar(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` with the engine's grammar backend (cached), or raise
        :class:`GrammarError` (a client error naming the field)."""

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as ``name`` (between steps). ValueError: refused,
        nothing loaded; NotImplementedError: this engine cannot load at run time."""

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name`` to new requests (running ones finish with it). KeyError: not loaded."""

    async def flush_cache(self) -> bool:
        """Drop the prefix cache; False (nothing dropped) while requests run or wait."""

    def alive(self) -> bool:
        """Whether the engine is running (``/health``)."""

    def degraded(self) -> str | None:
        """Why the engine serves at reduced capacity (a data-parallel replica down and being
        restarted), or None."""

    def progress_age(self) -> float:
        """Seconds since the engine last showed progress: a step ended, or its idle loop turned
        (every 0.5 s at most). Grows without bound only when a step hangs or the engine process
        is frozen, which ``/health`` reports (``alive`` cannot see it)."""

    def stats(self) -> dict:
        """JSON-ready counters (``/get_server_info``, read by ``/metrics`` at scrape time): running
        and waiting requests, KV pages and ``token_usage``, ``preemptions``, ``prefix_cache_queries``
        and ``prefix_cache_hits`` (prompt tokens), steps."""

    def shutdown(self) -> None:
        """Stop the engine after the server has drained; blocking."""


class QueueSlots:
    """The queue limit every EngineClient keeps on the server side: ``check_capacity`` and
    ``release`` as the protocol describes, and the ``draining`` flag."""

    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self.draining = False
        self.active = 0  # requests reserved or running (event-loop thread only)

    def check_capacity(self, n: int = 1) -> None:
        if self.active + n > self.max_queued:
            raise QueueFullError(f"the server is at its limit of {self.max_queued} queued requests")
        self.active += n

    def release(self, n: int = 1) -> None:
        self.active -= n


class LoopMailbox:
    """Outputs handed from the engine thread to one event loop with one wake-up per burst: a step
    emits an output per running request, and ``call_soon_threadsafe`` for each would write to the
    loop's wake-up pipe (a system call) and queue a callback each time, 100 times a step at 100
    streams, on the engine's own thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list = []
        self._lock = threading.Lock()
        self._woken = False

    def put(self, queue: asyncio.Queue, item) -> None:
        with self._lock:
            self._items.append((queue, item))
            if self._woken:
                return  # the loop has not run the drain yet: it will take this one too
            self._woken = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed (the server is gone): nobody is waiting
            pass

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._woken = False
        for queue, item in items:
            queue.put_nowait(item)


def lora_manager(engine):
    """``engine``'s LoRA manager, or a ValueError (a 400) when it serves no adapters."""
    if engine.runner.lora is None:
        raise ValueError("LoRA adapters are not served: start the server with --enable-lora or --lora-paths")
    return engine.runner.lora


class InProcessEngineClient(QueueSlots):
    def __init__(self, engine, max_queued: int) -> None:
        super().__init__(max_queued)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_context = engine.max_context
        self.vocab_size = engine.vocab_size
        self._stopped = False
        self._mailbox: LoopMailbox | None = None  # for the server's event loop

    async def check_grammar(self, spec: GrammarSpec) -> None:
        await self.engine.grammar.compile_async(spec, timeout=COMPILE_TIMEOUT_S)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        box = self._mailbox
        if box is None or box.loop is not loop:  # (a test's client may run on loops of its own)
            box = self._mailbox = LoopMailbox(loop)
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.engine.submit(req, lambda out: box.put(q, out))
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

    async def load_lora_adapter(self, name: str, path: str) -> None:
        # On the engine thread, as all of the model's torch work (see Engine.build_and_start).
        await asyncio.wrap_future(self.engine.call(lambda: lora_manager(self.engine).load(name, path)))

    async def unload_lora_adapter(self, name: str) -> None:
        await asyncio.wrap_future(self.engine.call(lambda: lora_manager(self.engine).unload(name)))

    async def flush_cache(self) -> bool:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.engine.flush_cache(lambda ok: loop.call_soon_threadsafe(fut.set_result, ok))
        return await asyncio.wait_for(fut, timeout=30)

    def stats(self) -> dict:
        return self.engine.stats()

    def alive(self) -> bool:
        return self.engine.is_alive()

    def progress_age(self) -> float:
        return time.monotonic() - self.engine.last_step

    def degraded(self) -> str | None:
        return None

    @property
    def dead(self) -> str | None:
        return None if self._stopped or self.engine.is_alive() else "the engine thread stopped"

    def shutdown(self) -> None:
        self._stopped = True
        self.engine.shutdown()
