"""The shared machine of the XML-style formats that wrap a turn's calls in one tagged block
(GLM-4.5's ``<tool_call>…</tool_call>``, MiniMax-M2's ``<minimax:tool_call>…</minimax:tool_call>``):
text before a block is content; a block's calls are committed when its end tag arrives (or at the
end of the output, for a block cut off: the calls and parameters written whole are kept), so a
stream split anywhere gives what the whole text gives. A block naming no request tool is content,
tags included. Values are typed by the request's tool schema (``core/parsing/arg_types.py``)."""

from __future__ import annotations

import json
from typing import Any

from llmkit.core.parsing.arg_types import convert_value, tool_param_types
from llmkit.core.parsing.tool_parser import StreamingToolParser


class BlockToolParser(StreamingToolParser):
    block_start: str
    block_end: str

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._param_types = tool_param_types(self.tools)

    def calls_in(self, block: str) -> list[tuple[str, list[tuple[str, str]]]]:
        """The ``(name, [(key, raw value)])`` calls written in ``block`` (the text between the tags)."""
        raise NotImplementedError

    def _step(self) -> bool:
        if self._state == "text":
            i, m = self._content_until((self.block_start,))
            if m is None:
                return False
            self._hold(i)
            return self._to("block")
        j = self._find(self.block_end)
        if j < 0 and not self._final:
            return False
        end = len(self._buf) if j < 0 else j
        calls = self.calls_in(self._buf[self._pos : end])
        self._pos = end if j < 0 else j + len(self.block_end)
        if not calls or not all(self.name_ok(name) for name, _ in calls):
            return self._fail()
        for name, params in calls:
            types = self._param_types.get(name, {})
            args = {key: convert_value(raw, types.get(key)) for key, raw in params}
            self._open_call(name)
            self._add_args(json.dumps(args, ensure_ascii=False))
            self._close_call()
        return self._to("text")
