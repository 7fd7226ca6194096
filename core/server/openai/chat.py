"""POST /v1/chat/completions: a chat run sent as one JSON object or as server-sent events."""

from __future__ import annotations

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from llmkit.core.server.openai.chat_run import start_chat
from llmkit.core.server.openai.protocol import ChatCompletionRequest
from llmkit.core.server.state import ServerState, wants_stream_usage
from llmkit.core.server.streaming import sse, sse_done, sse_response, watch_disconnect


async def create_chat_completion(
    state: ServerState,
    body: ChatCompletionRequest,
    raw: HTTPRequest | None,
    priority: int = 0,
    http: bool | None = None,
):
    run = await start_chat(state, body, raw, priority, http)
    if body.stream:
        return sse_response(run.gen, _sse(run.chunks(wants_stream_usage(state, body))))
    return await watch_disconnect(raw, _json(run.complete()))


async def _json(completion) -> JSONResponse:
    return JSONResponse(await completion)


async def _sse(chunks):
    try:
        async for chunk in chunks:
            yield sse(chunk)
    finally:
        await chunks.aclose()  # a client gone mid-stream: cancels the generation now
    yield sse_done()
