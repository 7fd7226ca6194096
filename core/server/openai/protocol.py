"""Request models of the OpenAI API plus SGLang's extras (top-level fields, sent by OpenAI SDK
clients through ``extra_body``). Pydantic lives only here, at the HTTP edge.

Models are strict (``"10"`` is not an int) and ignore unknown fields, as OpenAI does; a null
optional field takes its default (see ``nullable``).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field

from llmkit.core.server.nullable import RequestModel


class ContentPart(RequestModel):
    type: str
    text: str | None = None


class ToolCallFunction(RequestModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(RequestModel):
    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "tool", "function", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = False


class Tool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(RequestModel):
    model: str = "default"
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None  # SGLang: stop where a regular expression matches
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Sampling fields left out (or null) take the server's defaults: the model's generation config,
    # else the neutral values (generation/sampling_defaults.py). No request model declares its own.
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    regex: str | None = None
    ebnf: str | None = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    # vLLM's: prefixes are reused only by requests of the same salt (within the key's own space)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    thinking_token_budget: int | None = None  # vLLM's: reasoning tokens before the end marker is forced


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    json_schema: str | None = None
