"""``pythonic``: calls written as a Python list, ``[get_weather(city="Paris"), f(n=1)]``.

Used by Llama 3.2/4 (optionally wrapped in ``<|python_start|>`` … ``<|python_end|>``) and others.
Only a reply that *starts* with the list is parsed; arguments must be keyword arguments whose
values are Python literals (read with :func:`ast.literal_eval`, never evaluated). Each call is
committed when its closing parenthesis arrives, so its arguments stream as one JSON fragment.
A list that is not calls (``[1, 2]``) or a malformed call stays content.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from llmkit.core.parsing.tool_parser import StreamingToolParser
from llmkit.plugins.tool_parsers._json_call import read_name

START_TAG, END_TAG = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][\w.]*|")
_KEY = re.compile(r"[A-Za-z_]\w*|")
_OUTSIDE = re.compile(r"[\"'\[\](){},]")


class _PyValueScanner:
    """Finds the ``,`` or ``)`` that ends one argument value (tracking quotes and brackets)."""

    def __init__(self) -> None:
        self.depth = 0
        self.quote = ""
        self.inside = re.compile("")
        self.resume = 0  # where to continue after a None (an escape may straddle the pieces)

    def scan(self, text: str, i: int) -> int | None:
        n = len(text)
        while i < n:
            if self.quote:
                m = self.inside.search(text, i)
                if m is None:
                    self.resume = n - 1 if text.endswith("\\") else n
                    return None
                i = m.end()
                if m.group() == self.quote:
                    self.quote = ""
                continue  # an escape pair (backslash + any char) is skipped whole
            m = _OUTSIDE.search(text, i)
            if m is None:
                self.resume = n
                return None
            c, i = m.group(), m.end()
            if c in "\"'":
                self.quote = c
                self.inside = re.compile(r"\\.|" + c, re.DOTALL)
            elif c in "([{":
                self.depth += 1
            elif self.depth == 0 and c in ",)":
                return i - 1
            elif c in ")]}":
                self.depth -= 1
        self.resume = n
        return None


class PythonicToolParser(StreamingToolParser):
    """``[f(a=1), g(b="x")]`` at the start of the reply."""

    _fail_state = "plain"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = "start"
        self._tagged = False
        self._name = ""
        self._key = ""
        self._kwargs: dict[str, Any] = {}
        self._scanner = _PyValueScanner()
        self._vstart = 0

    def _step(self) -> bool:
        st = self._state
        if st == "plain":
            self._say(self._buf[self._pos :])
            self._pos = len(self._buf)
            return False
        if st == "start":
            start = self._pos
            if not self._skip_ws():
                self._pos = start
                return self._final and self._to("plain")
            self._say(self._buf[start : self._pos])
        if st != "val" and not self._skip_ws():
            if st == "start":
                return self._final and self._to("plain")
            return self._final and self._fail()
        c = self._buf[self._pos] if self._pos < len(self._buf) else ""
        if st == "start":
            at = self._at(START_TAG)
            if at is None:
                return False
            self._hold(self._pos)
            if at:
                self._pos += len(START_TAG)
                self._tagged = True
                return True
            if c != "[":
                self._release()
                return self._to("plain")
            self._pos += 1
            return self._to("item")
        if st == "item":
            name = read_name(self, _NAME)
            if name is None:
                return False
            if not self.name_ok(name) or not self._buf.startswith("(", self._pos + len(name)):
                if self._pos + len(name) < len(self._buf) or self._final:
                    return self._fail()
                return False
            self._name, self._kwargs = name, {}
            self._pos += len(name) + 1
            return self._to("kw")
        if st == "kw":
            if c == ")":
                self._pos += 1
                self._open_call(self._name)
                self._add_args(json.dumps(self._kwargs, ensure_ascii=False))
                self._close_call()
                return self._to("sep")
            key = read_name(self, _KEY)
            if key is None:
                return False
            start = self._pos
            self._pos += len(key)
            if not self._skip_ws():
                self._pos = start
                return self._final and self._fail()
            if not key or self._buf[self._pos] != "=":
                return self._fail()
            self._pos += 1
            self._key = key
            self._scanner = _PyValueScanner()
            self._vstart = self._pin = self._pos
            return self._to("val")
        if st == "val":
            end = self._scanner.scan(self._buf, self._pos)
            if end is None:
                self._pos = self._scanner.resume
                return self._final and self._fail()
            self._pin = -1
            try:
                value = ast.literal_eval(self._buf[self._vstart : end].strip())
                json.dumps(value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return self._fail()
            self._kwargs[self._key] = value
            self._pos = end + (self._buf[end] == ",")
            return self._to("kw")
        if st == "sep":
            if c == ",":
                self._pos += 1
                self._hold(self._pos)
                return self._to("item")
            if c != "]":
                return self._fail()
            self._pos += 1
            return self._to("end" if self._tagged else "plain")
        # "end": the closing tag of a tagged list
        if self._eat(END_TAG) is None:
            return False
        return self._to("plain")
