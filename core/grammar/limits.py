"""Cheap, backend-independent checks that run before a grammar compiler sees a constraint, and the
byte-bounded LRU that holds compiled grammars.

The caps exist because compilers are not built for hostile input: xgrammar 0.2.8 spends 27 s and
4 GB compiling a 100,000-value enum, 27 s on a 1 MB regex, and Python's own ``json`` raises
RecursionError on a schema nested ~1,000 deep. Nested unbounded quantifiers such as ``(a*)*b`` or
``(\\w+\\s?)+`` compile instantly but make xgrammar's matcher slower with every token (hundreds of
ms per step after a few hundred tokens), which would stall the whole batch, so they are refused.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

try:  # CPython's regex parser, used only to inspect the structure of a pattern.
    from re import _constants as _sre_c  # type: ignore[attr-defined]
    from re import _parser as _sre_parse
except ImportError:  # pragma: no cover - Python < 3.11
    import sre_constants as _sre_c  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]


@dataclass(frozen=True)
class GrammarLimits:
    """Caps on constraint size and shape; anything larger is a 400 before compilation."""

    max_regex_bytes: int = 16 << 10
    max_ebnf_bytes: int = 128 << 10
    max_schema_bytes: int = 128 << 10
    max_schema_depth: int = 64  # JSON nesting of the schema document itself
    max_schema_nodes: int = 10_000  # objects + arrays + scalars, e.g. enum values
    reject_nested_quantifiers: bool = True


def check_spec(kind: str, value: Any, limits: GrammarLimits) -> str:
    """Validate a constraint's size and shape; return its canonical text (the cache key).

    A schema's text keeps its property order: the compiler emits keys in that order, so schemas
    that differ only in order are different grammars (and different cache entries).

    Raises ValueError with a client-facing message.
    """
    if kind == "json_object":
        return ""
    if kind == "json_schema":
        return _check_schema(value, limits)
    if kind == "structural_tag":  # a JSON document with schemas and regexes inside: the same caps
        return _check_schema(value, limits, "structural tag")
    if not isinstance(value, str):
        raise ValueError(f"{kind} must be a string")
    cap = limits.max_regex_bytes if kind == "regex" else limits.max_ebnf_bytes
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > cap:
        raise ValueError(f"{kind} is too large ({size} bytes; the limit is {cap})")
    if not value.strip():
        raise ValueError(f"{kind} must not be empty")
    if kind == "regex" and limits.reject_nested_quantifiers:
        check_regex_shape(value)
    return value


def _check_schema(value: Any, limits: GrammarLimits, what: str = "JSON schema") -> str:
    if isinstance(value, str):
        if len(value.encode("utf-8", "surrogatepass")) > limits.max_schema_bytes:
            raise ValueError(f"{what} is too large (limit {limits.max_schema_bytes} bytes)")
        try:
            value = json.loads(value)
        except RecursionError:
            raise ValueError(f"{what} is nested too deeply") from None
        except ValueError as exc:
            raise ValueError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object")
    patterns = _walk_schema(value, limits, what)
    if limits.reject_nested_quantifiers:
        for pattern in patterns:
            check_regex_shape(pattern)
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not serialisable as JSON: {exc}") from None
    if len(text.encode("utf-8", "surrogatepass")) > limits.max_schema_bytes:
        raise ValueError(f"{what} is too large (limit {limits.max_schema_bytes} bytes)")
    return text


def _walk_schema(root: dict, limits: GrammarLimits, what: str) -> list[str]:
    """Iteratively check depth and node count (no recursion, so no RecursionError); collect the
    regexes a schema carries (``pattern`` values and ``patternProperties`` keys)."""
    patterns: list[str] = []
    stack: list[tuple[Any, int]] = [(root, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > limits.max_schema_nodes:
            raise ValueError(f"{what} has too many elements (limit {limits.max_schema_nodes})")
        if depth > limits.max_schema_depth:
            raise ValueError(f"{what} is nested too deeply (limit {limits.max_schema_depth} levels)")
        if isinstance(node, dict):
            for key, child in node.items():
                if not isinstance(key, str):
                    raise ValueError(f"{what} keys must be strings")
                if key == "pattern" and isinstance(child, str):
                    patterns.append(child)
                if key == "patternProperties" and isinstance(child, dict):
                    patterns.extend(k for k in child if isinstance(k, str))
                stack.append((child, depth + 1))
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
    return patterns


_REPEATS = {_sre_c.MAX_REPEAT, _sre_c.MIN_REPEAT} | (
    {_sre_c.POSSESSIVE_REPEAT} if hasattr(_sre_c, "POSSESSIVE_REPEAT") else set()
)


def check_regex_shape(pattern: str) -> None:
    """Refuse a repetition whose body is nothing but unbounded repetitions and optional parts,
    e.g. ``(a+)+``, ``(a*)*b``, ``(\\w+\\s?)+``: each extra character multiplies the ways to split
    the input, which an Earley matcher pays for at every step. ``(\\d+,)+`` stays allowed (the
    comma separates the iterations). Patterns CPython cannot parse are left to the compiler."""
    try:
        tree = _sre_parse.parse(pattern)
    except RecursionError:
        raise ValueError("regex is nested too deeply") from None
    except Exception:  # another dialect (xgrammar's differs slightly); the compiler decides
        return
    try:
        bad = _find_nested_repeat(list(tree))
    except RecursionError:
        raise ValueError("regex is nested too deeply") from None
    if bad:
        raise ValueError(
            "regex has a nested unbounded quantifier such as (a+)+ whose matching cost grows with "
            "every token; rewrite it without the ambiguity (e.g. (a+,)+ or a+)"
        )


def _find_nested_repeat(seq: list) -> bool:
    for op, av in seq:
        if op in _REPEATS:
            lo, hi, body = av
            if hi >= 2 and _repeat_only(list(body)):
                return True
            if _find_nested_repeat(list(body)):
                return True
        elif op == _sre_c.SUBPATTERN:
            if _find_nested_repeat(list(av[-1])):
                return True
        elif op == _sre_c.BRANCH:
            if any(_find_nested_repeat(list(b)) for b in av[1]):
                return True
    return False


def _repeat_only(seq: list) -> bool:
    """Every element is optional or itself an unbounded repetition, and at least one is the latter."""
    found = False
    for item in seq:
        if _repeat_like(item):
            found = True
        elif not _nullable(item):
            return False
    return found


def _repeat_like(item: tuple) -> bool:
    op, av = item
    if op in _REPEATS:
        return av[1] == _sre_c.MAXREPEAT
    if op == _sre_c.SUBPATTERN:
        return _repeat_only(list(av[-1]))
    if op == _sre_c.BRANCH:
        return any(_repeat_only(list(b)) for b in av[1])
    return False


def _nullable(item: tuple) -> bool:
    op, av = item
    if op in (_sre_c.AT,):
        return True
    if op in _REPEATS:
        return av[0] == 0 or all(_nullable(i) for i in av[2])
    if op == _sre_c.SUBPATTERN:
        return all(_nullable(i) for i in av[-1])
    if op == _sre_c.BRANCH:
        return any(all(_nullable(i) for i in b) for b in av[1])
    return False


class GrammarCache:
    """A thread-safe LRU bounded by total bytes and by entry count.

    An entry larger than ``max_bytes`` is not cached (the caller still uses it).
    """

    def __init__(self, max_bytes: int, max_entries: int):
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any | None:
        """The cached value (now most recently used), or None."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: str, value: Any, nbytes: int) -> None:
        """Insert ``value`` charged at ``nbytes``, evicting least recently used entries."""
        nbytes = max(int(nbytes), 1)
        if nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            self._items[key] = (value, nbytes)
            self.nbytes += nbytes
            while self._items and (self.nbytes > self.max_bytes or len(self._items) > self.max_entries):
                _, (_, size) = self._items.popitem(last=False)
                self.nbytes -= size

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.nbytes = 0


_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# xgrammar's assertion text before a structural tag's own message says nothing to a client
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false: (Invalid structural tag error: )?")


def clean_compiler_message(message: str) -> str:
    """Strip a C++ log prefix (``[03:04:21] /project/cpp/x.cc:83: ``) and assertion text from a
    compiler error."""
    return _CHECK_FAILED.sub("", _ERROR_PREFIX.sub("", message.strip())).strip()
