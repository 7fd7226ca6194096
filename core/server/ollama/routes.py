"""Ollama's generating and embedding routes: ``/api/chat``, ``/api/generate``, ``/api/embed`` and
the old ``/api/embeddings``. Each request is translated (:mod:`.translate`) into the request the
OpenAI routes serve and run by the same code; only the shapes differ, and every error leaves in
Ollama's shape, ``{"error": "..."}``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmkit.core.server.errors import APIError
from llmkit.core.server.model_names import shown
from llmkit.core.server.ollama.edge import guarded, parse, served_name
from llmkit.core.server.ollama.protocol import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
)
from llmkit.core.server.ollama.replies import Reply, now_iso

NDJSON = "application/x-ndjson"


def _loaded(model: str, reason: str, chat: bool) -> dict:
    """Ollama's answer to a request with nothing to generate: it loads (or unloads) the model."""
    obj = {"model": model, "created_at": now_iso()}
    obj.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return {**obj, "done": True, "done_reason": reason}


def _keep_alive_zero(value) -> bool:
    return value in (0, "0", "0s", "0m")


def ollama_router(state) -> APIRouter:
    router = APIRouter()

    def check_generative(name: str) -> None:
        if state.embedder is not None:
            raise APIError(f'"{shown(name)}" does not support generate or chat (it is an embedding model)')

    async def run(body, chat_body, raw: HTTPRequest, chat: bool) -> Response:
        from llmkit.core.server.openai.chat_events import start_chat_stream
        from llmkit.core.server.streaming import watch_disconnect

        reply = Reply(body.model, chat)
        events = await start_chat_stream(state, chat_body)  # a bad request fails here, before any byte
        if body.stream:
            return StreamingResponse(reply.lines(events), media_type=NDJSON)
        result = await watch_disconnect(raw, reply.whole(events))
        return result if isinstance(result, Response) else JSONResponse(result)

    async def chat(raw: HTTPRequest) -> Response:
        from llmkit.core.server.ollama.translate import chat_of_chat

        body = await parse(raw, OllamaChatRequest)
        name = served_name(state, body.model)
        check_generative(body.model)
        if not body.messages:
            return JSONResponse(_loaded(body.model, "unload" if _keep_alive_zero(body.keep_alive) else "load", True))
        return await run(body, chat_of_chat(body.model_copy(update={"model": name})), raw, chat=True)

    async def generate(raw: HTTPRequest) -> Response:
        from llmkit.core.server.ollama.translate import chat_of_generate

        body = await parse(raw, OllamaGenerateRequest)
        name = served_name(state, body.model)
        check_generative(body.model)
        if not body.prompt and not body.images:
            return JSONResponse(_loaded(body.model, "unload" if _keep_alive_zero(body.keep_alive) else "load", False))
        if body.raw:
            from llmkit.core.server.ollama.raw_generate import raw_generate

            return await raw_generate(state, body, name, raw)
        return await run(body, chat_of_generate(body.model_copy(update={"model": name})), raw, chat=False)

    async def embed(raw: HTTPRequest) -> Response:
        import time

        from llmkit.core.server.body import parse_model
        from llmkit.core.server.openai.embeddings import EmbeddingRequest, create_embedding

        start = time.perf_counter_ns()
        body = await parse(raw, OllamaEmbedRequest)
        name = served_name(state, body.model)
        inputs = [body.input] if isinstance(body.input, str) else body.input
        request = {"model": name, "input": inputs, "dimensions": body.dimensions}
        if body.truncate:  # Ollama's default: cut each input to the model's context
            request["truncate_prompt_tokens"] = -1
        request = parse_model(EmbeddingRequest, {k: v for k, v in request.items() if v is not None})
        out = await create_embedding(state, request, True)
        return JSONResponse(
            {
                "model": body.model,
                "embeddings": [d["embedding"] for d in out["data"]],
                "total_duration": time.perf_counter_ns() - start,
                "load_duration": 0,
                "prompt_eval_count": out["usage"]["prompt_tokens"],
            }
        )

    async def embeddings(raw: HTTPRequest) -> Response:
        from llmkit.core.server.body import parse_model
        from llmkit.core.server.openai.embeddings import EmbeddingRequest, create_embedding

        body = await parse(raw, OllamaEmbeddingsRequest)
        name = served_name(state, body.model)
        if not body.prompt:  # Ollama answers an empty prompt with an empty vector
            return JSONResponse({"embedding": []})
        request = parse_model(EmbeddingRequest, {"model": name, "input": [body.prompt]})
        out = await create_embedding(state, request, True)
        return JSONResponse({"embedding": out["data"][0]["embedding"]})

    router.add_api_route("/api/chat", guarded(chat), methods=["POST"])
    router.add_api_route("/api/generate", guarded(generate), methods=["POST"])
    router.add_api_route("/api/embed", guarded(embed), methods=["POST"])
    router.add_api_route("/api/embeddings", guarded(embeddings), methods=["POST"])
    from llmkit.core.server.ollama.catalogue import catalogue_routes

    catalogue_routes(router, state)
    return router
