"""Ollama requests as the chat completion requests that serve them, so /api/chat and
/api/generate get the OpenAI routes' checks, template, grammar and parsers, and the same text.

``options`` map onto the sampling fields (num_predict -> max_tokens, repeat_penalty ->
repetition_penalty, ...); ``format`` onto ``response_format`` (the grammar backend); ``think`` onto
the template's thinking switch; base64 ``images`` onto image content parts.
"""

from __future__ import annotations

import json
from typing import Any

from llmkit.core.server.errors import APIError
from llmkit.core.server.ollama.protocol import OllamaChatRequest, OllamaGenerateRequest, OllamaMessage

# Ollama option -> chat completion field; the value's JSON type is checked by the chat request.
_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# Read and ignored, as Ollama ignores what a runner does not use: load-time settings fixed here at
# start (num_ctx: the server's context length is --context-length), and samplers llmkit lacks.
IGNORED_OPTIONS = frozenset(
    "num_ctx num_batch num_gpu main_gpu low_vram f16_kv logits_all vocab_only use_mmap use_mlock numa "
    "embedding_only num_thread num_keep tfs_z typical_p repeat_last_n mirostat mirostat_tau mirostat_eta "
    "penalize_newline".split()
)


def sampling_fields(options: dict[str, Any] | None) -> dict[str, Any]:
    """The chat completion fields ``options`` set; an unknown option is a 400 naming it."""
    out: dict[str, Any] = {}
    for key, value in (options or {}).items():
        if value is None or key in IGNORED_OPTIONS:
            continue
        if key == "num_predict":  # -1: until the context is full, -2: fill it; both are no cap here
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                out["max_tokens"] = value
            elif value not in (-1, -2):
                raise APIError("options.num_predict must be an integer >= -2", param="options.num_predict")
        elif key in _SAMPLING:
            out[_SAMPLING[key]] = value
        else:
            raise APIError(f"options.{key} is not a known option", param=f"options.{key}")
    return out


def response_format(fmt: str | dict | None) -> dict | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise APIError("format must be 'json' or a JSON schema object", param="format")


def _thinking(think: bool | str | None) -> tuple[dict, str | None]:
    """(chat_template_kwargs, reasoning_effort) for ``think``; None leaves the template's default."""
    if think is None:
        return {}, None
    if isinstance(think, bool):
        return {"enable_thinking": think}, None
    if think in ("low", "medium", "high"):
        return {"enable_thinking": True}, think
    raise APIError("think must be true, false, 'low', 'medium' or 'high'", param="think")


_IMAGE_MAGIC = {"iVBOR": "image/png", "/9j/": "image/jpeg", "R0lGOD": "image/gif", "UklGR": "image/webp"}


def image_part(data: str) -> dict:
    """A base64 image (Ollama sends bare base64) as an image_url part with a data URL."""
    if data.startswith("data:"):
        url = data
    else:
        kind = next((t for magic, t in _IMAGE_MAGIC.items() if data.startswith(magic)), "image/png")
        url = f"data:{kind};base64,{data}"
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_calls(calls: list[dict], where: str) -> list[dict]:
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(f"{where}[{j}]: a tool call needs function.name", param=f"{where}[{j}]")
        args = fn.get("arguments") or {}
        out.append(
            {
                "id": call.get("id") or f"call_{j}_{fn['name']}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    return out


def chat_messages(messages: list[OllamaMessage]) -> list[dict]:
    """Ollama's messages as chat completion ones; a tool message answers the last call of its tool."""
    out: list[dict] = []
    calls: dict[str, str] = {}  # tool name -> id of its latest call
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.images:
            # images before the text, where Ollama puts them in the prompt
            msg["content"] = [*map(image_part, m.images), {"type": "text", "text": m.content}]
        if m.tool_calls:
            msg["tool_calls"] = _tool_calls(m.tool_calls, f"messages[{i}].tool_calls")
            calls.update({c["function"]["name"]: c["id"] for c in msg["tool_calls"]})
        if m.thinking:
            msg["reasoning_content"] = m.thinking
        if m.role == "tool":
            name = m.tool_name
            msg["tool_call_id"] = calls.get(name or "", f"call_{name or 'tool'}")
            if name:
                msg["name"] = name
        out.append(msg)
    return out


def _common(body, messages: list[dict], tools=None):
    from llmkit.core.server.openai.chat_events import chat_request

    kwargs, effort = _thinking(body.think)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "response_format": response_format(body.format),
        "chat_template_kwargs": kwargs or None,
        "reasoning_effort": effort,
        "tools": tools or None,
        "logprobs": body.logprobs or None,
        "top_logprobs": body.top_logprobs,
        **sampling_fields(body.options),
    }
    return chat_request({k: v for k, v in chat.items() if v is not None})


def chat_of_chat(body: OllamaChatRequest):
    """The chat completion request that serves an /api/chat one."""
    return _common(body, chat_messages(body.messages), body.tools)


def chat_of_generate(body: OllamaGenerateRequest):
    """The chat completion request that serves a (templated) /api/generate one: ``system`` and
    ``prompt`` as the conversation, as Ollama's template makes them."""
    if body.suffix:
        raise APIError("suffix is not supported (no fill-in-the-middle template)", param="suffix")
    if body.template:
        raise APIError("template in a request is not supported; the server's is set with --chat-template", "template")
    if body.context:
        raise APIError("context is not supported: send the conversation to /api/chat", param="context")
    messages = [{"role": "system", "content": body.system}] if body.system else []
    user: Any = body.prompt or ""
    if body.images:
        user = [*map(image_part, body.images), {"type": "text", "text": user}]
    messages.append({"role": "user", "content": user})
    return _common(body, messages)
