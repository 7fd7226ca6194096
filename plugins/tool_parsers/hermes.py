"""``hermes``: Hermes/Qwen2.5/Qwen3 tool calls.

Format: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per call,
possibly after some text. A block whose body is not a call object (or names an unknown function)
stays content, tags included. A missing ``</tool_call>`` (the model stopped) is tolerated.
"""

from __future__ import annotations

from typing import Any

from llmkit.core.parsing.call_shape import ToolCallShape
from llmkit.core.parsing.tool_parser import StreamingToolParser
from llmkit.plugins.tool_parsers._json_call import JsonCallReader, finish_reader

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(StreamingToolParser):
    """``<tool_call>{json}</tool_call>`` blocks."""

    call_shape = ToolCallShape(START, START + '\n{"name": "{name}", "arguments": ', "}\n" + END)

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._reader: JsonCallReader | None = None

    def _step(self) -> bool:
        if self._state == "text":
            i, m = self._content_until((START,))
            if m is None:
                return False
            self._hold(i)
            self._reader = JsonCallReader(self)
            self._state = "call"
            return True
        if self._state == "call":
            assert self._reader is not None
            hint = finish_reader(self, self._reader, self._reader.step())
            if hint == "call":
                return True
            if hint == "wait":
                return False
            self._state = "text" if hint == "failed" else "after"
            return True
        # after a call: an optional closing tag
        if not self._skip_ws() and not self._final:
            return False
        at = self._eat(END)
        if at is None:
            return False
        self._state = "text"
        return True
