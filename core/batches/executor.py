"""Runs one batch line through the same code as the HTTP endpoint, at batch priority."""

from __future__ import annotations

import json

from llmkit.core.engine.client import QueueFullError
from llmkit.core.server.errors import APIError

BATCH_PRIORITY = 1  # online requests (priority 0) are always scheduled first


def make_batch_executor(state):
    from llmkit.core.server.body import parse_model
    from llmkit.core.server.openai.chat import create_chat_completion
    from llmkit.core.server.openai.completions import create_completion
    from llmkit.core.server.openai.embeddings import EmbeddingRequest, create_embedding
    from llmkit.core.server.openai.protocol import ChatCompletionRequest, CompletionRequest

    async def embed(state, req, raw, priority):  # the embedder has no priorities: one queue, in order
        return await create_embedding(state, req)

    routes = {
        "/v1/chat/completions": (ChatCompletionRequest, create_chat_completion),
        "/v1/completions": (CompletionRequest, create_completion),
        "/v1/embeddings": (EmbeddingRequest, embed),
    }

    async def execute(endpoint: str, body: dict) -> tuple[int, dict]:
        if endpoint not in routes:
            return 400, APIError(f"unsupported endpoint {endpoint}", param="url").body()
        model_cls, handler = routes[endpoint]
        try:
            req = parse_model(model_cls, body)
            if getattr(req, "stream", False):
                raise APIError("Streaming requests are not supported in batch mode", param="stream")
            resp = await handler(state, req, None, priority=BATCH_PRIORITY)
        except APIError as exc:
            return exc.status, exc.body()
        except QueueFullError as exc:
            return 429, APIError(str(exc), status=429).body()
        if isinstance(resp, dict):  # a route that returns its body (embeddings)
            return 200, resp
        return resp.status_code, json.loads(resp.body)

    return execute
