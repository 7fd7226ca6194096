"""Incremental detokenization with stop strings.

Text is released only when it is final: a token sequence that ends in the middle of a UTF-8
character (decoded as U+FFFD) is held until the character completes, and a suffix that could be
the start of a stop string is held until it is known not to be one, so stop strings never leak.
"""

from __future__ import annotations

from dataclasses import dataclass

import regex


@dataclass
class StopMatch:
    text: str  # the stop string that matched


class IncrementalDetokenizer:
    """Decodes one request's output tokens into text, step by step."""

    # Tokens kept before the undecoded tail: byte-level BPE and SentencePiece both need a little
    # left context to decode a token's leading space and merge bytes correctly.
    CONTEXT = 6

    # stop_regex is searched in this many trailing characters (plus the new text), so a long
    # output costs a bounded amount per token.
    REGEX_WINDOW = 4096

    def __init__(
        self,
        tokenizer,
        prompt_ids: list[int],
        skip_special_tokens: bool,
        stop: tuple[str, ...] = (),
        keep_stop: bool = False,
        stop_regex: tuple[str, ...] = (),
    ) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all decoded output text (stop-trimmed once matched)
        self.emitted = 0  # chars of self.text already handed out
        self.stop = tuple(s for s in stop if s)
        self.keep_stop = keep_stop
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.stop_regex = [(p, regex.compile(p)) for p in stop_regex]

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def _next_decoded(self, token_id: int) -> str:
        """The text ``token_id`` releases, by decoding a window of tokens before and after it."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # incomplete character: wait for more bytes
        new = full[len(prefix) :]
        self.prefix_offset = max(self.read_offset, len(self.ids) - self.CONTEXT)
        self.read_offset = len(self.ids)
        # Keep the working window bounded for very long outputs.
        if self.prefix_offset > 64:
            cut = self.prefix_offset
            self.ids = self.ids[cut:]
            self.prefix_offset -= cut
            self.read_offset -= cut
        return new

    def add_token(self, token_id: int) -> StopMatch | None:
        """Append a token; return a match if a stop string now appears in the text."""
        new = self._next_decoded(token_id)
        if not new:
            return None
        start = max(0, len(self.text) - self.max_stop + 1)
        self.text += new
        return self._find_stop(start) or self._find_regex(len(new))

    def _find_stop(self, start: int) -> StopMatch | None:
        if not self.stop:
            return None
        best = None
        for s in self.stop:
            pos = self.text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        pos, s = best
        self.text = self.text[: pos + len(s)] if self.keep_stop else self.text[:pos]
        self.emitted = min(self.emitted, len(self.text))
        return StopMatch(s)

    def _find_regex(self, new_len: int) -> StopMatch | None:
        """The earliest match of any stop_regex; its pattern is the matched stop (as SGLang)."""
        if not self.stop_regex:
            return None
        pos = max(0, len(self.text) - new_len - self.REGEX_WINDOW)
        best = None
        for pattern, rx in self.stop_regex:
            m = rx.search(self.text, pos)
            if m is not None and (best is None or m.start() < best[0].start()):
                best = (m, pattern)
        if best is None:
            return None
        m, pattern = best
        self.text = self.text[: m.end()] if self.keep_stop else self.text[: m.start()]
        self.emitted = min(self.emitted, len(self.text))
        return StopMatch(pattern)

    def flush(self) -> None:
        """At the end: decode whatever is left, even an incomplete character."""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            self.text += full[len(prefix) :]
            self.read_offset = len(self.ids)

    def take_delta(self, final: bool) -> str:
        """Text that is safe to send now (all of it when ``final``)."""
        end = len(self.text)
        if not final and (self.stop or self.stop_regex):
            end -= self._held_suffix()
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def _held_suffix(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        t = self.text
        held = 0
        for n in range(min(self.max_stop - 1, len(t)), 0, -1):
            tail = t[-n:]
            if any(s.startswith(tail) for s in self.stop):
                held = n
                break
        # Text a stop_regex has begun to match (a partial match reaching the end) is held too.
        pos = max(self.emitted, len(t) - self.REGEX_WINDOW)
        for _, rx in self.stop_regex:
            m = rx.search(t, pos, partial=True)
            if m is not None and m.partial:
                held = max(held, len(t) - m.start())
        return held
