"""Structured output: the grammar-backend interface the sampler and the request validation use.

A request's constraint becomes a :class:`GrammarSpec` (:func:`spec_from_request`); the backend chosen
by ``--grammar-backend`` compiles it into a :class:`CompiledGrammar` (cached, off the event loop,
with a deadline); each sequence gets its own :class:`GrammarMatcher`, which fills a row of a packed
token bitmask that the backend applies to the batch's logits, constrained rows only.

Invalid or hostile constraints raise :class:`GrammarError`, which the server maps to a 400 naming
``param``. Cheap caps (:mod:`llmkit.core.grammar.limits`) run before any compiler sees the input.
"""

from __future__ import annotations

import asyncio
import copy
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from llmkit.core.grammar.limits import GrammarCache, GrammarLimits, check_spec
from llmkit.core.grammar.structural_tag import structural_tag_value

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
CONFLICT_MESSAGE = "Only one of regex, json_schema, or ebnf can be set."


class GrammarError(ValueError):
    """An invalid, too large or too slow constraint: a client error (HTTP 400) naming ``param``."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True, eq=False)
class GrammarSpec:
    """One request's constraint.

    ``value``: a JSON schema (dict, or its JSON text) for ``json_schema``; None for ``json_object``;
    the pattern or grammar text for ``regex`` / ``ebnf``; for ``structural_tag`` the canonical
    ``{"type": "structural_tag", "format": {...}}`` (:mod:`.structural_tag`). ``param`` is the request field it came
    from, used in error messages.
    """

    kind: GrammarKind
    value: str | dict | None = None
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; valid: {', '.join(KINDS)}")


class GrammarMatcher(ABC):
    """Per-sequence matching state. Not thread-safe: one sequence, one engine thread."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and no state change) if the grammar forbids it."""

    @abstractmethod
    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the set of allowed next tokens into ``bitmask[row]``.

        May raise :class:`GrammarError` when the grammar has become too expensive to evaluate;
        the caller should then fail only this request.
        """

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has accepted a stop token; the sampler then forces EOS."""

    @abstractmethod
    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding, stop-string trims)."""

    @abstractmethod
    def reset(self) -> None:
        """Return to the initial state; replaying the accepted tokens rebuilds any later state."""


class CompiledGrammar(ABC):
    """An immutable compiled constraint, shared (through the cache) by every request that uses it."""

    memory_bytes: int = 0  # the size the cache charges for this grammar

    @abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher in the initial state (also how preempted requests are recomputed)."""


class GrammarBackend(ABC):
    """A structured-output backend (``--grammar-backend NAME``).

    Subclasses are constructed as ``Backend(tokenizer=hf_tokenizer, vocab_size=logits_width,
    **options)`` and implement :meth:`build` and the bitmask helpers; :meth:`compile` adds the
    input caps, the LRU cache and the caching of failures around :meth:`build`.
    """

    def __init__(
        self,
        *,
        limits: GrammarLimits | None = None,
        cache_max_bytes: int = 256 << 20,
        cache_max_entries: int = 4096,
    ):
        self.limits = limits or GrammarLimits()
        self.cache = GrammarCache(max_bytes=cache_max_bytes, max_entries=cache_max_entries)
        # Failures are cached too, so resending a hostile spec costs a dict lookup, not a deadline.
        self.failures = GrammarCache(max_bytes=1 << 20, max_entries=1024)
        self._inflight: dict[str, asyncio.Future] = {}

    @abstractmethod
    def build(self, kind: str, source: str, param: str, timeout: float) -> CompiledGrammar:
        """Compile a checked, canonical ``source`` (a schema's or structural tag's JSON text, a
        regex, EBNF text; ignored for ``json_object``) within ``timeout`` seconds, or raise :class:`GrammarError`."""

    @abstractmethod
    def allocate_bitmask(self, batch_size: int, vocab_size: int | None = None) -> Any:
        """A bitmask for ``batch_size`` rows (reuse it across steps); vocab defaults to the logits width."""

    @abstractmethod
    def apply_bitmask(self, logits: Any, bitmask: Any, rows: Sequence[int]) -> None:
        """Set disallowed logits to -inf in place, only for ``rows`` (the constrained ones)."""

    def warmup(self, timeout: float | None = None) -> None:
        """Block until the backend can compile (e.g. its worker processes have started); servers
        may call this at start-up so the first constrained request does not wait for it."""

    def close(self) -> None:
        """Release compiler workers or other resources; the backend is unusable afterwards."""

    def compile(self, spec: GrammarSpec, timeout: float = 5.0) -> CompiledGrammar:
        """Compile ``spec`` (cached). Blocking: servers call :meth:`compile_async` instead."""
        key, source = self._checked(spec)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        failed = self.failures.get(key)
        if failed is not None:
            raise GrammarError(spec.param, failed)
        try:
            compiled = self.build(spec.kind, source, spec.param, timeout)
        except GrammarError as exc:
            self.failures.put(key, exc.message, len(key))
            raise
        self.cache.put(key, compiled, max(compiled.memory_bytes, len(source)))
        return compiled

    async def compile_async(self, spec: GrammarSpec, timeout: float = 5.0) -> CompiledGrammar:
        """Compile ``spec`` off the event loop; raises :class:`GrammarError` within about
        ``timeout`` seconds of compile time. Cache hits return without a thread hop."""
        key, _ = self._checked(spec)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        # Concurrent requests with the same new schema share one compile.
        task = self._inflight.get(key)
        if task is None or task.get_loop() is not asyncio.get_running_loop():
            task = asyncio.ensure_future(asyncio.to_thread(self.compile, spec, timeout))
            self._inflight[key] = task
            task.add_done_callback(lambda t: (self._inflight.pop(key, None), t.cancelled() or t.exception()))
        # shield: a client that disconnects must not cancel the compile others wait for.
        return await asyncio.shield(task)

    def _checked(self, spec: GrammarSpec) -> tuple[str, str]:
        try:
            source = check_spec(spec.kind, spec.value, self.limits)
        except ValueError as exc:
            raise GrammarError(spec.param, str(exc)) from None
        return f"{spec.kind}\x00{source}", source


def create_grammar_backend(name: str, *, tokenizer: Any, vocab_size: int, **options: Any) -> GrammarBackend:
    """Instantiate the grammar backend registered as ``name`` (``xgrammar``, ``none``, ...)."""
    from llmkit.core.plugins import registry

    factory = registry().grammar_backend(name)
    return factory(tokenizer=tokenizer, vocab_size=vocab_size, **options)


def spec_from_request(body: dict) -> GrammarSpec | None:
    """The constraint a chat/completions request body asks for, or None.

    Reads OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with a nested
    ``json_schema.schema`` or the legacy top-level ``schema``; SGLang's and vLLM's ``structural_tag``) and SGLang's top-level ``regex``,
    ``ebnf``, ``json_schema`` (completions; a JSON string) and ``structural_tag`` (``/generate``).
    At most one may be set.
    """
    found: list[GrammarSpec] = []
    rf = body.get("response_format")
    if rf is not None:
        spec = _from_response_format(rf)
        if spec is not None:
            found.append(spec)
    tag = body.get("structural_tag")  # SGLang's /generate: sampling_params.structural_tag, JSON text
    if tag is not None:
        found.append(_from_structural_tag_param(tag))
    for param in ("json_schema", "regex", "ebnf"):
        value = body.get(param)
        if value is None:
            continue
        allowed = (str, dict) if param == "json_schema" else (str,)
        if not isinstance(value, allowed):
            raise GrammarError(param, f"{param} must be a string")
        found.append(GrammarSpec(param, value, param))  # type: ignore[arg-type]
    if len(found) > 1:
        raise GrammarError(next(s.param for s in found if s.param != "response_format"), CONFLICT_MESSAGE)
    return found[0] if found else None


def _from_structural_tag_param(tag: Any) -> GrammarSpec:
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as exc:
            raise GrammarError("structural_tag", f"structural_tag is not valid JSON: {exc}") from None
    if not isinstance(tag, dict) or tag.get("type", "structural_tag") != "structural_tag":
        raise GrammarError("structural_tag", 'structural_tag must be an object of type "structural_tag"')
    try:
        return GrammarSpec("structural_tag", structural_tag_value(tag), "structural_tag")
    except ValueError as exc:
        raise GrammarError("structural_tag", str(exc).replace("response_format", "structural_tag")) from None


def _from_response_format(rf: Any) -> GrammarSpec | None:
    if hasattr(rf, "model_dump"):  # a pydantic model from the HTTP layer
        rf = rf.model_dump(by_alias=True, exclude_none=True)
    if not isinstance(rf, dict):
        raise GrammarError("response_format", "response_format must be an object")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", None, "response_format")
    if kind == "structural_tag":
        try:
            return GrammarSpec("structural_tag", structural_tag_value(rf), "response_format")
        except ValueError as exc:
            raise GrammarError("response_format", str(exc)) from None
    if kind != "json_schema":
        raise GrammarError(
            "response_format",
            f"Unsupported response_format type {kind!r}; use 'text', 'json_object', 'json_schema' or 'structural_tag'.",
        )
    inner = rf.get("json_schema")
    if isinstance(inner, dict):
        schema = inner.get("schema", inner.get("schema_"))
    else:  # legacy: {"type": "json_schema", "schema": {...}}
        schema = rf.get("schema")
        if isinstance(schema, dict) and isinstance(schema.get("properties"), dict) and "strict" in schema["properties"]:
            # Older clients put the strict flag among the properties; it is not a property.
            schema = copy.copy(schema)
            schema["properties"] = {k: v for k, v in schema["properties"].items() if k != "strict"}
    if schema is None:
        raise GrammarError(
            "response_format", "response_format.json_schema.schema is required for json_schema response format request."
        )
    if not isinstance(schema, (dict, str)):
        raise GrammarError("response_format", "response_format.json_schema.schema must be a JSON object")
    return GrammarSpec("json_schema", schema, "response_format")
