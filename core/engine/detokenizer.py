"""Incremental detokenization with stop strings.

Text is released only when it is final: a token sequence that ends in the middle of a UTF-8
character (decoded as U+FFFD) is held until the character completes, and a suffix that could be
the start of a stop string is held until it is known not to be one, so stop strings never leak.

A byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, SmolLM2: the ``ByteLevel`` decoder) decodes a
token sequence as the concatenation of per-token bytes read as UTF-8, so its text is built from a
per-tokenizer byte table and an incremental UTF-8 decoder instead of two ``decode`` calls a token;
every other tokenizer takes the general path. Both give the same text and the same deltas.
"""

from __future__ import annotations

import codecs
import functools
import json
import weakref
from dataclasses import dataclass

import regex

from llmkit.core.multimodal.items import PSEUDO_BASE


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
        fast: bool = True,
    ) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        # (an image's pseudo-ids are no tokens: the context is the text around them)
        self.ids: list[int] = [t for t in prompt_ids[-self.CONTEXT :] if t < PSEUDO_BASE]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._bytes: dict[int, bytes] | None = None  # the byte-level path's table (None: general path)
        if fast:
            self._start_byte_level(tokenizer)
        self.text = ""  # all decoded output text (stop-trimmed once matched)
        self.emitted = 0  # chars of self.text already handed out
        self.stop = tuple(s for s in stop if s)
        self.keep_stop = keep_stop
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.stop_regex = [(p, regex.compile(p)) for p in stop_regex]

    @property
    def fast(self) -> bool:
        """Whether this request's text comes from the byte table (not ``decode`` calls)."""
        return self._bytes is not None

    def _start_byte_level(self, tokenizer) -> None:
        table = byte_level_table(tokenizer)
        if table is None:
            return
        self._table = table
        self._bytes = table.skip if self.skip else table.keep
        try:
            ctx = b"".join(self._token_bytes(t) for t in self.ids)
        except Exception:  # a prompt id decode rejects: the general path fails on it as it always has
            self._bytes = None
            return
        self._pending = ""  # decoded text not released yet (it ends in U+FFFD)
        _, n = _utf8_decode(ctx, "replace", False)
        self._buf = ctx[n:]  # the bytes of a character not complete yet
        # The general path slices each decode after the prompt context's own text. A context that
        # ends inside a character counts the U+FFFD it decodes to, so as many characters of the
        # output's own text are never released: drop them here too.
        self._drop = len(self._buf.decode("utf-8", "replace"))

    def _token_bytes(self, token_id: int) -> bytes:
        b = self._bytes.get(token_id)
        if b is None:
            b = self._table.lookup(token_id, self.skip)
            if b is None:  # not a token id at all: decode raises on it as before (or drops it)
                b = self._decode([token_id]).encode()
        return b

    def _next_byte_level(self, token_id: int) -> str:
        """The new text ``token_id`` releases: what ``_next_decoded`` returns, from the table."""
        b = self._bytes.get(token_id)
        if b is None:
            b = self._token_bytes(token_id)
        if not b:
            return ""
        if self._buf:
            b = self._buf + b
        s, n = _utf8_decode(b, "replace", False)
        self._buf = b[n:] if n < len(b) else b""
        if self._drop:
            s = self._dropped(s)
        if self._pending:
            s = self._pending + s
        # Held, as the general path holds a decode that ends in U+FFFD: a character not complete
        # yet, or an invalid byte at the end.
        if not s or s[-1] == "\ufffd" or self._buf:
            self._pending = s
            return ""
        self._pending = ""
        return s

    def _dropped(self, s: str) -> str:
        n = min(self._drop, len(s))
        self._drop -= n
        return s[n:]

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
        table = self._bytes
        if table is None:
            new = self._next_decoded(token_id)
        else:
            # The common token, inline: whole characters of its own, nothing held before it.
            b = table.get(token_id)
            if b and not (self._buf or self._pending or self._drop):
                new, n = _utf8_decode(b, "replace", False)
                if n < len(b) or new[-1] == "\ufffd":
                    self._buf = b[n:]
                    self._pending = new
                    return None
            else:
                new = self._next_byte_level(token_id)
        if not new:
            return None
        if not (self.stop or self.stop_regex):
            self.text += new
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
        if self._bytes is not None:
            s = self._buf.decode("utf-8", "replace")
            self._buf = b""
            self.text += self._pending + (self._dropped(s) if self._drop else s)
            self._pending = ""
        elif self.read_offset < len(self.ids):
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


_utf8_decode = codecs.utf_8_decode  # (data, errors, final) -> (text, bytes consumed)


def _gpt2_byte_chars() -> list[str]:
    """The character GPT-2's byte-level BPE writes for each byte 0-255 (its bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def _latin1_table() -> dict[int, str]:
    """str.translate table turning a token's byte characters into the latin-1 character of their
    byte; a character < 256 outside the alphabet becomes U+0100 so the latin-1 encode fails."""
    table = {ord(c): chr(b) for b, c in enumerate(_gpt2_byte_chars())}
    for cp in range(256):
        table.setdefault(cp, "\u0100")
    return table


_LATIN1 = _latin1_table()


def _byte_level_bytes(token: str) -> bytes:
    """What the ByteLevel decoder makes of one token: each character's byte, or the token's own
    UTF-8 when any character is outside the byte alphabet (as added tokens with spaces are)."""
    try:
        return token.translate(_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


class ByteLevelTable:
    """One byte-level tokenizer's token bytes, filled in as ids are first seen: building it whole
    costs every server start ~0.4 s for a 150k vocabulary (``get_vocab`` alone takes 0.3 s)."""

    def __init__(self, backend, key: tuple) -> None:
        self.backend = backend
        self.key = key
        added = backend.get_added_tokens_decoder()
        self.added_ids = sorted(added)
        # decode's skip test: the token's string is a special added token's content.
        self.special = frozenset(t.content for t in added.values() if t.special)
        self.keep: dict[int, bytes] = {}
        self.skip: dict[int, bytes] = {}

    def lookup(self, token_id: int, skip: bool) -> bytes | None:
        """``token_id``'s bytes (b"" for an id decode drops), None for a number that is no id."""
        token_id = int(token_id)
        if not 0 <= token_id < 1 << 32:
            return None
        # The string decode feeds the decoder: an added token's (normalized) content, else the model's.
        token = self.backend.id_to_token(token_id)
        b = b"" if token is None or (skip and token in self.special) else _byte_level_bytes(token)
        (self.skip if skip else self.keep)[token_id] = b
        return b

    def agrees_with_decode(self) -> bool:
        """Check the table against the tokenizer's own decode on every added token and a sample of
        the vocabulary, one by one and together, skipping special tokens or not."""
        n = self.backend.get_vocab_size(with_added_tokens=True)
        ids = self.added_ids + list(range(0, n, max(1, n // 512)))
        for skip in (False, True):
            got = [self.lookup(i, skip) for i in ids]
            one_by_one = self.backend.decode_batch([[i] for i in ids], skip_special_tokens=skip)
            if any(b.decode("utf-8", "replace") != t for b, t in zip(got, one_by_one)):
                return False
            if b"".join(got).decode("utf-8", "replace") != self.backend.decode(ids, skip_special_tokens=skip):
                return False
        return True


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> ByteLevelTable | None


def byte_level_table(tokenizer) -> ByteLevelTable | None:
    """``tokenizer``'s byte table when its ``decode(ids, clean_up_tokenization_spaces=False)`` is
    provably the UTF-8 reading (U+FFFD for bad bytes) of its tokens' concatenated bytes; else None."""
    backend = _plain_backend(tokenizer)
    if backend is None:
        return None
    try:
        decoder = backend.decoder
        state = decoder.__getstate__() if decoder is not None else None
    except Exception:  # a custom decoder, which cannot be serialized
        return None
    if not isinstance(state, (bytes, str)):
        return None
    key = (backend, backend.get_vocab_size(with_added_tokens=True), state)
    try:
        cached = _TABLES.get(tokenizer, False)
    except TypeError:  # not weak-referenceable: check and build each time
        cached = False
    if cached is not False and (cached is None or cached.key == key):
        return cached
    table = ByteLevelTable(backend, key) if _is_byte_level(key[2]) else None
    if table is not None and not table.agrees_with_decode():
        table = None
    try:
        _TABLES[tokenizer] = table
    except TypeError:
        pass
    return table


def _plain_backend(tokenizer):
    """The ``tokenizers`` backend of a transformers fast tokenizer whose ``decode`` is the stock
    one (the backend's decode, then clean-up the caller turns off); None for anything else."""
    fast_cls, decode, _decode = _stock_decode()
    cls = type(tokenizer)
    if fast_cls is None or not isinstance(tokenizer, fast_cls):
        return None
    if cls.decode is not decode or cls._decode is not _decode:
        return None  # a model's own decode (Whisper's timestamps, CodeGen's truncation, ...)
    if {"decode", "_decode"} & vars(tokenizer).keys():
        return None
    return getattr(tokenizer, "_tokenizer", None)


@functools.cache
def _stock_decode() -> tuple:
    """transformers' fast tokenizer class and its stock ``decode`` and ``_decode``."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None, None, None
    return PreTrainedTokenizerFast, PreTrainedTokenizerBase.decode, PreTrainedTokenizerFast._decode


def _is_byte_level(decoder_state: bytes) -> bool:
    """A ByteLevel decoder, alone or as the only member of a Sequence."""
    d = json.loads(decoder_state)
    if d.get("type") == "Sequence" and len(d.get("decoders") or ()) == 1:
        d = d["decoders"][0]
    return d.get("type") == "ByteLevel"
