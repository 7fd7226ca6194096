"""Reasoning separation end to end: the embedded model behind a Qwen3-style test template
(tests/data/think_template.jinja) with ``--reasoning-parser qwen3``."""

from __future__ import annotations

from pathlib import Path

import pytest

from server_utils import start_server, stop_server
from tests.conftest import Server

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "think_template.jinja"
MSG = [{"role": "user", "content": "9.11 and 9.8, which is greater?"}]


@pytest.fixture(scope="module")
def rserver():
    proc, url = start_server(
        [
            "--chat-template",
            str(TEMPLATE),
            "--reasoning-parser",
            "qwen3",
            "--tool-call-parser",
            "hermes",
            "--batch-storage",
            "none",
        ]
    )
    try:
        yield Server(proc, url)
    finally:
        stop_server(proc)


def _create(server, thinking, stream=False, **extra):
    body = {"chat_template_kwargs": {"enable_thinking": thinking}, **extra}
    return server.client.chat.completions.create(
        model="m", messages=MSG, temperature=0, max_tokens=24, stream=stream, extra_body=body
    )


def _collect(stream):
    reasoning, content, finishes = "", "", []
    for chunk in stream:
        for ch in chunk.choices:
            reasoning += (
                getattr(ch.delta, "reasoning_content", None) or ch.delta.model_extra.get("reasoning_content") or ""
            )
            content += ch.delta.content or ""
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    return reasoning, content, finishes


def test_thinking_enabled_gives_reasoning(rserver):
    r = _create(rserver, True)
    msg = r.choices[0].message
    # cut by max_tokens inside the template-opened <think>: it stays reasoning
    assert r.choices[0].finish_reason == "length"
    assert msg.reasoning_content
    assert r.usage.model_extra.get("reasoning_tokens", 0) > 0


def test_thinking_disabled_gives_content_only(rserver):
    r = _create(rserver, False)
    msg = r.choices[0].message
    assert msg.reasoning_content is None
    assert msg.content


@pytest.mark.parametrize("thinking", [True, False])
def test_streaming_equals_non_streaming(rserver, thinking):
    r = _create(rserver, thinking)
    reasoning, content, finishes = _collect(_create(rserver, thinking, stream=True))
    assert reasoning == (r.choices[0].message.reasoning_content or "")
    assert content == (r.choices[0].message.content or "")
    assert finishes == [r.choices[0].finish_reason]


def test_separate_reasoning_false_puts_everything_in_content(rserver):
    plain = _create(rserver, True)
    r = _create(rserver, True, separate_reasoning=False)
    assert r.choices[0].message.reasoning_content is None
    # the same generated text, unsplit (the parser trims whitespace at tag edges)
    assert r.choices[0].message.content.strip() == plain.choices[0].message.reasoning_content.strip()


def test_stream_reasoning_false_sends_no_reasoning_deltas_early(rserver):
    chunks = list(_create(rserver, True, stream=True, stream_reasoning=False))
    reasoning_chunks = [c for c in chunks for ch in c.choices if ch.delta.model_extra.get("reasoning_content")]
    assert len(reasoning_chunks) <= 1


def test_separate_reasoning_endpoint(rserver):
    import httpx

    r = httpx.post(
        rserver.base_url + "/separate_reasoning",
        json={"text": "<think>hmm</think>The answer", "reasoning_parser": "qwen3"},
    )
    assert r.status_code == 200 and r.json() == {"reasoning_text": "hmm", "text": "The answer"}
    r = httpx.post(rserver.base_url + "/separate_reasoning", json={"text": "x", "reasoning_parser": "nope"})
    assert r.status_code == 400 and "error" in r.json()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def _valid_weather_args(args: str) -> None:
    import json

    import jsonschema

    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


def test_named_tool_choice_returns_valid_call(rserver):
    r = rserver.client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=64,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    calls = ch.message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29
    _valid_weather_args(calls[0].function.arguments)


def test_named_tool_choice_streaming(rserver):
    stream = rserver.client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=64,
        temperature=0,
        stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    name, args, finishes = None, "", []
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                if tc.function.name:
                    assert name is None, "the name is sent once, first"
                    name = tc.function.name
                args += tc.function.arguments or ""
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    assert name == "get_weather" and finishes == ["tool_calls"]
    _valid_weather_args(args)


def test_required_tool_choice(rserver):
    r = rserver.client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=64,
        temperature=0,
        tool_choice="required",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)


def test_parse_function_call_endpoint(rserver):
    import httpx

    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>'
    r = httpx.post(
        rserver.base_url + "/parse_function_call", json={"text": text, "tool_call_parser": "hermes", "tools": [WEATHER]}
    )
    body = r.json()
    assert r.status_code == 200 and body["normal_text"] == "Sure."
    assert body["calls"][0]["name"] == "get_weather"
    assert json_loads(body["calls"][0]["parameters"]) == {"city": "Paris", "unit": "c"}


def json_loads(s):
    import json

    return json.loads(s)


def test_reasoning_budget_holds_and_the_answer_follows(rserver):
    """vLLM's thinking_token_budget: the reasoning stops at the budget, closed with the parser's own
    </think>, and the answer follows as content (reasoning tokens counted apart)."""
    for seed in (1, 2, 3):
        r = rserver.client.chat.completions.create(
            model="m",
            messages=MSG,
            temperature=1,
            seed=seed,
            max_tokens=40,
            extra_body={"thinking_token_budget": 6, "chat_template_kwargs": {"enable_thinking": True}},
        )
        msg, spent = r.choices[0].message, r.usage.completion_tokens_details.reasoning_tokens
        assert msg.reasoning_content and msg.content, (seed, msg)
        assert 0 < spent <= 7, spent  # the budget, give or take a merge at </think>
    raw = rserver.client.chat.completions.create(
        model="m",
        messages=MSG,
        temperature=1,
        seed=4,
        max_tokens=40,
        extra_body={"thinking_token_budget": 6, "separate_reasoning": False},
    )
    assert raw.choices[0].message.content.count("</think>") == 1


def test_anthropic_budget_tokens_holds(rserver):
    import httpx

    body = {
        "model": "m",
        "max_tokens": 40,
        "temperature": 1,
        "thinking": {"type": "enabled", "budget_tokens": 6},
        "messages": MSG,
    }
    r = httpx.post(rserver.base_url + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    assert [b["type"] for b in blocks][:2] == ["thinking", "text"], blocks
    assert 0 < len(blocks[0]["thinking"].split()) <= 6


def test_bad_thinking_token_budget(rserver):
    import httpx

    body = {"model": "m", "messages": MSG, "thinking_token_budget": 0}
    r = httpx.post(rserver.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
