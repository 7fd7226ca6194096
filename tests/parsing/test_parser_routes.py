"""POST /separate_reasoning and /parse_function_call on an app with only the parser router."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from llmkit.core.server.sglang.parsers import parser_router


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    app.include_router(parser_router())
    return TestClient(app)


def test_separate_reasoning(client):
    r = client.post(
        "/separate_reasoning",
        json={"text": "<think>\nLet me think.\n</think>\n\nIt is 42.", "reasoning_parser": "qwen3"},
    )
    assert r.status_code == 200
    assert r.json() == {"reasoning_text": "Let me think.", "text": "It is 42."}


def test_separate_reasoning_forced_and_prompt(client):
    body = {"text": "thinking…</think>answer", "reasoning_parser": "deepseek-r1"}
    assert client.post("/separate_reasoning", json=body).json() == {
        "reasoning_text": "thinking…",
        "text": "answer",
    }
    body = {"text": "r</think>a", "reasoning_parser": "qwen3", "prompt": "<think>\n\n</think>\n\n"}
    assert client.post("/separate_reasoning", json=body).json() == {
        "reasoning_text": "",
        "text": "r</think>a",
    }


def test_parse_function_call(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    r = client.post("/parse_function_call", json={"text": text, "tool_call_parser": "hermes", "tools": tools})
    assert r.status_code == 200
    out = r.json()
    assert out["normal_text"] == "Checking."
    assert [(c["name"], json.loads(c["parameters"])) for c in out["calls"]] == [("get_weather", {"city": "Paris"})]
    assert out["calls"][0]["tool_index"] == 0


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/separate_reasoning", {"text": "x", "reasoning_parser": "nope"}, "reasoning_parser"),
        (
            "/parse_function_call",
            {"text": "x", "tool_call_parser": "nope", "tools": []},
            "tool_call_parser",
        ),
    ],
)
def test_unknown_parser_is_400_with_openai_error(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert "nope" in err["message"] and "valid names" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
