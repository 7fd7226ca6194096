"""Strict tool calling for ``tool_choice: "auto"``: the structural tag that lets the model write
free text, and makes every call it opens parse and its arguments validate.

The tool parser declares its call frame (:class:`~llmkit.core.parsing.call_shape.ToolCallShape`);
each request tool becomes one tag, ``begin`` with the tool's name, the arguments under the tool's
schema in the parser's encoding, ``end``. With ``--disable-strict-tool-calls`` only the tools a
request marks ``strict: true`` get their schema (OpenAI's meaning of the flag); the others are then
held to an object, so every call still parses. ``parallel_tool_calls: false`` ends the output after
the first call.
"""

from __future__ import annotations

from typing import Any

from llmkit.core.parsing.call_shape import ToolCallShape

# JSON arguments may hold one whitespace character at a time: unbounded, a small model at
# temperature 1 pads them until max_tokens cuts the call off (and it no longer parses).
_JSON_WHITESPACE = 1


def call_shape_of(parser_name: str | None) -> ToolCallShape | None:
    """The call frame ``--tool-call-parser`` declares (None without one, or for a format without a frame)."""
    if not parser_name:
        return None
    from llmkit.core.parsing.tool_parser import tool_parser_class

    shape = getattr(tool_parser_class(parser_name), "call_shape", None)
    return shape if isinstance(shape, ToolCallShape) else None


def strict_tools_tag(body, parser_name: str | None, strict_by_default: bool) -> dict | None:
    """The ``structural_tag`` value for an "auto" request with tools, or None when nothing is to
    be constrained (no tools, a forced or "none" choice, no call frame, no strict tool)."""
    tools = getattr(body, "tools", None) or []
    if not tools or getattr(body, "tool_choice", None) not in (None, "auto"):
        return None
    shape = call_shape_of(parser_name)
    if shape is None:
        return None
    strict = [strict_by_default or t.function.strict is True for t in tools]
    if not any(strict):
        return None
    tags = [_tag(shape, t.function.name, t.function.parameters, s) for t, s in zip(tools, strict)]
    fmt = {"type": "triggered_tags", "triggers": [shape.trigger], "tags": tags}
    if getattr(body, "parallel_tool_calls", True) is False:
        fmt["stop_after_first"] = True
    return {"type": "structural_tag", "format": fmt}


def _tag(shape: ToolCallShape, name: str, parameters: Any, strict: bool) -> dict:
    schema = parameters if strict and isinstance(parameters, dict) and parameters else {"type": "object"}
    content: dict = {"type": "json_schema", "json_schema": schema, "style": shape.arguments}
    if shape.arguments == "json":
        content["max_whitespace_cnt"] = _JSON_WHITESPACE
    return {"type": "tag", "begin": shape.begin_for(name), "content": content, "end": shape.end}
