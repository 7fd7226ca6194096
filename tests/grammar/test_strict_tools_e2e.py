"""Strict tool calling and structural tags end to end: one ``llmkit serve`` of the embedded model
with ``--tool-call-parser hermes --disable-strict-tool-calls``, so tools sent with ``strict: true``
are constrained and the same tools without it are not (the default, strict for every tool, is the
first case for all tools; benchmarks/bench_strict_tools.py measures it)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from server_utils import start_server, stop_server
from tests.conftest import Server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# Two example turns that call tools, then a question that wants one (the measurement).
MESSAGES = [
    {"role": "user", "content": "What's the weather in Paris?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
    },
    {"role": "user", "content": "What time is it in Tokyo?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n</tool_call>',
    },
    {"role": "user", "content": "And the weather in Berlin?"},
]


def _tools(strict: bool) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {"name": n, "description": n.replace("_", " "), "parameters": s, "strict": strict},
        }
        for n, s in SCHEMAS.items()
    ]


@pytest.fixture(scope="module")
def sserver():
    proc, url = start_server(["--tool-call-parser", "hermes", "--disable-strict-tool-calls", "--batch-storage", "none"])
    try:
        yield Server(proc, url)
    finally:
        stop_server(proc)


def _failures(choices) -> tuple[int, int]:
    """(choices whose content kept an unparsed call or whose calls fail their schema, calls made)"""
    failed = calls = 0
    for ch in choices:
        bad = "<tool_call>" in (ch.message.content or "")
        for tc in ch.message.tool_calls or []:
            calls += 1
            try:
                jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS[tc.function.name])
            except (ValueError, KeyError, jsonschema.ValidationError):
                bad = True
        failed += bad
    return failed, calls


def _sample(server, strict: bool, seeds, **kw):
    choices = []
    for seed in seeds:  # n=10 choices share one prompt and decode as one batch
        r = server.client.chat.completions.create(
            model="m", messages=MESSAGES, tools=_tools(strict), temperature=1, seed=seed, n=10, max_tokens=40, **kw
        )
        choices += r.choices
    return choices


def test_strict_calls_always_parse_and_validate(sserver):
    """20 choices at temperature 1 (the benchmark runs 200): every call parses and validates;
    unconstrained ones do not."""
    choices = _sample(sserver, True, range(2))
    failed, calls = _failures(choices)
    assert failed == 0 and calls >= 10, (failed, calls)
    assert all(ch.finish_reason == "tool_calls" for ch in choices if ch.message.tool_calls)
    failed, _ = _failures(_sample(sserver, False, [100]))
    assert failed > 0, "the unconstrained run should fail sometimes, or this test shows nothing"


def test_parallel_tool_calls_false_allows_one_call(sserver):
    choices = _sample(sserver, True, [7], parallel_tool_calls=False)
    assert _failures(choices)[0] == 0
    assert all(len(ch.message.tool_calls or []) <= 1 for ch in choices)


def test_stream_equals_non_stream(sserver):
    kw = dict(model="m", messages=MESSAGES, tools=_tools(True), temperature=1, seed=3, max_tokens=40)
    whole = sserver.client.chat.completions.create(**kw).choices[0]
    content, calls, finish = "", {}, None
    for chunk in sserver.client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    want = [[tc.function.name, tc.function.arguments] for tc in whole.message.tool_calls or []]
    assert [calls[i] for i in sorted(calls)] == want and want
    assert (content or None) == whole.message.content and finish == whole.finish_reason


FORCED = {"type": "structural_tag", "format": {"type": "const_string", "value": "Bonjour"}}
LEGACY = {
    "type": "structural_tag",
    "structures": [{"begin": "<city>", "schema": {"type": "string"}, "end": "</city>"}],
    "triggers": ["<city>"],
}
BAD = {"type": "structural_tag", "structures": [{"begin": "<city>", "end": "</city>"}], "triggers": ["<city>"]}
ROUTES = {  # route, the body with a response format, where its text comes back, the error's param
    "chat": (
        "/v1/chat/completions",
        lambda rf: {
            "model": "m",
            "messages": [{"role": "user", "content": "Hi"}],
            "response_format": rf,
            "max_tokens": 16,
        },
        lambda r: r["choices"][0]["message"]["content"],
        "response_format",
    ),
    "completions": (
        "/v1/completions",
        lambda rf: {"model": "m", "prompt": "Hi", "response_format": rf, "max_tokens": 16},
        lambda r: r["choices"][0]["text"],
        "response_format",
    ),
    "responses": (
        "/v1/responses",
        lambda rf: {"model": "m", "input": "Hi", "text": {"format": rf}, "max_output_tokens": 16},
        lambda r: r["output"][-1]["content"][0]["text"],
        "text.format",
    ),
    "generate": (
        "/generate",
        lambda rf: {"text": "Hi", "sampling_params": {"structural_tag": json.dumps(rf), "max_new_tokens": 16}},
        lambda r: r["text"],
        "structural_tag",
    ),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_structural_tag_on_every_route(sserver, route):
    path, body, text, param = ROUTES[route]
    with sserver.http() as http:
        r = http.post(path, json={"temperature": 0, **body(FORCED)})
        assert r.status_code == 200, r.text
        assert text(r.json()) == "Bonjour"
        assert http.post(path, json=body(LEGACY)).status_code == 200
        bad = http.post(path, json=body(BAD))
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == param and "schema" in error["message"] and error["type"] == "invalid_request_error"
