"""``llama3``: Llama 3.1/3.2/3.3 JSON tool calls.

Either ``<|python_tag|>`` followed by call objects, or a bare call object as the whole reply;
several calls are separated by ``;``. Objects use ``parameters`` (``arguments`` also accepted)
and may carry ``"type": "function"``. A bare object counts only at the very start of the output
and only if it is a call (has a known ``name``); any other JSON reply stays content.
"""

from __future__ import annotations

from typing import Any

from llmkit.core.parsing.call_shape import ToolCallShape
from llmkit.core.parsing.tool_parser import StreamingToolParser
from llmkit.plugins.tool_parsers._json_call import JsonCallReader, finish_reader

TAG = "<|python_tag|>"


class Llama3ToolParser(StreamingToolParser):
    """``<|python_tag|>{json}; {json}`` or a bare ``{json}`` reply."""

    call_shape = ToolCallShape(TAG, TAG + '{"name": "{name}", "parameters": ', "}")

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = "start"
        self._reader: JsonCallReader | None = None

    def _begin_call(self) -> None:
        self._hold(self._pos)
        self._reader = JsonCallReader(self)
        self._state = "call"

    def _step(self) -> bool:
        if self._state == "start":
            start = self._pos
            if not self._skip_ws():
                self._pos = start  # keep leading whitespace until we know what follows
                return False if not self._final else self._to("text")
            self._say(self._buf[start : self._pos])
            if self._buf[self._pos] == "{":
                self._begin_call()
                return True
            return self._to("text")
        if self._state == "text":
            i, m = self._content_until((TAG,))
            if m is None:
                return False
            self._hold(i)  # a tag followed by something other than calls stays content
            return self._to("calls")
        if self._state == "calls":  # after the tag or between calls
            if not self._skip_ws():
                if self._final:
                    self._release()
                return self._final and self._to("text")
            c = self._buf[self._pos]
            if c == ";":
                self._pos += 1
                return True
            if c == "{":
                self._begin_call()
                return True
            self._release()
            return self._to("text")
        assert self._reader is not None
        hint = finish_reader(self, self._reader, self._reader.step())
        if hint == "call":
            return True
        if hint == "wait":
            return False
        return self._to("calls" if hint == "done" else "text")
