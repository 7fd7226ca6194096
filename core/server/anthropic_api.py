"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request is translated into a chat completion and served by the chat machinery (see
``chat_bridge``); only the shapes differ. As Anthropic does, unknown fields are a 400 and
``max_tokens`` is required. ``thinking`` is the template's thinking switch (off unless enabled,
as on Anthropic); ``budget_tokens`` is checked but not enforced while decoding.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict

from llmkit.core.engine.client import QueueFullError
from llmkit.core.server.errors import APIError
from llmkit.core.server.nullable import NullMeansDefault

# Anthropic's error types by status; statuses it does not use are mapped onto ones it does.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_STATUS = {415: 400, 422: 400}


def anthropic_error(message: str, status: int = 400) -> JSONResponse:
    status = _STATUS.get(status, status)
    body = {"type": "error", "error": {"type": _TYPES.get(status, "invalid_request_error"), "message": message}}
    return JSONResponse(status_code=status, content=body)


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


def _text_of(blocks, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    texts = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise APIError(
                f"{where}[{i}]: block type '{kind}' is not supported here (text only)", param=f"{where}[{i}]"
            )
        texts.append(b["text"])
    return "".join(texts)


def _messages(body: CountTokensRequest) -> list[dict]:
    out: list[dict] = []
    if body.system:
        out.append({"role": "system", "content": _text_of(body.system, "system")})
    if not body.messages:
        raise APIError("messages: at least one message is required", param="messages")
    called: set = set()  # tool_use ids of the message before, which tool_results must answer
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        answerable, called = called, set()
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls, reasoning = [], [], None
        for j, b in enumerate(m.content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise APIError(f"{where}[{j}]: tool_use needs an id and a name", param=f"{where}[{j}]")
                called.add(b["id"])
                calls.append(
                    {
                        "id": b["id"],
                        "type": "function",
                        "function": {"name": b["name"], "arguments": b.get("input") or {}},
                    }
                )
            elif kind == "tool_result" and m.role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise APIError(f"{where}[{j}]: tool_result needs a tool_use_id", param=f"{where}[{j}]")
                if b["tool_use_id"] not in answerable:  # Anthropic's wording
                    raise APIError(
                        f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: "
                        f"{b['tool_use_id']}. Each `tool_result` block must have a corresponding `tool_use` block "
                        "in the previous message.",
                        param=f"{where}[{j}]",
                    )
                result = _text_of(b.get("content") or "", f"{where}[{j}].content")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                reasoning = b.get("thinking") if isinstance(b.get("thinking"), str) else reasoning
            else:
                raise APIError(
                    f"{where}[{j}]: block type '{kind}' is not supported for role '{m.role}'", param=f"{where}[{j}]"
                )
        if text or calls or m.role == "assistant":
            msg: dict = {"role": m.role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = reasoning
            out.append(msg)
    return out


def _tool_choice(body: CountTokensRequest) -> tuple[Any, bool]:
    tc = body.tool_choice
    if tc is None:
        return None, True
    kind = tc.get("type")
    parallel = not tc.get("disable_parallel_tool_use", False)
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}, parallel
    raise APIError("tool_choice.type must be one of auto, any, tool (with a name), none", param="tool_choice")


def _thinking_kwargs(body: CountTokensRequest) -> dict:
    t = body.thinking
    if t is None or t.get("type") == "disabled":
        return {"enable_thinking": False}
    if t.get("type") == "adaptive":  # the model decides how long to think
        return {"enable_thinking": True}
    if t.get("type") != "enabled":
        raise APIError("thinking.type must be 'enabled', 'adaptive' or 'disabled'", param="thinking.type")
    budget = t.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise APIError("thinking.budget_tokens must be a positive integer", param="thinking.budget_tokens")
    if isinstance(body, MessagesRequest) and budget >= body.max_tokens:
        raise APIError("thinking.budget_tokens must be less than max_tokens", param="thinking.budget_tokens")
    return {"enable_thinking": True}


def to_chat(body: CountTokensRequest):
    """The chat completion request that serves this Messages request."""
    from llmkit.core.server.chat_bridge import chat_request

    choice, parallel = _tool_choice(body)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": _thinking_kwargs(body),
    }
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in body.tools
        ]
    if isinstance(body, MessagesRequest):
        if body.temperature is not None and not 0 <= body.temperature <= 1:
            raise APIError("temperature: range: 0..1", param="temperature")  # Anthropic's range and words
        chat.update(
            max_tokens=body.max_tokens,
            stop=body.stop_sequences,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
        )
    return chat_request({k: v for k, v in chat.items() if v is not None})


def anthropic_router(state) -> APIRouter:
    router = APIRouter()

    async def parse(raw: HTTPRequest, cls):
        from llmkit.core.server.body import parse_model, read_json

        body = parse_model(cls, await read_json(raw))
        cap = state.options.max_system_blocks
        if isinstance(body.system, list) and len(body.system) > cap:
            raise APIError(f"system: at most {cap} blocks (--max-system-blocks)", param="system")
        return body

    def guarded(handler):
        """Every error leaves in Anthropic's shape."""

        async def route(raw: HTTPRequest) -> Response:
            try:
                return await handler(raw)
            except APIError as exc:
                return anthropic_error(exc.message, exc.status)
            except QueueFullError as exc:
                return anthropic_error(str(exc), 429)
            except Exception as exc:
                import logging

                logging.getLogger("llmkit").exception("unhandled error on %s", raw.url.path)
                return anthropic_error(f"Internal server error: {type(exc).__name__}", 500)

        return route

    async def messages(raw: HTTPRequest) -> Response:
        from llmkit.core.server.anthropic_stream import message_object, stream_message
        from llmkit.core.server.chat_bridge import complete_chat, start_chat_stream
        from llmkit.core.server.state import new_id

        body = await parse(raw, MessagesRequest)
        chat = to_chat(body)
        mid = new_id("msg_")
        if body.stream:
            from fastapi.responses import StreamingResponse

            events = await start_chat_stream(state, chat)
            return StreamingResponse(stream_message(events, body, mid), media_type="text/event-stream")
        result = await complete_chat(state, chat, raw)
        if isinstance(result, Response):
            return result
        return JSONResponse(message_object(result, body, mid))

    async def count_tokens(raw: HTTPRequest) -> Response:
        from llmkit.core.server.chat_template import TemplateRenderError, check_template_kwargs
        from llmkit.core.server.prompt import check_prompt_size, message_chars, render_chat, tokenize_text
        from llmkit.core.server.render_pool import run_render

        chat = to_chat(await parse(raw, CountTokensRequest))
        check_prompt_size(state, message_chars(chat), "messages")  # the generation bound, before rendering
        try:
            text = await run_render(state, render_chat, state, chat, check_template_kwargs(chat.chat_template_kwargs))
        except TemplateRenderError as exc:
            raise APIError(str(exc), param="messages") from None
        return JSONResponse({"input_tokens": len(await tokenize_text(state, text, param="messages", generate=False))})

    router.add_api_route("/v1/messages", guarded(messages), methods=["POST"])
    router.add_api_route("/v1/messages/count_tokens", guarded(count_tokens), methods=["POST"])
    return router


def tool_input(arguments: str) -> dict:
    """A call's arguments as the ``input`` object (a parser's unparsable text becomes {})."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
