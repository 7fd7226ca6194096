"""Anthropic's Messages API with the official ``anthropic`` client against a real server (the
reasoning test template, qwen3 reasoning parser, hermes tool parser, an API key)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from api_utils import RAW_BAD_BODIES, REASONING_ARGS, TIME_SCHEMA, WEATHER_SCHEMA, healthy, post_raw
from server_utils import start_server, stop_server

KEY = "sk-test-key"
TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city", "input_schema": WEATHER_SCHEMA},
    {"name": "get_time", "input_schema": TIME_SCHEMA},
]
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
GREEDY = {"temperature": 0}  # this SDK version has no sampling arguments of its own


@pytest.fixture(scope="module")
def url():
    proc, base = start_server([*REASONING_ARGS, "--api-key", KEY, "--batch-storage", "none"])
    try:
        yield base
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=300)


def _both(client, **kw):
    """The same request without and with streaming."""
    kw = {"model": "m", "extra_body": GREEDY, "max_tokens": 24, **kw}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        streamed = stream.get_final_message()
    return whole, streamed, events


def _blocks(msg):
    """Content blocks, tool-call ids aside (each call gets a fresh one)."""
    return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in msg.content]


def test_create_text(client):
    r = client.messages.create(
        model="m",
        max_tokens=16,
        extra_body=GREEDY,
        system="Be brief.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}],
    )
    assert r.type == "message" and r.role == "assistant" and r.model == "m" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens") and r.usage.output_tokens <= 16
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) > 0


@pytest.mark.parametrize("thinking", [None, {"type": "enabled", "budget_tokens": 16}])
def test_streaming_equals_non_streaming(client, thinking):
    extra = {"thinking": thinking} if thinking else {}
    whole, streamed, events = _both(client, messages=ASK, **extra)
    assert _blocks(streamed) == _blocks(whole)
    assert (streamed.stop_reason, streamed.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert (
        streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens
        == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )
    assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events
    kinds = [b.type for b in whole.content]
    if thinking:  # the template opens <think>: cut by max_tokens, all of it is thinking
        assert kinds[0] == "thinking" and whole.content[0].thinking and whole.stop_reason == "max_tokens"
    else:
        assert "thinking" not in kinds


def test_message_start_reports_the_prompt_size(client):
    kw = {"model": "m", "extra_body": GREEDY, "max_tokens": 4, "messages": ASK}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        start = next(e for e in stream if e.type == "message_start")
        stream.until_done()
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert start.message.usage.input_tokens == prompt > 0


def test_stop_sequence(client):
    free = client.messages.create(model="m", max_tokens=24, extra_body=GREEDY, messages=ASK)
    words = free.content[0].text.split()
    assert len(words) >= 3
    stop = " " + words[2]
    whole, streamed, _ = _both(client, messages=ASK, stop_sequences=[stop])
    for r in (whole, streamed):
        assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
        assert free.content[0].text.startswith(r.content[0].text) and stop not in r.content[0].text


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_tool_use_round_trip(client, choice):
    whole, streamed, _ = _both(client, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=64)
    assert _blocks(streamed) == _blocks(whole)
    assert whole.stop_reason == streamed.stop_reason == "tool_use"
    call = next(b for b in whole.content if b.type == "tool_use")
    assert call.id.startswith("toolu_")
    if choice["type"] == "tool":
        assert call.name == "get_weather"
        jsonschema.validate(call.input, WEATHER_SCHEMA)
    follow = client.messages.create(
        model="m",
        max_tokens=24,
        extra_body=GREEDY,
        tools=TOOLS,
        messages=[
            *ASK,
            {"role": "assistant", "content": whole.content},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": call.id,
                        "content": [{"type": "text", "text": "18 C, sunny"}],
                    }
                ],
            },
        ],
    )
    assert follow.content and follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the tool result reached the prompt: it is longer than the question alone
    assert (
        follow.usage.input_tokens + follow.usage.cache_read_input_tokens
        > whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )


def test_count_tokens(client):
    n = client.messages.count_tokens(model="m", messages=ASK, system="Be brief.").input_tokens
    r = client.messages.create(model="m", max_tokens=1, extra_body=GREEDY, messages=ASK, system="Be brief.")
    assert n == r.usage.input_tokens + r.usage.cache_read_input_tokens
    with_tools = client.messages.count_tokens(model="m", messages=ASK, tools=TOOLS).input_tokens
    assert with_tools > client.messages.count_tokens(model="m", messages=ASK).input_tokens


@pytest.mark.parametrize(
    "body,contains",
    [
        ({"messages": ASK}, "max_tokens"),
        ({"max_tokens": 8, "messages": []}, "messages"),
        ({"max_tokens": 8, "messages": ASK, "bogus": 1}, "bogus"),
        ({"max_tokens": "8", "messages": ASK}, "max_tokens"),
        ({"max_tokens": 0, "messages": ASK}, "max_tokens"),
        ({"max_tokens": 10**12, "messages": ASK}, "context length"),
        ({"max_tokens": 8, "messages": ASK, "temperature": -1}, "temperature"),
        ({"max_tokens": 8, "messages": ASK, "temperature": "hot"}, "temperature"),
        ({"max_tokens": 8, "messages": ASK, "top_k": 0}, "top_k"),
        ({"max_tokens": 8, "messages": ASK, "thinking": {"type": "between_tools"}}, "thinking"),
        ({"max_tokens": 8, "messages": {}}, "messages"),
        ({"max_tokens": 8, "messages": [{"role": "hacker", "content": "x"}]}, "role"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": "\ud800"}]}, "Unicode"),
        ({"max_tokens": 8, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
        ({"max_tokens": 8, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"max_tokens": 8, "messages": ASK, "tool_choice": {"type": "any"}}, "Tools cannot be empty"),
        ({"max_tokens": 8, "messages": ASK, "tools": [TOOLS[0], TOOLS[0]]}, "unique"),
        ({"max_tokens": 8, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 8}}, "budget_tokens"),
        ({"max_tokens": 8, "messages": ASK, "stop_sequences": [""]}, "stop"),
        ({"max_tokens": 8, "messages": ASK, "stop_sequences": ["x"] * 1000}, "stop"),
    ],
)
def test_bad_input_is_an_anthropic_400(url, body, contains):
    for stream in (False, True):  # streaming is refused before any event
        # json.dumps escapes the lone surrogate, as a client that sends one would
        r = post_raw(
            url,
            "/v1/messages",
            json.dumps({"model": "m", "stream": stream, **body}).encode(),
            "application/json",
            headers={"x-api-key": KEY},
        )
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert contains in err["error"]["message"]
    assert healthy(url)


def test_sdk_raises_bad_request(client):
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="m", max_tokens=8, messages=ASK, extra_body={"temperature": -1})
    assert exc.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("content,ctype", RAW_BAD_BODIES)
def test_hostile_bodies(url, content, ctype):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = post_raw(url, path, content, ctype, headers={"x-api-key": KEY})
        assert 400 <= r.status_code < 500, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert healthy(url)


def test_auth(url):
    bad = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        bad.messages.create(model="m", max_tokens=4, messages=ASK)
    assert exc.value.body["error"]["type"] == "authentication_error"
    body = {"model": "m", "max_tokens": 2, "messages": ASK}
    assert (
        httpx.post(url + "/v1/messages", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60).status_code
        == 200
    )
    assert httpx.post(url + "/v1/messages", json=body, timeout=60).status_code == 401
    # x-api-key is accepted on the OpenAI routes too, and a wrong one there is OpenAI-shaped
    assert httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert "error" in httpx.get(url + "/v1/models", headers={"x-api-key": "no"}).json()


def test_refusals_match_anthropic(client):
    """Anthropic's 400s: temperature outside [0, 1], and a tool_result answering no tool_use of
    the message before."""
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="m", max_tokens=4, messages=ASK, extra_body={"temperature": 1.5})
    assert exc.value.body["error"] == {"type": "invalid_request_error", "message": "temperature: range: 0..1"}
    orphan = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "18 C"}]}]
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="m", max_tokens=4, messages=orphan)
    assert exc.value.body["error"]["message"].startswith(
        "messages.0.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_x."
    )


def test_count_tokens_has_the_generation_bound(client, url):
    """A system prompt past the context's character bound is refused before rendering or
    tokenizing, in Anthropic's shape."""
    ctx = httpx.post(url + "/tokenize", json={"prompt": "x"}, headers={"Authorization": f"Bearer {KEY}"}).json()
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.count_tokens(model="m", messages=ASK, system="a" * (ctx["max_model_len"] * 32 + 1))
    assert exc.value.body["error"]["type"] == "invalid_request_error"
    assert "context length" in exc.value.body["error"]["message"]


def test_system_block_count_is_capped(client):
    """10,000 system blocks took 8.5 s: past --max-system-blocks (256 by default) it is a 400."""
    blocks = [{"type": "text", "text": "Be brief."}] * 257
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="m", max_tokens=2, messages=ASK, system=blocks)
    assert "--max-system-blocks" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="m", messages=ASK, system=blocks)
    assert client.messages.count_tokens(model="m", messages=ASK, system=blocks[:256]).input_tokens > 0
