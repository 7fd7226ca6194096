"""A Messages request as the chat completion request that serves it: system and content blocks
to messages, tool_use/tool_result to tool calls, tool_choice, and ``thinking`` as the template's
thinking switch (off unless enabled, as on Anthropic) with ``budget_tokens`` as the reasoning
budget the grammar enforces (``generation/reasoning_budget.py``)."""

from __future__ import annotations

from typing import Any

from llmkit.core.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from llmkit.core.server.errors import APIError


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


def _image_url(block: dict, where: str) -> str:
    """An image block's source as the URL a chat image part carries."""
    src = block.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64" and isinstance(src.get("data"), str) and isinstance(src.get("media_type"), str):
        return f"data:{src['media_type']};base64,{src['data']}"
    if kind == "url" and isinstance(src.get("url"), str):
        return src["url"]
    raise APIError(
        f"{where}: an image block's source must be base64 (media_type, data) or a url", param=f"{where}.source"
    )


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
        text, calls, reasoning, parts = [], [], None, []
        for j, b in enumerate(m.content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
                parts.append({"type": "text", "text": b["text"]})
            elif kind == "image" and m.role == "user":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(b, f"{where}[{j}]")}})
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
        if len(parts) > len(text):  # images among the blocks: content parts keep their order
            out.append({"role": m.role, "content": parts})
        elif text or calls or m.role == "assistant":
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


def _thinking_budget(body: CountTokensRequest) -> int | None:
    t = body.thinking
    return t.get("budget_tokens") if t is not None and t.get("type") == "enabled" else None


def to_chat(body: CountTokensRequest):
    """The chat completion request that serves this Messages request."""
    from llmkit.core.server.openai.chat_events import chat_request

    choice, parallel = _tool_choice(body)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": _thinking_kwargs(body),
        "thinking_token_budget": _thinking_budget(body),  # checked by _thinking_kwargs, enforced
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
