"""The Responses API request, and its translation into a chat completion.

Unknown fields, unsupported tool types (web_search, file_search, computer use, MCP, ...) and
non-text inputs are a 400 naming the field: a client must never believe a feature ran that
did not.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict

from llmkit.core.server.errors import APIError
from llmkit.core.server.nullable import NullMeansDefault
from llmkit.core.server.state import new_id

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(NullMeansDefault):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = "default"
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    stream: bool = False
    include: list[str] | None = None
    top_logprobs: int | None = None
    # SGLang's extensions, which its Model Gateway adds to every request it forwards (with their
    # neutral values: top_k -1, min_p 0, repetition_penalty 1, priority 0)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int | None = None


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of content parts", param=where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(
                f"{where}[{j}]: content part type '{kind}' is not supported by this text-only model",
                param=f"{where}[{j}].type",
            )
        out.append(part["text"])
    return "".join(out)


def _parts(content: list, where: str, ptype: str) -> list[dict]:
    """Text and ``input_image`` parts, as stored (an image by its URL; a data: URL travels whole)."""
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise APIError(
                    f"{where}[{j}]: input_image needs an image_url (a data: or http(s) URL; file_id is not supported)",
                    param=f"{where}[{j}].image_url",
                )
            out.append({"type": "input_image", "image_url": part["image_url"], "detail": part.get("detail") or "auto"})
        else:
            out.append({"type": ptype, "text": _text([part], where)})
    return out


def normalize_input(body: ResponsesRequest) -> list[dict]:
    """The request's input as stored input items (each with an id), validated."""
    if isinstance(body.input, str):
        return [
            {
                "type": "message",
                "id": new_id("msg_"),
                "role": "user",
                "status": "completed",
                "content": [{"type": "input_text", "text": body.input}],
            }
        ]
    if not body.input:
        raise APIError("input cannot be empty", param="input")
    items = []
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(f"{where}.role must be user, system, developer or assistant", param=f"{where}.role")
            ptype = "output_text" if role == "assistant" else "input_text"
            content = item.get("content")
            if isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") == "input_image" for p in content
            ):
                parts = _parts(content, f"{where}.content", ptype)
            else:
                parts = [{"type": ptype, "text": _text(content, f"{where}.content")}]
            items.append(
                {
                    "type": "message",
                    "id": item.get("id") or new_id("msg_"),
                    "role": role,
                    "status": "completed",
                    "content": parts,
                }
            )
        elif kind == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(item.get(k), str):
                    raise APIError(f"{where}.{k} must be a string", param=f"{where}.{k}")
            items.append(
                {
                    "type": "function_call",
                    "id": item.get("id") or new_id("fc_"),
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": item["arguments"],
                    "status": "completed",
                }
            )
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(f"{where}.call_id must be a string", param=f"{where}.call_id")
            output = item.get("output")
            output = output if isinstance(output, str) else _text(output, f"{where}.output")
            items.append(
                {
                    "type": "function_call_output",
                    "id": item.get("id") or new_id("fco_"),
                    "call_id": item["call_id"],
                    "output": output,
                    "status": "completed",
                }
            )
        elif kind == "reasoning":
            items.append(item)  # earlier output handed back; not part of the prompt
        else:
            raise APIError(f"{where}.type '{kind}' is not supported", param=f"{where}.type")
    return items


def check_call_outputs(items: list[dict]) -> None:
    """Each function_call_output answers a function_call made before it (OpenAI's 400)."""
    calls = set()
    for it in items:
        if it["type"] == "function_call":
            calls.add(it["call_id"])
        elif it["type"] == "function_call_output" and it["call_id"] not in calls:
            raise APIError(f"No tool call found for function call output with call_id {it['call_id']}.", param="input")


def items_to_messages(items: list[dict]) -> list[dict]:
    """Input and output items to chat messages (calls join the assistant turn they belong to)."""
    msgs: list[dict] = []
    for it in items:
        kind = it["type"]
        if kind == "message":
            parts = it["content"]
            if any(p.get("type") == "input_image" for p in parts):  # as chat's content parts, in order
                content = [
                    {"type": "image_url", "image_url": {"url": p["image_url"], "detail": p.get("detail", "auto")}}
                    if p.get("type") == "input_image"
                    else {"type": "text", "text": p.get("text", "")}
                    for p in parts
                ]
                msgs.append({"role": it["role"], "content": content})
            else:
                msgs.append({"role": it["role"], "content": "".join(p.get("text", "") for p in parts)})
        elif kind == "function_call":
            call = {
                "id": it["call_id"],
                "type": "function",
                "function": {"name": it["name"], "arguments": it["arguments"]},
            }
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)
            elif msgs and msgs[-1]["role"] == "assistant":
                msgs[-1]["tool_calls"] = [call]
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
        # reasoning items are left out: templates drop earlier reasoning from the prompt
    return msgs


def _tools(body: ResponsesRequest) -> list[dict] | None:
    if not body.tools:
        return None
    out = []
    for i, t in enumerate(body.tools):
        if t.get("type") != "function":
            raise APIError(
                f"tools[{i}].type '{t.get('type')}' is not supported; only function tools are", param=f"tools[{i}].type"
            )
        unknown = set(t) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            raise APIError(f"tools[{i}]: unknown field(s) {sorted(unknown)}", param=f"tools[{i}]")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc):
    if tc is None or isinstance(tc, str):
        return tc
    if tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    raise APIError(f"tool_choice type '{tc.get('type')}' is not supported", param="tool_choice")


def _response_format(text: dict | None) -> dict | None:
    if not text:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise APIError(f"text: unknown field(s) {sorted(unknown)}", param="text")
    fmt = text.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError("text.format.schema is required for json_schema", param="text.format.schema")
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name") or "schema", "schema": fmt["schema"], "strict": fmt.get("strict")},
        }
    if fmt.get("type") == "structural_tag":  # vLLM's and SGLang's shapes, checked by the grammar
        return dict(fmt)
    raise APIError(f"text.format.type '{fmt.get('type')}' is not supported", param="text.format.type")


def to_chat_body(body: ResponsesRequest, messages: list[dict]) -> dict:
    """The chat completion body (a dict, validated by the chat bridge)."""
    unsupported = [v for v in body.include or () if v != LOGPROBS_INCLUDE]
    if unsupported:
        raise APIError(f"include values {unsupported} are not supported", param="include")
    if body.background and body.stream:
        raise APIError("background responses cannot be streamed by this server", param="background")
    if body.background and not body.store:
        raise APIError("background responses must be stored (store: true)", param="store")
    if body.text and body.text.get("verbosity") not in (None, "medium"):
        raise APIError("text.verbosity is not supported", param="text.verbosity")
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "tools": _tools(body),
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
    }
    if body.priority not in (None, 0):
        # online requests all run at one priority here (batches below them): refused, not ignored
        raise APIError("priority is not supported: every online request runs at priority 0", param="priority")
    if body.include and LOGPROBS_INCLUDE in body.include:  # as OpenAI: top_logprobs alone adds nothing
        chat.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    elif body.top_logprobs is not None:
        # checked all the same (0..20), so a request that is refused with include is refused without
        from llmkit.core.server.generation.sampling import MAX_TOP_LOGPROBS

        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
    if "model" not in body.model_fields_set:
        del chat["model"]  # left out: served by the one model (see server/model_names.py)
    effort = (body.reasoning or {}).get("effort")
    if body.reasoning and set(body.reasoning) - {"effort", "summary"}:
        raise APIError("reasoning: only effort and summary are supported", param="reasoning")
    if effort is not None:
        if effort not in ("none", "minimal", "low", "medium", "high"):
            raise APIError("reasoning.effort must be none, minimal, low, medium or high", param="reasoning.effort")
        # the template's thinking switch (enable_thinking / thinking) where the family has one
        chat["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
        chat["reasoning_effort"] = effort
    return {k: v for k, v in chat.items() if v is not None}
