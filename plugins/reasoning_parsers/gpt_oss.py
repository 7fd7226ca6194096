"""gpt-oss reasoning parser: the harmony message format.

A message is ``<|start|>ROLE<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY``
closed by ``<|end|>``, ``<|return|>`` (final answer) or ``<|call|>`` (tool call). The recipient may
also sit in the role part (``<|start|>assistant to=functions.f<|channel|>commentary``).

Routing, decided when the header is complete (at ``<|message|>``):

* ``analysis`` (and built-in tool recipients such as ``browser.search``, and unknown channels)
  → reasoning.
* ``final`` and ``commentary`` without a recipient (a preamble) → content.
* a ``functions.NAME`` recipient → content, *raw*: the header (from ``<|start|>`` or ``<|channel|>``
  through ``<|message|>``), the body, then ``<|call|>``, so the ``gpt-oss`` tool-call parser that
  runs next turns it into a tool call. Such a message always ends with ``<|call|>`` in the
  content, even if the model closed it with ``<|end|>`` or started a new message.

A new ``<|start|>`` or ``<|channel|>`` inside a body closes the current message. Text outside any
message (a model that writes no markers) is content, never dropped. An unfinished header at the
end is dropped (it is markup). This parser needs the special tokens in the decoded text
(``keep_special_tokens``): without them the channels cannot be told apart.
"""

from __future__ import annotations

from typing import Any

from llmkit.core.parsing.reasoning import ReasoningParser
from llmkit.core.parsing.text_scan import first_marker, partial_marker_len

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL, CONSTRAIN = "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"
ALL = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)
_CLOSERS = (END, RETURN, CALL)

_IDLE, _HEADER, _BODY = range(3)
_REASON, _CONTENT, _TOOL = range(3)


def _header_route(header: str) -> int:
    """Where a message's body goes, from its header text."""
    recipient = ""
    i = header.find("to=")
    if i >= 0:
        j = i + 3
        while j < len(header) and not header[j].isspace() and header[j] != "<":
            j += 1
        recipient = header[i + 3 : j]
    if recipient.startswith("functions."):
        return _TOOL
    c = header.rfind(CHANNEL)
    words = header[c + len(CHANNEL) :].replace("<", " ").split() if c >= 0 else []
    channel = words[0] if words else ""
    if channel == "final" or (channel == "commentary" and not recipient):
        return _CONTENT
    return _REASON


class GptOssReasoningParser(ReasoningParser):
    """Harmony channels: ``analysis`` → reasoning, ``final`` → content, function calls → raw content."""

    keep_special_tokens = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._mode = _IDLE
        self._route = _CONTENT
        self._header: list[str] = []
        self._tail = ""
        self._held: list[str] = []
        self._r: list[str] = []
        self._c: list[str] = []
        self._prime(self.prompt_text)

    def _prime(self, prompt: str) -> None:
        # A prompt that ends inside a message (usually "<|start|>assistant") starts us there.
        i = prompt.rfind(START)
        if i >= 0 and first_marker(prompt, _CLOSERS, i)[0] < 0:
            self.feed(prompt[i:])
            self._take()

    @property
    def constrained_answer_prefix(self) -> str:
        # A prompt ending in "<|start|>assistant" leaves us in a header: open the final channel
        # so the constrained text is the message body, not header markup the parser drops.
        return CHANNEL + "final" + MESSAGE if self._mode == _HEADER else ""

    @property
    def in_reasoning(self) -> bool:
        return self._mode == _BODY and self._route == _REASON

    def feed(self, text: str) -> tuple[str, str]:
        s, self._tail = self._tail + text, ""
        while s:
            s = self._step(s)
        return self._take()

    def finish(self, finish_reason: str = "stop") -> tuple[str, str]:
        tail, self._tail = self._tail, ""
        if self._mode == _IDLE:
            self._c.append(tail)
        elif self._mode == _BODY:
            self._body(tail)
        self._release()
        self._mode = _IDLE
        self._header.clear()
        return self._take()

    def _take(self) -> tuple[str, str]:
        r, c = "".join(self._r), "".join(self._c)
        self._r.clear()
        self._c.clear()
        return r, c

    def _body(self, text: str) -> None:
        if not text:
            return
        if self._route == _REASON:
            (self._r if self.stream_reasoning else self._held).append(text)
        else:
            self._c.append(text)

    def _release(self) -> None:
        if self._held:
            self._r.append("".join(self._held))
            self._held.clear()

    def _hold_partial(self, s: str) -> str:
        """Split off a suffix that may begin a marker; return the rest."""
        k = partial_marker_len(s, ALL)
        self._tail = s[len(s) - k :]
        return s[: len(s) - k]

    def _step(self, s: str) -> str:
        if self._mode == _IDLE:
            i, m = first_marker(s, ALL)
            if m is None:
                self._c.append(self._hold_partial(s))
                return ""
            self._c.append(s[:i])
            if m in (START, CHANNEL):
                self._mode = _HEADER
                self._header = [m]
            return s[i + len(m) :]  # other markers outside a message are dropped
        if self._mode == _HEADER:
            i, m = first_marker(s, (MESSAGE, START, END, RETURN, CALL))
            if m is None:
                self._header.append(self._hold_partial(s))
                return ""
            rest = s[i + len(m) :]
            if m == START:
                self._header = [START]
            elif m == MESSAGE:
                self._header.append(s[:i])
                header = "".join(self._header)
                self._route = _header_route(header)
                if self._route == _TOOL:
                    self._c.append(header + MESSAGE)
                self._mode = _BODY
            else:
                self._mode = _IDLE  # a header closed without a body: malformed, dropped
            return rest
        i, m = first_marker(s, (END, RETURN, CALL, START, CHANNEL))
        if m is None:
            self._body(self._hold_partial(s))
            return ""
        self._body(s[:i])
        if self._route == _TOOL:
            self._c.append(CALL)
        elif self._route == _REASON:
            self._release()
        if m in (START, CHANNEL):
            self._mode = _HEADER
            self._header = [m]
        else:
            self._mode = _IDLE
        return s[i + len(m) :]
