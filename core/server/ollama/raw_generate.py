"""``/api/generate`` with ``raw: true``: the prompt as given, no template (code editors' fill-in-
the-middle prompts), served as a completion by the OpenAI completions route's code. A stream is
that route's own event stream read back as it goes, each text piece an NDJSON line."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmkit.core.server.ollama.protocol import OllamaGenerateRequest
from llmkit.core.server.ollama.replies import Reply, _line
from llmkit.core.server.ollama.translate import response_format, sampling_fields
from llmkit.core.server.openai.chat_events import ChatResult


async def raw_generate(state, body: OllamaGenerateRequest, name: str, raw) -> Response:
    from llmkit.core.server.body import parse_model
    from llmkit.core.server.openai.completions import create_completion
    from llmkit.core.server.openai.protocol import CompletionRequest

    fields = {
        "model": name,
        "prompt": body.prompt or "",
        "max_tokens": None,  # Ollama's num_predict default, -1: no cap
        "response_format": response_format(body.format),
        "stream": body.stream,
        "stream_options": {"include_usage": True} if body.stream else None,
        **sampling_fields(body.options),
    }
    request = parse_model(CompletionRequest, {k: v for k, v in fields.items() if v is not None or k == "max_tokens"})
    reply = Reply(body.model, chat=False)
    resp = await create_completion(state, request, raw)  # a bad request fails here, before any byte
    if body.stream:
        return StreamingResponse(_lines(reply, resp.body_iterator), media_type="application/x-ndjson")
    if resp.status_code != 200:  # the client went away (499)
        return resp
    data = json.loads(resp.body)
    choice = data["choices"][0]
    result = ChatResult(content=choice["text"], finish_reason=choice["finish_reason"], usage=data["usage"])
    return JSONResponse(reply.final(result, result.content))


async def _lines(reply: Reply, events: AsyncIterator) -> AsyncIterator[str]:
    """The completion's server-sent events as Ollama's NDJSON lines."""
    result = ChatResult()
    try:
        async for event in events:
            text = event.decode() if isinstance(event, bytes) else event
            for data in (e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")):
                if data == "[DONE]":
                    yield _line(reply.final(result))
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    yield _line({"error": chunk["error"].get("message") or "error"})
                    return
                result.usage = chunk.get("usage") or result.usage
                for choice in chunk.get("choices") or []:
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                    if choice.get("text"):
                        if reply.first is None:  # the prompt's evaluation ended
                            reply.first = time.perf_counter_ns()
                        yield _line(reply.piece(choice["text"]))
    finally:
        await events.aclose()
