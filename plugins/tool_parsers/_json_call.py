"""Reading one ``{"name": ..., "arguments": {...}}`` call object as it streams in.

Shared by the JSON-based formats (hermes, llama3, mistral, json_array). ``parameters`` is accepted
as a synonym of ``arguments`` (Llama 3). Other keys (``"type": "function"``) are skipped. The call is
committed when its name is known and accepted and its arguments object begins; if ``arguments``
comes before ``name`` it is buffered and emitted in one piece. ``arguments`` given as a JSON string
holding an object (some models double-encode) is decoded.
"""

from __future__ import annotations

import json
from enum import Enum

from llmkit.core.parsing.text_scan import JsonScanner
from llmkit.core.parsing.tool_parser import StreamingToolParser

ARG_KEYS = ("arguments", "parameters")


class Read(Enum):
    MORE = "more"  # need more text
    STEP = "step"  # progress; call again
    DONE = "done"  # the object closed
    ERROR = "error"  # not a call (before commit) or malformed (after)


def _decode_args(raw: str) -> str | None:
    """Arguments text for a buffered (non-streamed) value, or None if it is not an object."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if isinstance(value, dict):
        return raw.strip()
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except ValueError:
            return None
        return value if isinstance(inner, dict) else None
    return None


class JsonCallReader:
    """Reads one call object from ``owner``'s buffer, committing and streaming through it."""

    def __init__(self, owner: StreamingToolParser) -> None:
        self.o = owner
        self.state = "open"
        self.key: str | None = None
        self.name: str | None = None
        self.args: str | None = None  # buffered arguments (when not streamed)
        self.committed = False
        self.streaming = False
        self.scanner = JsonScanner()
        self.start = 0

    def step(self) -> Read:
        o = self.o
        if self.state in ("keystr", "value"):
            return self._value()
        if not o._skip_ws():
            return Read.ERROR if o._final else Read.MORE
        c = o._buf[o._pos]
        if self.state == "open":
            if c != "{":
                return Read.ERROR
            self.state = "key"
        elif self.state == "key":
            if c == "}":
                o._pos += 1
                return self._end()
            if c != '"':
                return Read.ERROR
            self._begin_value("keystr")
            return Read.STEP
        elif self.state == "colon":
            if c != ":":
                return Read.ERROR
            self.state = "value0"
        elif self.state == "value0":
            if self.key in ARG_KEYS and self.name is not None and c == "{" and not self.committed:
                o._open_call(self.name)
                self.committed = self.streaming = True
            self._begin_value("value")
            return Read.STEP
        elif self.state == "sep":
            if c == "}":
                o._pos += 1
                return self._end()
            if c != ",":
                return Read.ERROR
            self.state = "key"
        o._pos += 1
        return Read.STEP

    def _begin_value(self, state: str) -> None:
        self.state = state
        self.scanner = JsonScanner()
        self.start = self.o._pos
        if not self.streaming:
            self.o._pin = self.start

    def _value(self) -> Read:
        o = self.o
        end = self.scanner.scan(o._buf, o._pos)
        stop = len(o._buf) if end is None else end
        if self.streaming:
            o._add_args(o._buf[o._pos : stop])
        o._pos = stop
        if end is None:
            return Read.ERROR if o._final else Read.MORE
        o._pin = -1
        if self.scanner.broken:
            return Read.ERROR
        raw = o._buf[self.start : end]
        if self.state == "keystr":
            self.key = json.loads(raw)
            self.state = "colon"
            return Read.STEP
        self.state = "sep"
        if self.streaming:
            self.streaming = False
        elif self.key == "name" and self.name is None and not self.committed:
            try:
                name = json.loads(raw)
            except ValueError:
                return Read.ERROR
            if not isinstance(name, str) or not o.name_ok(name):
                return Read.ERROR
            self.name = name
        elif self.key in ARG_KEYS and not self.committed:
            self.args = _decode_args(raw)
            if self.args is None:
                return Read.ERROR
        return Read.STEP

    def _end(self) -> Read:
        if not self.committed:
            if self.name is None:
                return Read.ERROR
            self.o._open_call(self.name)
            self.o._add_args(self.args or "{}")
            self.committed = True
        self.o._close_call()
        return Read.DONE


def finish_reader(owner: StreamingToolParser, reader: JsonCallReader, result: Read) -> str:
    """Common handling of a reader's result; returns the owner's next state hint.

    ``"call"`` keep reading, ``"wait"`` need input, ``"done"`` object closed, ``"failed"`` the
    block was not a call (its text was returned as content), ``"broken"`` a committed call ended
    malformed (it is closed; continue as content).
    """
    if result is Read.STEP:
        return "call"
    if result is Read.MORE:
        return "wait"
    if result is Read.DONE:
        return "done"
    if reader.committed:
        if owner._in_call:
            owner._close_call()
        return "broken"
    owner._release()
    return "failed"


def stream_args(owner: StreamingToolParser, scanner: JsonScanner) -> bool | None:
    """Stream a committed call's arguments object; True when it ended (the call is closed),
    None when more text is needed."""
    end = scanner.scan(owner._buf, owner._pos)
    stop = len(owner._buf) if end is None else end
    owner._add_args(owner._buf[owner._pos : stop])
    owner._pos = stop
    if end is None and not owner._final:
        return None
    owner._close_call()
    return True


def read_name(owner: StreamingToolParser, pattern, limit: int = 256) -> str | None:
    """Match ``pattern`` at the cursor without consuming; None when the match may still grow."""
    end = pattern.match(owner._buf, owner._pos).end()
    if end == len(owner._buf) and not owner._final and end - owner._pos <= limit:
        return None
    return owner._buf[owner._pos : end]
