"""Request models of Anthropic's Messages API. As Anthropic does, unknown fields are a 400 and
``max_tokens`` is required."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict

from llmkit.core.server.nullable import NullMeansDefault


class _Strict(NullMeansDefault):
    model_config = ConfigDict(extra="forbid", strict=True)


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    # The prefix cache reuses any shared prompt prefix anyway: a cache breakpoint changes nothing.
    cache_control: dict[str, Any] | None = None


def tool_input(arguments: str) -> dict:
    """A call's arguments as the ``input`` object (a parser's unparsable text becomes {})."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
