"""``--tool-call-parser qwen3_coder`` through the OpenAI chat route, in-process on a fake engine
that writes a scripted Qwen3.5-style reply token by token: typed arguments, ``content`` and
``finish_reason``, streamed chunks joining to the non-streamed message."""

from __future__ import annotations

import json

import pytest

REPLY = (
    "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><END>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "Weather?"}],
    "tools": TOOLS,
    "max_tokens": 400,
    "stop": ["<END>"],
}


@pytest.fixture(scope="module")
def http():
    from fastapi.testclient import TestClient

    from fake_engine import fake_app

    app = fake_app(tool_call_parser="qwen3_coder")
    client = app.state.llmkit.client
    ids = client.tokenizer.encode(REPLY, add_special_tokens=False)
    client.token = lambda req, i: ids[min(i, len(ids) - 1)]
    return TestClient(app)


def test_non_streaming_message(http):
    r = http.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Let me check."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    assert calls == [("get_weather", {"city": "São Paulo", "days": 3}), ("get_weather", {"city": "Paris"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg["tool_calls"])


def test_streaming_joins_to_the_message(http):
    whole = http.post("/v1/chat/completions", json=BODY).json()["choices"][0]
    content, calls, finishes = "", {}, []
    with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                content += ch["delta"].get("content") or ""
                for tc in ch["delta"].get("tool_calls") or []:
                    if tc["index"] not in calls:
                        assert tc["id"] and tc["function"]["name"] == "get_weather"
                        calls[tc["index"]] = ["", ""]
                    calls[tc["index"]][0] += tc["function"].get("name") or ""
                    calls[tc["index"]][1] += tc["function"].get("arguments") or ""
                if ch.get("finish_reason"):
                    finishes.append(ch["finish_reason"])
    assert content == whole["message"]["content"]
    assert [tuple(calls[i]) for i in sorted(calls)] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]
    ]
    assert finishes == ["tool_calls"]
