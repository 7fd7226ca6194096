"""Reasoning parsers: split a model's output into ``reasoning_content`` and ``content``.

A parser object is a per-choice state machine. The server creates one per choice with
:func:`create_reasoning_parser`, calls :meth:`ReasoningParser.feed` with every decoded delta and
:meth:`ReasoningParser.finish` once at the end. Non-streaming requests do exactly the same with the
whole text in one ``feed``, so streaming and non-streaming results agree by construction.

:class:`ThinkTagReasoningParser` is the shared machine for ``<think>``-style formats; plugins
subclass it with their tags and defaults. Decisions that apply to every tag-based parser:

* Where output starts is decided from the rendered prompt first: a prompt ending in an open start
  tag (the template prefilled ``<think>``) starts inside reasoning; a prompt ending in an end tag
  (an empty ``<think></think>`` block: thinking is off) turns parsing off, so everything, tags
  included, is content. Otherwise the parser's defaults and ``chat_template_kwargs`` decide
  (``enable_thinking`` and ``thinking`` are synonyms).
* When not forced, a start tag opens reasoning only at the very start of the output (after
  whitespace); a tag-like string later in the answer is literal content. After the end tag,
  everything is content, including further tags.
* A suffix that could begin a tag is held back until the next delta decides it; whitespace around
  the tags is trimmed (leading and trailing in reasoning, leading in content).
* No end tag and finish ``length``/``abort``: the text stays reasoning (it was cut off).
* No end tag and finish ``stop``/``tool_calls`` in a block the *template* opened: with
  ``stream_reasoning=False`` the buffered text is returned as content, so an answer from a model
  that skipped thinking is not lost. With ``stream_reasoning=True`` it was already streamed as
  reasoning and cannot be taken back, so it stays reasoning. Servers should therefore pass
  ``stream_reasoning=False`` for non-streaming requests (nothing is lost by buffering there).
* A parser may name a ``tool_start`` marker (qwen3: ``<tool_call>``) that also ends reasoning;
  the marker stays in content for the tool-call parser.
* An empty reasoning block yields ``""`` reasoning; servers report that as null.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from llmkit.core.parsing.text_scan import first_marker, partial_marker_len

FINISH_REASONS = ("stop", "length", "abort", "tool_calls")


class ReasoningParser(ABC):
    """One choice's reasoning/content splitter (a stateful, streaming state machine)."""

    #: True when the model's special tokens must survive detokenization (harmony markers).
    keep_special_tokens: ClassVar[bool] = False

    def __init__(
        self,
        *,
        prompt_text: str = "",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        stream_reasoning: bool = True,
    ) -> None:
        """``prompt_text`` is the rendered prompt; ``stream_reasoning=False`` buffers reasoning
        and emits it in one piece when it ends, just before the first content."""
        self.prompt_text = prompt_text
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.stream_reasoning = stream_reasoning

    @abstractmethod
    def feed(self, text: str) -> tuple[str, str]:
        """Consume a decoded delta; return ``(reasoning_delta, content_delta)`` (either may be "")."""

    @abstractmethod
    def finish(self, finish_reason: str = "stop") -> tuple[str, str]:
        """Flush everything held back; ``finish_reason`` is one of :data:`FINISH_REASONS`."""

    @property
    @abstractmethod
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside reasoning (for counting reasoning tokens)."""

    @property
    def reasoning_end_markers(self) -> tuple[str, ...]:
        """When the output starts inside reasoning: the strings whose appearance ends it, so a
        constraint (JSON schema, forced tool call) can wait for the answer; ``()`` otherwise, or
        when the format cannot tell from the text alone."""
        return ()

    @property
    def constrained_answer_prefix(self) -> str:
        """Text to append to the prompt before a constrained answer (a JSON schema, a forced
        tool call) when the prompt leaves the output where no answer can start: gpt-oss's
        template ends inside a message header. ``""``: the answer may start right away."""
        return ""

    def parse(self, text: str, finish_reason: str = "stop") -> tuple[str, str]:
        """Non-streaming convenience: ``feed(text)`` then ``finish()``, concatenated."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish(finish_reason)
        return r1 + r2, c1 + c2


def thinking_flag(kwargs: Mapping[str, Any] | None) -> bool | None:
    """The request's thinking switch: ``enable_thinking`` or its synonym ``thinking``; None if unset."""
    kwargs = kwargs or {}
    for key in ("enable_thinking", "thinking"):
        if kwargs.get(key) is not None:
            return bool(kwargs[key])
    return None


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The registered class for ``name``; raises :class:`llmkit.core.plugins.PluginError` listing
    the valid names when unknown (call at start-up to fail early, and to read
    ``keep_special_tokens``)."""
    from llmkit.core.plugins import registry

    return registry().reasoning_parser(name)


def create_reasoning_parser(
    name: str,
    *,
    prompt_text: str = "",
    chat_template_kwargs: Mapping[str, Any] | None = None,
    stream_reasoning: bool = True,
) -> ReasoningParser:
    """A fresh per-choice parser of the registered kind ``name``."""
    cls = reasoning_parser_class(name)
    return cls(
        prompt_text=prompt_text,
        chat_template_kwargs=chat_template_kwargs,
        stream_reasoning=stream_reasoning,
    )


class ReasoningEndScanner:
    """Finds where reasoning ends in streamed output, in time linear in the output: it keeps only
    the tail that could begin an end marker between deltas (the engine feeds it every delta
    while a constraint waits for the answer)."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        self.markers = tuple(m for m in markers if m)
        self._tail = ""

    def is_reasoning_end(self, delta: str) -> bool:
        """Feed the newest output text; True once an end marker has appeared."""
        s = self._tail + delta
        if first_marker(s, self.markers)[1] is not None:
            return True
        keep = partial_marker_len(s, self.markers)
        self._tail = s[len(s) - keep :] if keep else ""
        return False


# Modes of the tag machine.
_OFF, _START, _R_HEAD, _REASON, _C_HEAD, _CONTENT = range(6)


class ThinkTagReasoningParser(ReasoningParser):
    """The shared machine for formats that wrap reasoning in a start and an end tag.

    Subclasses set ``start_tag``/``end_tag`` and the defaults: ``forces_reasoning`` (output starts
    inside reasoning unless the prompt closed the block) and ``thinking_kwarg`` (how the request's
    thinking switch is read: ``None`` ignores it, ``"force"`` makes true force reasoning,
    ``"allow"`` only lets false turn parsing off) and optionally ``tool_start``.
    """

    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    forces_reasoning: ClassVar[bool] = False
    thinking_kwarg: ClassVar[str | None] = None
    #: A marker that also ends reasoning (and stays in content): a tool call the model made
    #: without closing its think block, or straight after a template-opened one.
    tool_start: ClassVar[str | None] = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._mode = self._initial_mode()
        self._markers = (self.end_tag,) + ((self.tool_start,) if self.tool_start else ())
        # The block was opened by the template (or forced), not by a tag the model wrote.
        self._template_opened = self._mode == _R_HEAD
        self._tail = ""  # text that may begin a tag
        self._ws = ""  # whitespace held at the edge of reasoning or before a possible start tag
        self._held: list[str] = []  # reasoning buffered while stream_reasoning is off
        self._r: list[str] = []
        self._c: list[str] = []

    def _initial_mode(self) -> int:
        tail = self.prompt_text.rstrip()
        if tail.endswith(self.end_tag):
            return _OFF
        if tail.endswith(self.start_tag) or self.forces_reasoning:
            return _R_HEAD
        flag = thinking_flag(self.chat_template_kwargs)
        if self.thinking_kwarg is not None and flag is False:
            return _OFF
        if self.thinking_kwarg == "force" and flag:
            return _R_HEAD
        return _START

    @property
    def in_reasoning(self) -> bool:
        return self._mode in (_R_HEAD, _REASON)

    @property
    def reasoning_end_markers(self) -> tuple[str, ...]:
        return (self.end_tag,) if self.in_reasoning else ()

    def feed(self, text: str) -> tuple[str, str]:
        s, self._tail = self._tail + text, ""
        while s:
            s = self._step(s)
        return self._take()

    def finish(self, finish_reason: str = "stop") -> tuple[str, str]:
        tail, self._tail = self._tail, ""
        if self._mode == _START:
            self._c.append(self._ws + tail)
        elif self._mode in (_R_HEAD, _REASON):
            # A partial end tag at the very end is just text; trailing whitespace is trimmed.
            body = (self._ws + tail).rstrip() if self._mode == _REASON else tail
            self._add_reasoning(body)
            held = "".join(self._held)
            self._held.clear()
            if held and self._template_opened and finish_reason in ("stop", "tool_calls"):
                self._c.append(held)  # the model answered without thinking: keep the answer
            else:
                self._r.append(held)
        self._ws = ""
        self._mode = _CONTENT
        return self._take()

    def _take(self) -> tuple[str, str]:
        r, c = "".join(self._r), "".join(self._c)
        self._r.clear()
        self._c.clear()
        return r, c

    def _add_reasoning(self, text: str) -> None:
        if text:
            (self._r if self.stream_reasoning else self._held).append(text)

    def _step(self, s: str) -> str:
        """Consume a prefix of ``s`` in the current mode; return the rest (for the next mode)."""
        mode = self._mode
        if mode in (_OFF, _CONTENT):
            self._c.append(s)
            return ""
        if mode == _C_HEAD:
            s = s.lstrip()
            if s:
                self._mode = _CONTENT
            return s
        if mode == _START:
            stripped = s.lstrip()
            self._ws += s[: len(s) - len(stripped)]
            s = stripped
            if not s:
                return ""
            if s.startswith(self.start_tag):
                self._ws = ""
                self._mode = _R_HEAD
                return s[len(self.start_tag) :]
            if self.start_tag.startswith(s):
                self._tail = s
                return ""
            self._c.append(self._ws + s)
            self._ws = ""
            self._mode = _CONTENT
            return ""
        if mode == _R_HEAD:
            # Reasoning starts: skip whitespace and start tags the model repeats (R1-0528 emits one).
            s = s.lstrip()
            if s.startswith(self.start_tag):
                self._template_opened = False  # the model itself is thinking
                return s[len(self.start_tag) :]
            if s and self.start_tag.startswith(s):
                self._tail = s
                return ""
            if s:
                self._mode = _REASON
            return s
        return self._reason(s)

    def _reason(self, s: str) -> str:
        i, m = first_marker(s, self._markers)
        if m is not None:
            self._add_reasoning((self._ws + s[:i]).rstrip())
            self._ws = ""
            if self._held:
                self._r.append("".join(self._held))
                self._held.clear()
            if m == self.end_tag:
                self._mode = _C_HEAD
                return s[i + len(m) :]
            self._mode = _CONTENT  # a tool call ends reasoning; the call itself is content
            return s[i:]
        k = partial_marker_len(s, self._markers)
        body = s[: len(s) - k]
        self._tail = s[len(s) - k :]
        stripped = body.rstrip()
        if stripped:
            self._add_reasoning(self._ws + stripped)
            self._ws = body[len(stripped) :]
        else:
            self._ws += body
        return ""
