"""Helpers for scanning streamed text in linear time: special markers and JSON values."""

from __future__ import annotations

import re
from collections.abc import Iterable


def partial_marker_len(text: str, markers: Iterable[str], lo: int = 0) -> int:
    """Length of the longest suffix of ``text[lo:]`` that is a strict prefix of some marker.

    That suffix must be held back when streaming: the next chunk may complete the marker. Only the
    last ``len(marker) - 1`` characters are examined, so the cost does not grow with ``text``.
    """
    n = len(text)
    best = 0
    for m in markers:
        j = text.find(m[0], max(lo, n - len(m) + 1))
        while j != -1 and n - j > best:
            if m.startswith(text[j:]):
                best = n - j
                break
            j = text.find(m[0], j + 1)
    return best


def first_marker(text: str, markers: Iterable[str], start: int = 0) -> tuple[int, str | None]:
    """The earliest occurrence of any marker at or after ``start``: ``(index, marker)`` or ``(-1, None)``."""
    best, which = -1, None
    for m in markers:
        i = text.find(m, start, best + len(m) if best >= 0 else len(text))
        if i != -1 and (best < 0 or i < best):
            best, which = i, m
    return best, which


_WS = re.compile(r"\s*")
_JSON_STRUCT = re.compile(r'["{}\[\]<]')
_JSON_STR = re.compile(r'["\\]')
_JSON_SCALAR_END = re.compile(r"[\s,\]}<]")


class JsonScanner:
    """Finds where one JSON value ends, in text that arrives in pieces (no validation inside).

    ``<`` outside a string can never be JSON, so it ends the value early with ``broken`` set:
    that is usually the end marker of a truncated call. Scanning jumps between structural
    characters with simple character-class searches, so it runs at C speed and cannot backtrack.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False
        self.scalar = False
        self.broken = False

    def scan(self, text: str, i: int) -> int | None:
        """Advance over ``text[i:]``; the index just past the value's end, or None (consumed all)."""
        n = len(text)
        while i < n:
            if self.in_string:
                if self.escape:
                    self.escape, i = False, i + 1
                    continue
                m = _JSON_STR.search(text, i)
                if m is None:
                    return None
                i = m.start() + 1
                if text[i - 1] == "\\":
                    self.escape = True
                else:
                    self.in_string = False
                    if self.depth == 0:
                        return i
                continue
            if not self.started:
                i = _WS.match(text, i).end()
                if i >= n:
                    return None
                self.started = True
                self.scalar = text[i] not in '"{['
            if self.scalar:
                m = _JSON_SCALAR_END.search(text, i)
                return None if m is None else m.start()
            m = _JSON_STRUCT.search(text, i)
            if m is None:
                return None
            i, c = m.start() + 1, m.group()
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c == "<":
                self.broken = True
                return i - 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    return i
        return None
