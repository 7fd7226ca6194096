"""Structural tags (``response_format: {"type": "structural_tag"}``) and the strict tool-calling
tags built from each tool parser's declared call shape, against the real xgrammar backend and the
embedded model's tokenizer (no model: the grammar and the parsers are what is under test)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from llmkit.core.grammar.contract import GrammarError, GrammarSpec, create_grammar_backend, spec_from_request
from llmkit.core.parsing.tool_parser import create_tool_parser
from llmkit.core.server.generation.strict_tools import call_shape_of, strict_tools_tag
from llmkit.core.server.openai.protocol import ChatCompletionRequest

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
LEGACY = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": CITY, "end": "</f>"}], "triggers": ["<f"]}
NEW = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<f"],
        "tags": [
            {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": CITY}, "end": "</f>"}
        ],
    },
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["a"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
# One well-formed call per parser that declares a shape, written as its models write it.
CALLS = {
    "hermes": 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "qwen3_coder": "Let me check. <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    "gemma4": 'Let me check.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
    "glm45": "Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    "minimax_m2": 'Let me check.<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
    '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from llmkit.core.model.loader.source import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = create_grammar_backend(
        "xgrammar", tokenizer=tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]
    )
    yield b
    b.close()


def _accepts(backend, tokenizer, spec: GrammarSpec, text: str, end: bool = False) -> bool:
    matcher = backend.compile(spec).new_matcher()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if end else [])
    return all(matcher.accept_token(i) for i in ids)


def _body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **{"tools": TOOLS, **kw})


def test_both_request_shapes_are_one_grammar(backend, tokenizer):
    legacy, new = spec_from_request({"response_format": LEGACY}), spec_from_request({"response_format": NEW})
    assert legacy.kind == new.kind == "structural_tag" and legacy.value == new.value
    # /generate's sampling_params.structural_tag is the same object as JSON text
    assert spec_from_request({"structural_tag": json.dumps(LEGACY)}).value == new.value
    ok = 'Free text <f>{"city": "Paris"}</f> and more'
    assert _accepts(backend, tokenizer, legacy, ok, end=True)
    assert not _accepts(backend, tokenizer, legacy, 'x <f>{"town": "Paris"}')


@pytest.mark.parametrize(
    "rf, message",
    [
        ({"type": "structural_tag"}, "needs format"),
        ({**LEGACY, "triggers": []}, "triggers"),
        ({**LEGACY, "triggers": ["<g"]}, "starts with none of the triggers"),
        ({**LEGACY, "structures": [{"begin": "<f>", "end": "</f>"}]}, "schema"),
        ({**NEW, "structures": []}, "not both"),
        ({"type": "structural_tag", "format": "x"}, "format must be an object"),
    ],
)
def test_bad_request_shapes(rf, message):
    with pytest.raises(GrammarError, match=message) as info:
        spec_from_request({"response_format": rf})
    assert info.value.param == "response_format"


def test_backend_reports_bad_formats_without_compiler_noise(backend):
    bad = {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>"}}
    with pytest.raises(GrammarError, match=r"^Invalid structural tag: Tag format must have a content field$"):
        backend.compile(spec_from_request({"response_format": bad}))


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_declared_call_shape_parses(parser, backend, tokenizer):
    """A call written in the parser's shape passes its strict grammar and is read back by the
    parser itself; a call whose arguments break the schema does not pass."""
    tag = strict_tools_tag(_body(), parser, True)
    spec = GrammarSpec("structural_tag", tag, "tools")
    assert _accepts(backend, tokenizer, spec, CALLS[parser])
    _, calls = create_tool_parser(parser, tools=TOOLS).parse(CALLS[parser])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]
    xml = parser in ("qwen3_coder", "glm45", "minimax_m2")  # values written bare, not as JSON
    wrong = CALLS[parser].replace("3", "x") if xml else CALLS[parser].replace("3", '"three"')
    assert not _accepts(backend, tokenizer, spec, wrong)


def test_formats_without_a_frame_stay_unconstrained():
    assert call_shape_of("pythonic") is None and call_shape_of("json_array") is None and call_shape_of(None) is None
    assert strict_tools_tag(_body(), "pythonic", True) is None


def test_strict_flag_parallel_calls_and_tool_choice():
    assert strict_tools_tag(_body(tool_choice="required"), "hermes", True) is None
    assert strict_tools_tag(_body(tool_choice="none"), "hermes", True) is None
    # off by default: only tools marked strict keep their schema, the others are held to an object
    assert strict_tools_tag(_body(), "hermes", False) is None
    marked = [TOOLS[0], {"type": "function", "function": {**TOOLS[1]["function"], "strict": True}}]
    tags = strict_tools_tag(_body(tools=marked), "hermes", False)["format"]["tags"]
    assert [t["content"]["json_schema"] for t in tags] == [{"type": "object"}, ADD]
    fmt = strict_tools_tag(_body(parallel_tool_calls=False), "hermes", True)["format"]
    assert fmt["stop_after_first"] is True


def test_one_call_when_parallel_calls_are_off(backend, tokenizer):
    spec = GrammarSpec("structural_tag", strict_tools_tag(_body(parallel_tool_calls=False), "hermes", True))
    assert _accepts(backend, tokenizer, spec, CALLS["hermes"], end=True)
    assert not _accepts(backend, tokenizer, spec, CALLS["hermes"] + CALLS["hermes"])


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
def test_random_walks_always_parse(parser, backend, tokenizer):
    """Walk the grammar from the trigger on random allowed tokens (short ones mostly, so strings
    and objects close): whatever the walk writes, the parser reads one call that validates.
    (JSON arguments only: a qwen3_coder string value is open text that a random walk rarely ends.)"""
    import torch

    vocab = len(tokenizer)
    short = torch.tensor([len(tokenizer.decode([i])) <= 2 for i in range(vocab)])
    shifts = torch.arange(32, dtype=torch.int32)
    compiled = backend.compile(GrammarSpec("structural_tag", strict_tools_tag(_body(), parser, True)))
    trigger = call_shape_of(parser).trigger
    rng = random.Random(parser)
    mask = backend.allocate_bitmask(1)
    for _ in range(3):
        matcher = compiled.new_matcher()
        out = tokenizer("Sure. " + trigger, add_special_tokens=False)["input_ids"]
        assert all(matcher.accept_token(i) for i in out)
        for _ in range(400):
            matcher.fill_next_token_bitmask(mask, 0)
            allowed = ((mask[0].unsqueeze(1) >> shifts) & 1).flatten()[:vocab].bool()
            if allowed[tokenizer.eos_token_id]:  # the call is complete
                break
            pool = (allowed & short).nonzero().flatten().tolist() if rng.random() < 0.95 else []
            token = rng.choice(pool or allowed.nonzero().flatten().tolist())
            assert matcher.accept_token(token)
            out.append(token)
        else:
            pytest.fail(f"the walk did not close the call: {tokenizer.decode(out)!r}")
        _, calls = create_tool_parser(parser, tools=TOOLS).parse(tokenizer.decode(out))
        assert len(calls) == 1, tokenizer.decode(out)
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])


def test_reasoning_budget_grammar(backend, tokenizer):
    """Reasoning is free up to the budget, then only the end marker may follow; the answer keeps
    the request's own constraint."""
    from llmkit.core.server.generation.reasoning_budget import (
        EFFORT_BUDGETS,
        answer_format,
        budget_tag,
        reasoning_budget,
    )

    assert reasoning_budget(_body(reasoning_effort="low")) == EFFORT_BUDGETS["low"]
    assert reasoning_budget(_body(reasoning_effort="low", thinking_token_budget=9)) == 9
    assert reasoning_budget(_body(reasoning_effort="none")) is None
    answer = answer_format(GrammarSpec("json_schema", CITY))
    spec = GrammarSpec("structural_tag", budget_tag(4, "</think>", answer))
    words = tokenizer("one two three four five six", add_special_tokens=False)["input_ids"]
    matcher, mask = backend.compile(spec).new_matcher(), backend.allocate_bitmask(1)
    for i, token in enumerate(words[:5]):  # the budget is enforced by the mask, as decoding uses it
        matcher.fill_next_token_bitmask(mask, 0)
        allowed = bool((int(mask[0, token // 32]) >> (token % 32)) & 1)
        assert allowed == (i < 4), i
        if allowed:
            assert matcher.accept_token(token)
    assert _accepts(backend, tokenizer, spec, tokenizer.decode(words[:4]) + '</think>{"city": "Oslo"}', end=True)
    assert _accepts(backend, tokenizer, spec, 'one</think>{"city": "Oslo"}', end=True)  # closed early
    assert not _accepts(backend, tokenizer, spec, 'one</think>{"town": "Oslo"}')
