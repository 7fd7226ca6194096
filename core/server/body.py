"""The one reader of JSON request bodies, and request-model parsing with OpenAI-shaped errors."""

from __future__ import annotations

import json

from fastapi import Request as HTTPRequest
from pydantic import ValidationError

from llmkit.core.server.errors import APIError


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(raw: HTTPRequest, check_type: bool = True) -> dict:
    """Read and parse a JSON object body. Its size is capped while it is read by
    :class:`~llmkit.core.server.limits.BodyLimitMiddleware`, which wraps every route.
    ``check_type=False``: any content type (Ollama's routes: its documented calls are ``curl -d``,
    which sends a form's)."""
    ctype = raw.headers.get("content-type", "")
    if check_type and ctype and "json" not in ctype:
        raise APIError("Unsupported Media Type: Only 'application/json' is allowed", status=415)
    chunks = [chunk async for chunk in raw.stream()]
    data = b"".join(chunks)
    try:
        text = data.decode("utf-8")
        body = json.loads(text, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise APIError("the request body is not valid UTF-8") from None
    except RecursionError:
        raise APIError("the request body is nested too deeply") from None
    except ValueError as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


def parse_model(cls, body: dict):
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        raise APIError(f"{param}: {err.get('msg')}" if param else str(exc), param=param) from None
    except RecursionError:
        raise APIError("the request body is nested too deeply") from None
