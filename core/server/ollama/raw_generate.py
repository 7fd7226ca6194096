"""``/api/generate`` with ``raw: true``: the prompt as given, no template, served as a completion
by the OpenAI completions route's code. Its reply is whole even when streamed (one text line, then
the final one): a raw prompt is rare enough not to warrant a second streaming path."""

from __future__ import annotations

import json

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
        **sampling_fields(body.options),
    }
    request = parse_model(CompletionRequest, {k: v for k, v in fields.items() if v is not None or k == "max_tokens"})
    reply = Reply(body.model, chat=False)
    resp = await create_completion(state, request, raw)
    if resp.status_code != 200:  # the client went away (499)
        return resp
    data = json.loads(resp.body)
    choice = data["choices"][0]
    result = ChatResult(content=choice["text"], finish_reason=choice["finish_reason"], usage=data["usage"])
    if not body.stream:
        return JSONResponse(reply.final(result, result.content))

    async def lines():
        yield _line(reply.piece(result.content))
        yield _line(reply.final(result))

    return StreamingResponse(lines(), media_type="application/x-ndjson")
