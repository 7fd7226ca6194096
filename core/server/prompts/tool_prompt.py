"""Tools for chat templates that cannot render them.

A template that never reads ``tools`` (SmolLM2's, many base models') used to drop the request's
tools silently, so ``tool_choice: "auto"`` could never call one. For such templates the tool list
and the call format of the server's ``--tool-call-parser`` are written into the system prompt
instead; forced calls (``"required"`` or a named function) describe the JSON array the grammar
decodes. Without a tool-call parser, ``"auto"`` has nothing to read calls with, so nothing is
injected (start-up logs a warning either way).
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger("llmkit")

# How each built-in parser expects a call to be written. A plugin parser may set a class
# attribute ``call_format`` (text shown to the model) instead; others get the generic JSON line.
CALL_FORMATS = {
    "hermes": '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    "llama3": '{"name": <function-name>, "parameters": <args-json-object>}',
    "mistral": '[TOOL_CALLS] [{"name": <function-name>, "arguments": <args-json-object>}]',
    "json_array": '[{"name": <function-name>, "parameters": <args-json-object>}]',
    "pythonic": "[function_name(argument=value, ...), ...]",
    "deepseekv3": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜><function-name>\n"
        "```json\n<args-json-object>\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    ),
    "kimi_k2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.<function-name>:0"
        "<|tool_call_argument_begin|><args-json-object><|tool_call_end|><|tool_calls_section_end|>"
    ),
    "gpt-oss": "<|start|>assistant<|channel|>commentary to=functions.<function-name> <|constrain|>json"
    "<|message|><args-json-object><|call|>",
}
GENERIC_FORMAT = '{"name": <function-name>, "arguments": <args-json-object>}'


def template_supports_tools(template) -> bool:
    """Whether the chat template reads the ``tools`` variable at all."""
    return template is not None and getattr(template, "supports_tools", True)


def warn_if_no_tool_support(template, tool_call_parser: str | None) -> None:
    """Log once, at start-up, that tools will be described in the system prompt (or ignored)."""
    if template is None or template_supports_tools(template):
        return
    if tool_call_parser:
        log.warning(
            "The chat template has no tool support: request tools are described in the system "
            "prompt in the %s call format instead.",
            tool_call_parser,
        )
    else:
        log.warning(
            "The chat template has no tool support and no --tool-call-parser is set: tool_choice "
            '"auto" cannot call tools; "required" and named tool_choice still work (the tools '
            "are then described in the system prompt)."
        )


def call_format(parser_name: str) -> str:
    if parser_name in CALL_FORMATS:
        return CALL_FORMATS[parser_name]
    try:
        from llmkit.core.plugins import registry

        fmt = getattr(registry().tool_parser(parser_name), "call_format", None)
    except Exception:  # an unloadable plugin fails elsewhere with a clear message
        fmt = None
    return fmt if isinstance(fmt, str) else GENERIC_FORMAT


def tool_system_prompt(tools: list[dict], parser_name: str) -> str:
    lines = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query. The available "
        f"functions, as JSON signatures:\n<tools>\n{lines}\n</tools>\n\nTo call a function, reply "
        f"with:\n{call_format(parser_name)}"
    )


def inject_tools(messages: list[dict], tools: list[dict], parser_name: str) -> list[dict]:
    """``messages`` with the tool description added to the system message (one is created first
    when there is none)."""
    prompt = tool_system_prompt(tools, parser_name)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
