"""What every Ollama route shares: the served name a request's ``model`` asks for, body parsing,
and errors in Ollama's shape, ``{"error": "..."}``."""

from __future__ import annotations

import logging

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from llmkit.core.engine.client import QueueFullError
from llmkit.core.server.errors import APIError
from llmkit.core.server.model_names import is_served, shown


def ollama_error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": message})


def served_name(state, name: str) -> str:
    """The served name (or loaded LoRA adapter) ``name`` asks for; Ollama's clients add ``:latest``
    to a name without a tag. Ollama's 404 otherwise."""
    for candidate in (name, name.removesuffix(":latest")):
        if is_served(state.options, candidate) or candidate in state.loras:
            return candidate
    if state.lora_resolver is not None:
        return name  # the resolver may load it (resolve_adapter), or answer 404
    raise APIError(f"model '{shown(name)}' not found", status=404, code="model_not_found")


def guarded(handler):
    """Every error leaves in Ollama's shape."""

    async def route(raw: HTTPRequest) -> Response:
        try:
            return await handler(raw)
        except APIError as exc:
            return ollama_error(exc.message, exc.status)
        except QueueFullError as exc:
            return ollama_error(str(exc), 429)
        except Exception as exc:
            logging.getLogger("llmkit").exception("unhandled error on %s", raw.url.path)
            return ollama_error(f"Internal server error: {type(exc).__name__}", 500)

    return route


async def parse(raw: HTTPRequest, cls):
    from llmkit.core.server.body import parse_model, read_json

    return parse_model(cls, await read_json(raw, check_type=False))
