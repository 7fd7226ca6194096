"""Issue 19's wire findings (OpenAI-server peer suites, real client libraries): each against the
real server (the session ``server`` fixture) through the official ``openai`` client."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel

SAY_HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def client(server):
    return server.client


# -- 1. structured output keeps the schema's key order ---------------------------------------------

ORDERED = {
    "type": "object",
    "additionalProperties": False,
    "required": ["reasoning", "answer"],
    "properties": {"reasoning": {"enum": ["short", "long"]}, "answer": {"enum": ["yes", "no"]}},
}


def test_json_schema_keeps_property_order(client):
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Is the sky blue? Answer as JSON."}],
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ORDERED, "strict": True}},
    )
    assert list(json.loads(r.choices[0].message.content)) == ["reasoning", "answer"]


class Verdict(BaseModel):
    zeta: bool
    alpha: int


def test_parse_keeps_model_field_order(client):
    r = client.chat.completions.parse(
        model="m",
        messages=[{"role": "user", "content": "Give a verdict."}],
        response_format=Verdict,
        temperature=0,
        max_tokens=60,
    )
    assert list(json.loads(r.choices[0].message.content)) == ["zeta", "alpha"]
    assert isinstance(r.choices[0].message.parsed, Verdict)


def test_forced_tool_arguments_keep_property_order(client):
    tool = openai.pydantic_function_tool(Verdict, name="verdict")
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Judge."}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "verdict"}},
        temperature=0,
        max_tokens=60,
    )
    args = r.choices[0].message.tool_calls[0].function.arguments
    assert list(json.loads(args)) == ["zeta", "alpha"]


def test_forced_tool_call_wins_over_response_format(client):
    """The format governs text answers; a forced (named or required) call is still made."""
    tool = openai.pydantic_function_tool(Verdict, name="verdict")
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ORDERED, "strict": True}}
    for choice in ({"type": "function", "function": {"name": "verdict"}}, "required"):
        r = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Judge."}],
            tools=[tool],
            tool_choice=choice,
            response_format=fmt,
            temperature=0,
            max_tokens=60,
        )
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, (choice, ch)
        assert ch.message.tool_calls[0].function.name == "verdict"
        assert list(json.loads(ch.message.tool_calls[0].function.arguments)) == ["zeta", "alpha"]


# -- 2. forced tool calls with local $defs (nested pydantic models) ------------------------------------


class Address(BaseModel):
    city: str
    zip_code: int


class Person(BaseModel):
    name: str
    home: Address


class Company(BaseModel):
    title: str
    office: Address


def test_forced_tool_call_with_defs(client):
    tools = [
        openai.pydantic_function_tool(Person, name="person"),
        openai.pydantic_function_tool(Company, name="company"),
    ]
    assert "$defs" in tools[0]["function"]["parameters"]
    for choice in ({"type": "function", "function": {"name": "person"}}, "required"):
        r = client.chat.completions.create(
            model="m",
            # (the zip code in the prompt: without one the embedded model at its GGUF precision
            # writes digits until max_tokens, and truncated arguments are not JSON)
            messages=[{"role": "user", "content": "Alice lives in Paris, zip code 75001."}],
            tools=tools,
            tool_choice=choice,
            temperature=0,
            max_tokens=120,
        )
        assert r.choices[0].finish_reason != "length", r.choices[0].message.tool_calls
        for call in r.choices[0].message.tool_calls:
            schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), schema)


def test_conflicting_defs_across_tools_are_400(client):
    a = {
        "type": "function",
        "function": {
            "name": "a",
            "parameters": {
                "type": "object",
                "properties": {"x": {"$ref": "#/$defs/T"}},
                "$defs": {"T": {"type": "string"}},
            },
        },
    }
    b = {
        "type": "function",
        "function": {
            "name": "b",
            "parameters": {
                "type": "object",
                "properties": {"y": {"$ref": "#/$defs/T"}},
                "$defs": {"T": {"type": "integer"}},
            },
        },
    }
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=SAY_HI, tools=[a, b], tool_choice="required", max_tokens=20)
    assert info.value.param == "tools" and "$defs/T" in info.value.message


# -- 3. streaming with logprobs: no empty deltas, no stop-token logprob ----------------------------------


def test_stream_logprobs_has_no_empty_chunks(client):
    kw = dict(model="m", messages=SAY_HI, temperature=0, max_tokens=100, logprobs=True)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].finish_reason == "stop"
    tokens = [e.token for e in full.choices[0].logprobs.content]
    assert "<|im_end|>" not in tokens and "".join(tokens) == full.choices[0].message.content
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    streamed = []
    for c in chunks[1:]:  # chunks[0] is the role
        ch = c.choices[0]
        if ch.finish_reason is None:
            assert ch.delta.content or ch.delta.tool_calls, c
        streamed += [e.token for e in (ch.logprobs.content if ch.logprobs else [])]
    assert streamed == tokens
    assert [c.choices[0].finish_reason for c in chunks].count(None) == len(chunks) - 1


# -- 4. logprobs: 0 on completions ------------------------------------------------------------------


def test_completion_logprobs_zero_lists_sampled_token(client):
    r = client.completions.create(model="m", prompt="The sky is", max_tokens=4, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == {tok: value}


# -- 5. stream_options --------------------------------------------------------------------------------


def test_stream_options_without_stream_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=SAY_HI, max_tokens=4, stream_options={"include_usage": True})
    assert info.value.param == "stream_options"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="Hi", max_tokens=4, stream_options={"include_usage": True})
    assert info.value.param == "stream_options"


def test_continuous_usage_stats(client):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.chat.completions.create(
            model="m", messages=SAY_HI, max_tokens=12, temperature=0, stream=True, stream_options=opts
        )
    )
    with_choices = [c for c in chunks[1:] if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in with_choices)
    chunks = list(
        client.completions.create(
            model="m", prompt=["Hi", "Hello there"], max_tokens=5, n=2, temperature=0, stream=True, stream_options=opts
        )
    )
    final = chunks[-1].usage
    last = [c for c in chunks if c.choices][-1].usage
    assert (last.prompt_tokens, last.completion_tokens) == (final.prompt_tokens, final.completion_tokens)


# -- 6. echo of special-token prompts ---------------------------------------------------------------------


def test_echo_special_tokens_text_tokens_offsets_agree(client):
    from transformers import AutoTokenizer

    from llmkit.core.model.loader.source import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    ids = [1] + tok("user\nHello", add_special_tokens=False)["input_ids"] + [2, 1]
    r = client.completions.create(model="m", prompt=ids, echo=True, logprobs=1, max_tokens=3, temperature=0)
    c = r.choices[0]
    assert c.text.startswith("<|im_start|>user\nHello<|im_end|><|im_start|>")
    lp = c.logprobs
    for t, off in zip(lp.tokens, lp.text_offset):
        assert c.text[off : off + len(t)] == t, (t, off, c.text)


# -- 7. SGLang's stop_regex -------------------------------------------------------------------------------


def test_stop_regex(client):
    kw = dict(model="m", prompt="Count: 1, 2, 3, 4,", max_tokens=30, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    assert re.search(r"\b7\b", free), free
    r = client.completions.create(**kw, extra_body={"stop_regex": [r"\b7\b", "zzz+"]})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.matched_stop == r"\b7\b"
    assert c.text == free[: re.search(r"\b7\b", free).start()]
    streamed = "".join(
        ch.choices[0].text for ch in client.completions.create(**kw, stream=True, extra_body={"stop_regex": r"\b7\b"})
    )
    assert streamed == c.text
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Count to ten."}],
        temperature=0,
        max_tokens=60,
        extra_body={"stop_regex": r"\d"},
    )
    assert not re.search(r"\d", chat.choices[0].message.content)


@pytest.mark.parametrize("pattern", ["(abc", "(a+)+$", "a" * (1 << 15)], ids=["syntax", "redos", "too-long"])
def test_bad_stop_regex_is_400(client, pattern):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="Hi", max_tokens=3, extra_body={"stop_regex": pattern})
    assert info.value.param == "stop_regex"


# -- 8. templates without tool support ------------------------------------------------------------------


def test_template_without_tools_warns_at_start_up(server):
    assert server.log().count("The chat template has no tool support") == 1


# -- 14. the "Decode batch." log lines the README shows --------------------------------------------------


def test_decode_batch_lines_are_logged(client, server):
    client.completions.create(
        model="m", prompt="Once upon a time", max_tokens=50, temperature=0, extra_body={"ignore_eos": True}
    )
    rates = re.findall(
        r"Decode batch\. #running-req: \d+, #token: \d+, token usage: [\d.]+, "
        r"gen throughput \(token/s\): ([\d.]+)",
        server.log(),
    )
    assert rates and float(rates[-1]) > 0
