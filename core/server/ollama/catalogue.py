"""Ollama's model routes over the one served model: ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version`` and ``/api/pull`` (models are not downloaded: a served name is "success", any
other a clear error)."""

from __future__ import annotations

import hashlib

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from llmkit.core.server.errors import APIError
from llmkit.core.server.model_names import shown
from llmkit.core.server.ollama.edge import guarded, parse, served_name
from llmkit.core.server.ollama.protocol import OllamaModelRequest
from llmkit.core.server.ollama.replies import now_iso

# The Ollama API version reported: clients gate features on it (tools, structured outputs and
# thinking came in 0.3, 0.5 and 0.9), and these routes take those fields.
OLLAMA_API_VERSION = "0.12.0"
NEVER = "2999-12-31T23:59:59Z"  # expires_at: the served model stays loaded


def _tagged(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


async def _details(state) -> tuple[dict, int]:
    import asyncio

    from llmkit.core.server.ollama.details import model_details

    return await asyncio.to_thread(model_details, state.options.model_source)  # once: then cached


async def _entry(state, name: str) -> dict:
    details, size = await _details(state)
    return {
        "name": _tagged(name),
        "model": _tagged(name),
        "modified_at": now_iso(),
        "size": size,
        "digest": hashlib.sha256(name.encode()).hexdigest(),
        "details": details,
    }


def capabilities(state) -> list[str]:
    if state.embedder is not None:
        return ["embedding"]
    caps = ["completion"]
    if getattr(state.chat_template, "supports_tools", False):
        caps.append("tools")
    if state.options.reasoning_parser:
        caps.append("thinking")
    if state.mm is not None:
        caps.append("vision")
    return caps


def catalogue_routes(router, state) -> None:
    def names() -> list[str]:
        return [state.options.served_model_name, *state.options.served_model_aliases]

    async def tags(raw: HTTPRequest) -> Response:
        return JSONResponse({"models": [await _entry(state, n) for n in names()]})

    async def ps(raw: HTTPRequest) -> Response:
        running = [
            {**(await _entry(state, n)), "expires_at": NEVER, "size_vram": 0, "context_length": state.max_context}
            for n in names()
        ]
        return JSONResponse({"models": running})

    async def version(raw: HTTPRequest) -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION})

    async def show(raw: HTTPRequest) -> Response:
        body = await parse(raw, OllamaModelRequest)
        name = served_name(state, body.model or body.name or "")
        template = getattr(state.chat_template, "source", "") or ""
        return JSONResponse(
            {
                "modelfile": f"FROM {name}\n",
                "parameters": "",
                "template": template,
                "details": (await _details(state))[0],
                "model_info": {"general.context_length": state.max_context, "general.vocab_size": state.vocab_size},
                "capabilities": capabilities(state),
                "modified_at": now_iso(),
            }
        )

    async def pull(raw: HTTPRequest) -> Response:
        body = await parse(raw, OllamaModelRequest)
        requested = body.model or body.name or ""
        try:
            served_name(state, requested)
        except APIError:
            raise APIError(
                f"model '{shown(requested)}' cannot be pulled: llmkit does not download models through "
                "/api/pull; start the server with --model-path (a directory, a .gguf file, or a Hugging Face id)",
                status=400,
            ) from None
        return JSONResponse({"status": "success"})  # already here, as Ollama answers for a model up to date

    router.add_api_route("/api/tags", guarded(tags), methods=["GET"])
    router.add_api_route("/api/ps", guarded(ps), methods=["GET"])
    router.add_api_route("/api/version", guarded(version), methods=["GET"])
    router.add_api_route("/api/show", guarded(show), methods=["POST"])
    router.add_api_route("/api/pull", guarded(pull), methods=["POST"])
