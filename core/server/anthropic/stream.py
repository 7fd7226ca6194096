"""Anthropic Messages output: the message object, and its SSE event stream.

The stream opens a content block per kind of text as it arrives (``thinking``, ``text``, one
``tool_use`` per call) and closes it when the next begins, so the blocks the client assembles
are the ones the non-streaming answer has, in the same order.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from llmkit.core.server.anthropic.protocol import MessagesRequest, tool_input
from llmkit.core.server.openai.chat_events import ChatEvent, ChatResult


def stop_reason(result: ChatResult, body: MessagesRequest) -> tuple[str, str | None]:
    if result.finish_reason == "tool_calls":
        return "tool_use", None
    if result.finish_reason == "length":
        return "max_tokens", None
    m = result.matched_stop
    if isinstance(m, str) and m in (body.stop_sequences or ()):
        return "stop_sequence", m
    return "end_turn", None


def usage(result: ChatResult) -> dict:
    # Anthropic counts cache reads apart from input_tokens.
    return {
        "input_tokens": result.prompt_tokens - result.cached_tokens,
        "output_tokens": result.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": result.cached_tokens,
    }


def message_object(result: ChatResult, body: MessagesRequest, mid: str) -> dict:
    content: list[dict] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.content:
        content.append({"type": "text", "text": result.content})
    for c in result.tool_calls:
        content.append({"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": tool_input(c.arguments)})
    reason, seq = stop_reason(result, body)
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": body.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": usage(result),
    }


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")  # Anthropic's id style


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def stream_message(events: AsyncIterator[ChatEvent], body: MessagesRequest, mid: str):
    first = await anext(events, None)  # the prompt's size, for message_start's usage
    input_tokens = first.prompt_tokens if first is not None and first.prompt_tokens is not None else 0
    start = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": body.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }  # the final counts (cache reads apart) come in message_delta
    yield _event("message_start", {"message": start})
    yield _event("ping", {})
    index, open_kind = -1, None

    def open_block(kind: str, block: dict):
        nonlocal index, open_kind
        out = close_block()
        index, open_kind = index + 1, kind
        return out + _event("content_block_start", {"index": index, "content_block": block})

    def close_block() -> str:
        nonlocal open_kind
        if open_kind is None:
            return ""
        out = ""
        if open_kind == "thinking":  # Anthropic ends a thinking block with its signature
            out = _event("content_block_delta", {"index": index, "delta": {"type": "signature_delta", "signature": ""}})
        open_kind = None
        return out + _event("content_block_stop", {"index": index})

    async def all_events():
        if first is not None and first.prompt_tokens is None:
            yield first
        async for ev in events:
            yield ev

    try:
        async for ev in all_events():
            if ev.error is not None:
                yield close_block()
                yield _event("error", {"error": {"type": "api_error", "message": ev.error.message}})
                return
            if ev.reasoning:
                if open_kind != "thinking":
                    yield open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                yield _event(
                    "content_block_delta",
                    {"index": index, "delta": {"type": "thinking_delta", "thinking": ev.reasoning}},
                )
            elif ev.content:
                if open_kind != "text":
                    yield open_block("text", {"type": "text", "text": ""})
                yield _event(
                    "content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": ev.content}}
                )
            elif ev.tool_start is not None:
                yield open_block(
                    "tool_use",
                    {"type": "tool_use", "id": _tool_id(ev.tool_start.id), "name": ev.tool_start.name, "input": {}},
                )
            elif ev.tool_args:
                yield _event(
                    "content_block_delta",
                    {"index": index, "delta": {"type": "input_json_delta", "partial_json": ev.tool_args}},
                )
            elif ev.finished is not None:
                yield close_block()
                reason, seq = stop_reason(ev.finished, body)
                yield _event(
                    "message_delta",
                    {"delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage(ev.finished)},
                )
                yield _event("message_stop", {})
    finally:
        await events.aclose()
