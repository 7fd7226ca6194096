"""Request models of Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``, ...).

As Ollama does, unknown fields are ignored and ``options`` is a free-form map (its keys are read
by :mod:`.options`). ``stream`` defaults to true on the generating routes, as in Ollama.
"""

from __future__ import annotations

from typing import Any

from llmkit.core.server.nullable import RequestModel


class OllamaMessage(RequestModel):
    role: str
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None  # base64, without a data: prefix
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None  # a tool message: which tool answered


class _Generating(RequestModel):
    model: str
    stream: bool = True
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None  # "json", or a JSON schema
    keep_alive: float | int | str | None = None  # accepted: one model stays loaded here
    think: bool | str | None = None  # true/false, or "low" / "medium" / "high"
    logprobs: bool = False
    top_logprobs: int | None = None


class OllamaChatRequest(_Generating):
    messages: list[OllamaMessage] = []
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(_Generating):
    prompt: str | None = None
    system: str | None = None
    images: list[str] | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


class OllamaEmbedRequest(RequestModel):
    model: str
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | int | str | None = None


class OllamaEmbeddingsRequest(RequestModel):
    """The old ``/api/embeddings``: one ``prompt``, one ``embedding``."""

    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: float | int | str | None = None


class OllamaModelRequest(RequestModel):
    """``/api/show`` and ``/api/pull``: a model by name (``name`` is the older field)."""

    model: str | None = None
    name: str | None = None
