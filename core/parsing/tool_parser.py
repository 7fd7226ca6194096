"""Tool-call parsers: turn a model's content into OpenAI ``tool_calls``.

One parser object per choice, fed the content deltas the reasoning parser produced (or the raw
deltas when there is none), then finished once. Non-streaming is ``feed(all)`` + ``finish()``, the
same machine, so both modes agree exactly.

Decisions shared by every parser built on :class:`StreamingToolParser`:

* A call is *committed* (its name streamed) once the prefix proves it is one: the name is complete,
  belongs to the request's tools (when tools are given), and its arguments begin with ``{``.
  Anything invalid before that (not JSON, an unknown function) is returned as content, raw.
* After commit, argument text is streamed as the model writes it; the joined fragments are the
  call's ``arguments``. A call cut off (``length``) keeps its partial arguments, as OpenAI does.
* Whitespace next to a call is dropped, so a reply made only of calls has empty content.
"""

from __future__ import annotations

import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from llmkit.core.parsing.call_shape import ToolCallShape
from llmkit.core.parsing.text_scan import partial_marker_len


def new_call_id() -> str:
    """An OpenAI-style tool-call id: ``call_`` + 24 hex characters."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolCall(NamedTuple):
    """A parsed call; ``arguments`` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """One streamed piece of a call: the first has ``id`` and ``name``, later ones ``None``."""

    index: int
    id: str | None
    name: str | None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The ``delta.tool_calls[i]`` object of a chat-completion chunk."""
        out: dict[str, Any] = {"index": self.index, "id": self.id}
        if self.id is not None:
            out["type"] = "function"
        out["function"] = {"name": self.name, "arguments": self.arguments}
        return out


@dataclass
class ToolParseDelta:
    """What one ``feed`` or ``finish`` produced: content text and call pieces."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser(ABC):
    """One choice's tool-call extractor (a stateful, streaming state machine)."""

    #: How the model writes a call, for strict tool calling (None: the format has no fixed frame,
    #: so "auto" calls stay unconstrained). Calls written in this shape must parse.
    call_shape: ToolCallShape | None = None

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        """``tools`` are the request's OpenAI tool dicts; when given, calls to other names are
        not calls (their text stays content)."""
        self.tools = list(tools or [])
        names = {(t.get("function") or t).get("name") for t in self.tools if isinstance(t, dict)}
        self.tool_names: frozenset[str] = frozenset(n for n in names if isinstance(n, str))

    @abstractmethod
    def feed(self, text: str) -> ToolParseDelta:
        """Consume a content delta; return the content and call pieces it completes."""

    @abstractmethod
    def finish(self) -> ToolParseDelta:
        """Flush everything held back; call once at the end."""

    @property
    @abstractmethod
    def calls(self) -> list[ToolCall]:
        """Every call committed so far, with the arguments streamed so far."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Non-streaming convenience: ``(content, calls)`` of a complete text."""
        d1, d2 = self.feed(text), self.finish()
        return d1.content + d2.content, self.calls

    def name_ok(self, name: str) -> bool:
        """Whether ``name`` may be called (any name when the request gave no tools)."""
        return bool(name) and (not self.tool_names or name in self.tool_names)


def tool_parser_class(name: str) -> type[ToolParser]:
    """The registered class for ``name``; unknown names raise ``PluginError`` listing valid ones."""
    from llmkit.core.plugins import registry

    return registry().tool_parser(name)


def create_tool_parser(name: str, *, tools: list[dict[str, Any]] | None = None) -> ToolParser:
    """A fresh per-choice tool parser of the registered kind ``name``."""
    return tool_parser_class(name)(tools=tools)


_WS = re.compile(r"\s*")


class StreamingToolParser(ToolParser):
    """Buffer, cursor and call bookkeeping for the built-in parsers.

    Subclasses implement :meth:`_step`, which consumes from ``self._buf[self._pos:]`` and returns
    False when it needs more text. ``self._final`` is true during :meth:`finish`: partial markers
    then no longer wait. A block whose validity is not yet known is *held* from ``self._mark``;
    :meth:`_release` returns it as content, :meth:`_open_call` commits it.
    """

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._buf = ""
        self._pos = 0
        self._mark = -1  # start of a held (uncommitted) block
        self._pin = -1  # start of a value being read (kept through compaction)
        self._final = False
        self._scanned: dict[str, int] = {}
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._calls: list[list[Any]] = []  # [id, name, [argument pieces]]
        self._in_call = False
        self._ws = ""
        self._drop_lead = False
        self._state = "text"  # the subclass's parsing state

    #: where :meth:`_fail` returns to: the state that reads plain content
    _fail_state = "text"

    def _to(self, state: str) -> bool:
        """Switch state; True so a ``_step`` can ``return self._to(...)`` and keep going."""
        self._state = state
        return True

    def _fail(self) -> bool:
        """The held block is not a valid call: give it back as content and read on."""
        self._release()
        return self._to(self._fail_state)

    def _between_calls(self, call_begin: str, section_end: str) -> bool:
        """Inside a section of calls, after one: the next call's begin marker (state "head") or
        the section's end (back to "text"); anything else is not a valid section."""
        if not self._skip_ws() and not self._final:
            return False
        for lit, nxt in ((call_begin, "head"), (section_end, "text")):
            at = self._at(lit)
            if at is None:
                return False
            if at:
                if nxt == "head":
                    self._hold(self._pos)
                self._pos += len(lit)
                return self._to(nxt)
        return self._fail()

    @property
    def calls(self) -> list[ToolCall]:
        return [ToolCall(i, n, "".join(a)) for i, n, a in self._calls]

    def feed(self, text: str) -> ToolParseDelta:
        self._append(text)
        while self._step():
            pass
        return self._take()

    def finish(self) -> ToolParseDelta:
        self._final = True
        while self._step():
            pass
        if self._in_call:
            self._close_call()
        if self._mark >= 0:
            self._release(len(self._buf))
        self._say(self._buf[self._pos :])
        self._pos = len(self._buf)
        if not self._calls:
            self._content.append(self._ws)
        self._ws = ""
        return self._take()

    @abstractmethod
    def _step(self) -> bool:
        """Consume some buffered text; return False when more input is needed."""

    # -- buffer primitives --------------------------------------------------------------------
    def _append(self, text: str) -> None:
        keep = min(x for x in (self._pos, self._mark, self._pin) if x >= 0)
        if keep > 4096 and keep * 2 > len(self._buf):  # compact rarely: amortised linear
            self._buf = self._buf[keep:]
            self._pos -= keep
            self._mark = self._mark - keep if self._mark >= 0 else -1
            self._pin = self._pin - keep if self._pin >= 0 else -1
            self._scanned.clear()
        self._buf += text

    def _skip_ws(self) -> bool:
        """Skip whitespace; True when a non-space character follows."""
        self._pos = _WS.match(self._buf, self._pos).end()
        return self._pos < len(self._buf)

    def _at(self, lit: str) -> bool | None:
        """Does the text at the cursor start with ``lit``? None: cannot tell yet."""
        rest = len(self._buf) - self._pos
        if self._buf.startswith(lit, self._pos):
            return True
        if rest < len(lit) and lit.startswith(self._buf[self._pos :]) and not self._final:
            return None
        return False

    def _eat(self, lit: str) -> bool | None:
        """Like :meth:`_at`, and consume ``lit`` when it is there."""
        r = self._at(lit)
        if r:
            self._pos += len(lit)
        return r

    def _find(self, marker: str) -> int:
        """Index of ``marker`` at or after the cursor, or -1; never rescans text already searched."""
        start = max(self._pos, self._scanned.get(marker, 0))
        i = self._buf.find(marker, start)
        if i < 0:
            self._scanned[marker] = max(self._pos, len(self._buf) - len(marker) + 1)
        return i

    def _content_until(self, markers: tuple[str, ...]) -> tuple[int, str | None]:
        """Emit content up to the first marker and consume it: ``(marker_index, marker)``.

        Without a marker, emit all but a suffix that may start one and return ``(-1, None)``.
        """
        hits = [(i, m) for m in markers if (i := self._find(m)) >= 0]
        i, m = min(hits) if hits else (-1, None)
        if m is not None:
            self._say(self._buf[self._pos : i])
            self._pos = i + len(m)
            return i, m
        hold = 0 if self._final else partial_marker_len(self._buf, markers, self._pos)
        end = len(self._buf) - hold
        self._say(self._buf[self._pos : end])
        self._pos = end
        return -1, None

    # -- output -------------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        """Emit content, holding trailing whitespace in case a call follows."""
        if self._drop_lead:
            text = text.lstrip()
            if not text:
                return
            self._drop_lead = False
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        self._content.append(self._ws + body)
        self._ws = text[len(body) :]

    def _hold(self, at: int) -> None:
        """Hold the text from ``at`` until the block proves to be a call (or not)."""
        if self._mark < 0:
            self._mark = at

    def _release(self, upto: int | None = None) -> None:
        """The held block is not a call: emit it as content and continue after it."""
        upto = self._pos if upto is None else upto
        if self._mark >= 0:
            self._say(self._buf[self._mark : upto])
            self._mark = -1
        self._pos = max(self._pos, upto)

    def _open_call(self, name: str, call_id: str | None = None) -> None:
        self._mark = -1
        self._ws = ""
        self._in_call = True
        self._calls.append([call_id or new_call_id(), name, []])
        self._deltas.append(ToolCallDelta(len(self._calls) - 1, self._calls[-1][0], name, ""))

    def _add_args(self, text: str) -> None:
        if not text:
            return
        self._calls[-1][2].append(text)
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == len(self._calls) - 1 and last.name is None:
            last.arguments += text
        else:
            self._deltas.append(ToolCallDelta(len(self._calls) - 1, None, None, text))

    def _close_call(self) -> None:
        if not self._calls[-1][2]:
            self._add_args("{}")
        self._in_call = False
        self._drop_lead = True

    def _take(self) -> ToolParseDelta:
        out = ToolParseDelta("".join(self._content), self._deltas)
        self._content, self._deltas = [], []
        return out
