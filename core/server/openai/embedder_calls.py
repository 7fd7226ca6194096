"""What /v1/embeddings, /v1/rerank and /v1/score share around a call to the embedder: the bound on
the inputs held at once (``--max-queued-embedding-inputs``), and the caller's tokens per minute.

The bound is kept here, on the event loop, as ``--max-queued-requests`` is kept for generation
(:class:`~llmkit.core.engine.client.QueueSlots`): an HTTP request's inputs are held from its
admission until its answer, or until its client goes away (the route is cancelled, which cancels
the embedder's future: the worker drops the inputs not embedded yet). Batch lines are not held to
it: ``--batch-max-in-flight`` bounds them, and a batch line refused with a 429 would fail.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Callable

from llmkit.core.engine.client import QueueFullError
from llmkit.core.server.access.rate_limits import current_limiter
from llmkit.core.server.errors import APIError


async def call_embedder(state, ids: list[list[int]], submit: Callable[[], Future], *, http: bool, param: str) -> list:
    """``submit()``'s result (the embedder's future for ``ids``). For an HTTP request: a 400 when
    ``ids`` alone is over the bound, a 429 (``QueueFullError``) while the inputs held would go
    over it; the tokens embedded are charged to the caller's tokens per minute, all of them once
    answered, those embedded so far when the request is cut short."""
    if not http:
        return await asyncio.wrap_future(submit())
    n, cap = len(ids), state.options.max_queued_embedding_inputs
    if n > cap:  # never fits, however long the client waits: a 400 saying why, not a 429 forever
        raise APIError(
            f"this request has {n} inputs but the server holds at most {cap} at once "
            "(--max-queued-embedding-inputs); split it up",
            param=param,
            code="request_too_large",
        )
    if state.queued_inputs + n > cap:
        if state.metrics is not None:
            state.metrics.on_rejected()
        raise QueueFullError(
            f"the server is at its limit of {cap} queued embedding inputs (--max-queued-embedding-inputs); "
            "retry shortly"
        )
    state.queued_inputs += n
    future = submit()
    tokens = 0
    try:
        result = await asyncio.wrap_future(future)
        tokens = sum(map(len, ids))
        return result
    finally:
        state.queued_inputs -= n
        limiter = current_limiter.get()
        if limiter is not None:
            limiter.charge(tokens or getattr(future, "tokens", 0))
