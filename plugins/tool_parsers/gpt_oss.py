"""``gpt-oss``: harmony function calls.

``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``
(the recipient may also follow the role). Messages that are not function calls pass through as
content unchanged, so this parser works after the ``gpt-oss`` reasoning parser (which forwards
call messages raw and the final answer as plain text) and on raw harmony text alike.
"""

from __future__ import annotations

from typing import Any

from llmkit.core.parsing.text_scan import JsonScanner
from llmkit.core.parsing.tool_parser import StreamingToolParser
from llmkit.plugins.tool_parsers._json_call import stream_args

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
CLOSERS = ("<|call|>", "<|end|>", "<|return|>")


def _function_name(header: str) -> str | None:
    i = header.find("to=functions.")
    if i < 0:
        return None
    j = i + len("to=functions.")
    k = j
    while k < len(header) and not header[k].isspace() and header[k] != "<":
        k += 1
    return header[j:k]


class GptOssToolParser(StreamingToolParser):
    """Harmony ``commentary to=functions.NAME`` messages → tool calls."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = "text"
        self._name = ""
        self._scanner = JsonScanner()

    def _step(self) -> bool:
        st = self._state
        if st == "text":
            i, m = self._content_until((START, CHANNEL))
            if m is None:
                return False
            self._hold(i)
            return self._to("header")
        if st == "header":
            j = self._find(MESSAGE)
            if j < 0:
                return False  # at the end, finish() returns the held header as content
            end = j + len(MESSAGE)
            name = _function_name(self._buf[self._mark : j])
            if name is None or not self.name_ok(name):
                self._release(end)  # not a function call: pass the message through
                return self._to("text")
            self._name = name
            self._pos = end
            return self._to("args0")
        if st == "args0":
            if not self._skip_ws():
                if self._final:
                    self._release()
                return False
            if self._buf[self._pos] != "{":
                self._release()
                return self._to("text")
            self._open_call(self._name)
            self._scanner = JsonScanner()
            return self._to("args")
        if st == "args":
            if stream_args(self, self._scanner) is None:
                return False
            return self._to("tail")
        if not self._skip_ws() and not self._final:
            return False
        for lit in CLOSERS:
            at = self._at(lit)
            if at is None:
                return False
            if at:
                self._pos += len(lit)
                break
        return self._to("text")
