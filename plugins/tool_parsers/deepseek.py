"""``deepseekv3``: DeepSeek-V3 / R1 tool calls (V3.1's shorter form is read too).

V3: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>``. V3.1 drops the type and the fence:
``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``.
"""

from __future__ import annotations

import re
from typing import Any

from llmkit.core.parsing.text_scan import JsonScanner
from llmkit.core.parsing.tool_parser import StreamingToolParser
from llmkit.plugins.tool_parsers._json_call import read_name, stream_args

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_WORD = re.compile(r"[\w.\-]*")


class DeepSeekV3ToolParser(StreamingToolParser):
    """DeepSeek's tool-call token blocks."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = "text"
        self._name = ""
        self._fenced = False
        self._scanner = JsonScanner()

    def _step(self) -> bool:
        st = self._state
        if st == "text":
            i, m = self._content_until((CALLS_BEGIN, CALL_BEGIN))
            if m is None:
                return False
            self._hold(i)
            return self._to("section" if m == CALLS_BEGIN else "head")
        if st == "section":  # between calls
            return self._between_calls(CALL_BEGIN, CALLS_END)
        if st == "head":  # "function" (V3) or the name (V3.1), then the separator
            word = read_name(self, _WORD)
            if word is None:
                return False
            self._pos += len(word)
            at = self._eat(SEP)
            if at is None:
                self._pos -= len(word)
                return False
            if not at:
                return self._fail()
            if word == "function":
                return self._to("name")
            self._name = word
            return self._to("args0") if self.name_ok(word) else self._fail()
        if st == "name":
            word = read_name(self, _WORD)
            if word is None:
                return False
            if not self.name_ok(word):
                return self._fail()
            self._name = word
            self._pos += len(word)
            return self._to("args0")
        if st == "args0":  # optional ```json fence, then the object
            if not self._skip_ws():
                return self._final and self._fail()
            at = self._at("```")
            if at is None:
                return False
            if at:
                self._pos += 3
                if self._eat("json") is None:
                    self._pos -= 3
                    return False
                self._fenced = True
                return True
            if self._buf[self._pos] != "{":
                return self._fail()
            self._open_call(self._name)
            self._scanner = JsonScanner()
            return self._to("args")
        if st == "args":
            if stream_args(self, self._scanner) is None:
                return False
            return self._to("tail")
        # "tail": closing fence and end marker
        if not self._skip_ws() and not self._final:
            return False
        if self._fenced:
            at = self._eat("```")
            if at is None:
                return False
            self._fenced = False
            return True
        at = self._eat(CALL_END)
        if at is None:
            return False
        return self._to("section")
