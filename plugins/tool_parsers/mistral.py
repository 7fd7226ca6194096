"""``mistral``: Mistral tool calls, and ``json_array`` for constrained ``tool_choice`` output.

Mistral writes ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`` (older tokenizers) or
``[TOOL_CALLS]f[ARGS]{...}`` (v11+, one marker per call); both are read. ``json_array`` reads a
reply that is exactly a JSON array of call objects, the shape that ``required`` or named
``tool_choice`` forces with constrained decoding (``[{"name": "f", "parameters": {...}}]``).
"""

from __future__ import annotations

import re
from typing import Any

from llmkit.core.parsing.call_shape import ToolCallShape
from llmkit.core.parsing.text_scan import JsonScanner
from llmkit.core.parsing.tool_parser import StreamingToolParser
from llmkit.plugins.tool_parsers._json_call import JsonCallReader, finish_reader

TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[\w.\-]*")
_MAX_NAME = 256


class MistralToolParser(StreamingToolParser):
    """``[TOOL_CALLS]`` followed by a JSON array, or by ``name[ARGS]{json}``."""

    prefix: str | None = TAG
    # one call an array under strict tool calling (the format allows several; each still parses)
    call_shape = ToolCallShape(TAG, TAG + '[{"name": "{name}", "arguments": ', "}]")

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = "text" if self.prefix else "start"
        self._reader: JsonCallReader | None = None
        self._scanner = JsonScanner()
        self._pending = ""

    def _step(self) -> bool:
        st = self._state
        if st == "start":  # json_array: the reply must open with "["
            start = self._pos
            if not self._skip_ws():
                self._pos = start
                return self._final and self._to("plain")
            self._say(self._buf[start : self._pos])
            if self._buf[self._pos] != "[":
                return self._to("plain")
            self._hold(self._pos)
            self._pos += 1
            return self._to("item")
        if st == "plain":
            self._say(self._buf[self._pos :])
            self._pos = len(self._buf)
            return False
        if st == "text":
            i, m = self._content_until((TAG,))
            if m is None:
                return False
            self._hold(i)
            return self._to("open")
        if st == "open":
            if not self._skip_ws():
                return self._final and self._fail()
            if self._buf[self._pos] == "[":
                self._pos += 1
                return self._to("item")
            return self._to("name")
        if st == "item":
            if not self._skip_ws():
                return self._final and self._fail()
            if self._buf[self._pos] == "]":  # empty array or trailing comma: nothing to call
                self._pos += 1
                self._release()
                return self._to("after")
            self._hold(self._pos)
            self._reader = JsonCallReader(self)
            return self._to("call")
        if st == "call":
            assert self._reader is not None
            hint = finish_reader(self, self._reader, self._reader.step())
            if hint in ("call", "wait"):
                return hint == "call"
            return self._to({"done": "sep", "failed": "after"}.get(hint, "after"))
        if st == "sep":
            if not self._skip_ws():
                return self._final and self._to("after")
            c = self._buf[self._pos]
            if c in ",]":
                self._pos += 1
            return self._to("item" if c == "," else "after")
        if st == "name":
            end = _NAME.match(self._buf, self._pos).end()
            name = self._buf[self._pos : end]
            if end - self._pos > _MAX_NAME or not self.name_ok(name):
                return self._fail() if end < len(self._buf) or self._final else False
            if end == len(self._buf) and not self._final:
                return False
            start, self._pos = self._pos, end
            at = self._eat(ARGS)
            if at is None:
                self._pos = start
                return False
            if not at:
                return self._fail()
            self._pending = name
            return self._to("args0")
        if st == "args0":
            if not self._skip_ws():
                return self._final and self._fail()
            if self._buf[self._pos] != "{":
                return self._fail()
            self._open_call(self._pending)
            self._scanner = JsonScanner()
            return self._to("args")
        if st == "args":
            end = self._scanner.scan(self._buf, self._pos)
            stop = len(self._buf) if end is None else end
            self._add_args(self._buf[self._pos : stop])
            self._pos = stop
            if end is None:
                return False
            self._close_call()
            return self._to("text")
        # "after": the array is over; the rest is content
        return self._to("text" if self.prefix else "plain")

    def _fail(self) -> bool:
        self._release()
        return self._to("text" if self.prefix else "plain")


class JsonArrayToolParser(MistralToolParser):
    """A reply that is a JSON array of ``{"name", "parameters"|"arguments"}`` objects."""

    prefix = None
    call_shape = None  # no marker opens the array: its calls are forced (tool_choice), never "auto"
