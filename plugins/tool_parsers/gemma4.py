"""``gemma4``: Gemma 4's tool calls, ``<|tool_call>call:NAME{key:value,...}<tool_call|>``.

The arguments are not JSON but what Gemma 4's chat template writes (its ``format_argument``):
strings between ``<|"|>`` quote tokens, taken literally (no escapes); bare keys; numbers,
``true``/``false``/``null``, ``[...]`` lists and ``{...}`` objects as in JSON. A call is committed
once its end marker arrives, its arguments converted to JSON in one fragment, so streaming and
non-streaming agree. Text that is not such a call (an unknown name, arguments that do not read)
stays content, raw.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmkit.core.parsing.call_shape import ToolCallShape
from llmkit.core.parsing.tool_parser import StreamingToolParser

CALL_BEGIN, CALL_END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_CALL = re.compile(r"\s*call:\s*([A-Za-z_][\w.\-]*)\s*(\{.*\})\s*", re.DOTALL)
_BARE = re.compile(r"[^,:{}\[\]]+")
_JSON = json.JSONDecoder()


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _value(s: str, i: int) -> tuple[Any, int]:
    """One value at ``s[i:]`` -> ``(value, index after it)``; ValueError if it does not read."""
    i = _skip(s, i)
    if s.startswith(QUOTE, i):
        end = s.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise ValueError("unclosed string")
        return s[i + len(QUOTE) : end], end + len(QUOTE)
    if i >= len(s):
        raise ValueError("missing value")
    c = s[i]
    if c == '"':
        return _JSON.raw_decode(s, i)
    if c in "{[":
        close, out = ("}", {}) if c == "{" else ("]", [])
        i = _skip(s, i + 1)
        if s.startswith(close, i):
            return out, i + 1
        while True:
            if close == "}":
                key, i = _key(s, i)
                i = _skip(s, i)
                if not s.startswith(":", i):
                    raise ValueError("missing ':'")
                out[key], i = _value(s, i + 1)
            else:
                v, i = _value(s, i)
                out.append(v)
            i = _skip(s, i)
            if s.startswith(close, i):
                return out, i + 1
            if not s.startswith(",", i):
                raise ValueError("missing ','")
            i += 1
    m = _BARE.match(s, i)
    if m is None:
        raise ValueError("no value")
    word = m.group().strip()
    consts = {"true": True, "false": False, "null": None}
    if word in consts:
        return consts[word], m.end()
    try:
        return json.loads(word), m.end()  # a number
    except ValueError:
        return word, m.end()  # (a bare word the template would have quoted: kept as a string)


def _key(s: str, i: int) -> tuple[str, int]:
    i = _skip(s, i)
    if s.startswith(QUOTE, i) or s.startswith('"', i):
        key, i = _value(s, i)
        return str(key), i
    m = _BARE.match(s, i)
    if m is None or not m.group().strip():
        raise ValueError("missing key")
    return m.group().strip(), m.end()


def arguments_json(body: str) -> str | None:
    """The JSON text of a call's ``{...}`` arguments, or None where they do not read."""
    try:
        value, end = _value(body, 0)
    except ValueError:
        return None
    if not isinstance(value, dict) or _skip(body, end) != len(body):
        return None
    return json.dumps(value, ensure_ascii=False)


class Gemma4ToolParser(StreamingToolParser):
    """``<|tool_call>call:NAME{...}<tool_call|>``, anywhere in the reply, one or more."""

    # strict calls (xgrammar's gemma arguments: the chat template's format_argument)
    call_shape = ToolCallShape(CALL_BEGIN, CALL_BEGIN + "call:{name}", CALL_END, "gemma")

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = "text"

    def _step(self) -> bool:
        if self._state == "text":
            i, m = self._content_until((CALL_BEGIN,))
            if m is None:
                return False
            self._hold(i)
            return self._to("call")
        end = self._find(CALL_END)
        if end < 0:  # the whole call first (cut off: it stays content)
            return self._final and self._fail()
        m = _CALL.fullmatch(self._buf, self._pos, end)
        args = arguments_json(m.group(2)) if m else None
        self._pos = end + len(CALL_END)
        if args is None or not self.name_ok(m.group(1)):
            return self._fail()
        self._open_call(m.group(1))
        self._add_args(args)
        self._close_call()
        return self._to("text")
