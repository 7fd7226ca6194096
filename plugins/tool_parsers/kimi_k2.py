"""``kimi_k2``: Kimi K2 tool calls.

``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
{...}<|tool_call_end|>…<|tool_calls_section_end|>``. The model's own id (``functions.NAME:IDX``)
is kept as the call id: Kimi's chat template writes it back into the history, where the model
expects to see it again.
"""

from __future__ import annotations

import re
from typing import Any

from llmkit.core.parsing.text_scan import JsonScanner
from llmkit.core.parsing.tool_parser import StreamingToolParser
from llmkit.plugins.tool_parsers._json_call import read_name, stream_args

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
_ID = re.compile(r"[\w.\-:]*")


def _name_of(call_id: str) -> str:
    """``functions.get_weather:0`` → ``get_weather``."""
    name = call_id.rsplit(":", 1)[0] if ":" in call_id else call_id
    return name.split(".", 1)[1] if name.startswith("functions.") else name


class KimiK2ToolParser(StreamingToolParser):
    """Kimi K2's tool-call section."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = "text"
        self._id = ""
        self._scanner = JsonScanner()

    def _step(self) -> bool:
        st = self._state
        if st == "text":
            i, m = self._content_until((SECTION_BEGIN, CALL_BEGIN))
            if m is None:
                return False
            self._hold(i)
            return self._to("section" if m == SECTION_BEGIN else "head")
        if st == "section":
            return self._between_calls(CALL_BEGIN, SECTION_END)
        if st == "head":
            if not self._skip_ws() and not self._final:
                return False
            call_id = read_name(self, _ID)
            if call_id is None:
                return False
            start = self._pos
            self._pos += len(call_id)
            self._skip_ws()
            at = self._eat(ARG_BEGIN)
            if at is None:
                self._pos = start
                return False
            if not at or not self.name_ok(_name_of(call_id)):
                return self._fail()
            self._id = call_id
            return self._to("args0")
        if st == "args0":
            if not self._skip_ws():
                return self._final and self._fail()
            if self._buf[self._pos] != "{":
                return self._fail()
            self._open_call(_name_of(self._id), call_id=self._id)
            self._scanner = JsonScanner()
            return self._to("args")
        if st == "args":
            if stream_args(self, self._scanner) is None:
                return False
            return self._to("tail")
        if not self._skip_ws() and not self._final:
            return False
        at = self._eat(CALL_END)
        if at is None:
            return False
        return self._to("section")
