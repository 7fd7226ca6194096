"""A toy reasoning parser (``<toy>…</toy>``) and a toy tool-call parser (``CALL name {json}``)."""

from __future__ import annotations

import json

from llmkit.core import ThinkTagReasoningParser, ToolCall, ToolParser
from llmkit.core.parsing.tool_parser import ToolParseDelta


class ToyReasoningParser(ThinkTagReasoningParser):
    start_tag = "<toy>"
    end_tag = "</toy>"


class ToyToolParser(ToolParser):
    """Whole lines ``CALL name {"arg": ...}`` are calls; everything else is content."""

    def __init__(self, tools=None):
        super().__init__(tools)
        self._text = ""
        self._calls: list[ToolCall] = []

    def feed(self, text: str) -> ToolParseDelta:
        self._text += text
        return ToolParseDelta()

    def finish(self) -> ToolParseDelta:
        content = []
        for line in self._text.splitlines():
            name, _, args = line.removeprefix("CALL ").partition(" ")
            if line.startswith("CALL ") and self.name_ok(name):
                json.loads(args or "{}")
                self._calls.append(ToolCall(id=f"call_{len(self._calls)}", name=name, arguments=args or "{}"))
            else:
                content.append(line)
        return ToolParseDelta(content="\n".join(content))

    @property
    def calls(self) -> list[ToolCall]:
        return self._calls
