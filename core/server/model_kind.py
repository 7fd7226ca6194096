"""What kind of model the server serves decides which routes it answers: an embedding model
answers the generation routes with a 400 that says so (rather than failing at start or at the
engine), and a generative model answers /v1/embeddings the same way (in the route)."""

from __future__ import annotations

from llmkit.core.server.errors import shaped_error

GENERATION_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/generate",
    "/load_lora_adapter",  # adapters adapt a generative model's projections
    "/unload_lora_adapter",
)


def serves_generation_only(path: str) -> bool:
    return path == "/health_generate" or any(path == p or path.startswith(p + "/") for p in GENERATION_PATHS)


class EmbeddingOnlyMiddleware:
    """On an embedding or reranking server, a generation request gets 400 in its API's error shape."""

    def __init__(self, app, served_name: str, scores: bool = False) -> None:
        self.app = app
        self.served_name = served_name
        self.scores = scores  # a reranker: it answers /v1/rerank and /v1/score, not /v1/embeddings

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and serves_generation_only(scope["path"]):
            serves, use = (
                ("reranks", "/v1/rerank or /v1/score") if self.scores else ("serves embeddings", "/v1/embeddings")
            )
            message = (
                f"the model `{self.served_name}` {serves}; it cannot generate text: "
                f"use POST {use}, or serve a generative model for this route"
            )
            resp = shaped_error(scope["path"], message, 400, code="model_not_generative")
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


class SpeechOnlyMiddleware:
    """On a speech-to-text server (Whisper), a generation request gets 400 in its API's error shape."""

    def __init__(self, app, served_name: str) -> None:
        self.app = app
        self.served_name = served_name

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and serves_generation_only(scope["path"]):
            message = (
                f"the model `{self.served_name}` transcribes speech; it cannot generate text from a prompt: "
                "use POST /v1/audio/transcriptions or /v1/audio/translations"
            )
            resp = shaped_error(scope["path"], message, 400, code="model_not_generative")
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)
