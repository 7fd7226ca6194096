"""Server-sent events, and aborting non-streaming requests whose client went away."""

from __future__ import annotations

import asyncio
import json
import weakref

from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse

# How often a non-streaming request checks that its client is still there: a gone client's
# engine slot and KV pages are freed within about this long (the check is a non-blocking read).
DISCONNECT_POLL_S = 0.05


def continuous_usage(body) -> bool:
    """``stream_options.continuous_usage_stats``: every chunk carries the usage so far (vLLM)."""
    return bool(body.stream_options and body.stream_options.continuous_usage_stats)


def check_stream_options(body) -> None:
    """``stream_options`` only applies to streams; OpenAI and vLLM refuse it otherwise."""
    from llmkit.core.server.errors import APIError

    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options can only be set when stream is true", param="stream_options")


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
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
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
