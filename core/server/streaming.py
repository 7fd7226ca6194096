"""Server-sent events, and aborting non-streaming requests whose client went away."""

from __future__ import annotations

import asyncio
import json

import weakref

from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"


async def watch_disconnect(raw: HTTPRequest | None, coro) -> Response:
    """Run ``coro``; if the client disconnects first, cancel it (which aborts the engine
    requests and frees their KV pages) and return a 499-style empty response. Without an HTTP
    request (batch lines) there is nothing to watch."""
    if raw is None:
        return await coro
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await raw.is_disconnected():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
            return Response(status_code=499)


def sse_response(gen, body) -> StreamingResponse:
    """Stream ``body`` (an async generator of SSE strings) for the already started ``gen``. If the
    client is gone before the body ever runs, its finally never runs either: the finalizer then
    cancels the generation, which aborts the engine requests."""
    weakref.finalize(body, gen.cancel)
    return StreamingResponse(body, media_type="text/event-stream")
