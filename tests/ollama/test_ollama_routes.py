"""The Ollama routes in-process over the fake engine (deterministic tokens, no model): the NDJSON
stream folds to the whole reply, Ollama's error shape on every failure (the key check's too), the
model routes' shapes."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from fake_engine import fake_app

ASK = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def http(fake_server):
    return fake_server.http()


def _lines(r) -> list[dict]:
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in r.text.splitlines()]


def test_stream_folds_to_the_whole_reply(http):
    body = {"model": "m", "messages": ASK, "options": {"num_predict": 6}}
    whole = http.post("/api/chat", json={**body, "stream": False}).json()
    lines = _lines(http.post("/api/chat", json=body))  # stream is Ollama's default
    assert "".join(x["message"]["content"] for x in lines) == whole["message"]["content"] != ""
    assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
    last = lines[-1]
    assert last["done_reason"] == whole["done_reason"] == "length" and last["eval_count"] == whole["eval_count"] == 6
    for key in ("total_duration", "prompt_eval_duration", "eval_duration", "prompt_eval_count", "created_at"):
        assert key in last and key in whole
    gen = http.post("/api/generate", json={"model": "m", "prompt": "Hi", "options": {"num_predict": 4}})
    pieces = _lines(gen)
    assert "".join(p["response"] for p in pieces) and pieces[-1]["eval_count"] == 4


def test_stop_ends_with_done_reason_stop(http):
    first = http.post(
        "/api/generate", json={"model": "m", "prompt": "Hi", "stream": False, "options": {"num_predict": 6}}
    )
    word = first.json()["response"].split()[2]
    stopped = http.post(
        "/api/generate",
        json={"model": "m", "prompt": "Hi", "stream": False, "options": {"num_predict": 6, "stop": [word]}},
    ).json()
    assert stopped["done_reason"] == "stop" and word not in stopped["response"]


@pytest.mark.parametrize(
    "path,body,status,error",
    [
        ("/api/chat", {"model": "nope", "messages": ASK}, 404, "model 'nope' not found"),
        ("/api/generate", {"model": "nope:7b", "prompt": "x"}, 404, "model 'nope:7b' not found"),
        ("/api/show", {"model": "nope"}, 404, "model 'nope' not found"),
        ("/api/chat", {"messages": ASK}, 400, "model: Field required"),
        (
            "/api/chat",
            {"model": "m", "messages": ASK, "options": {"bogus": 1}},
            400,
            "options.bogus is not a known option",
        ),
        ("/api/chat", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ("/api/embed", {"model": "m", "input": "x"}, 400, None),  # a generative model does not embed
    ],
)
def test_errors_in_ollama_shape(http, path, body, status, error):
    r = http.post(path, json=body)
    assert r.status_code == status and set(r.json()) == {"error"}
    if error is not None:
        assert r.json()["error"] == error


def test_bad_json_and_a_missing_key_in_ollama_shape(http):
    r = http.post("/api/chat", content=b'{"model":', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    with TestClient(fake_app(api_keys=("sk-1",))) as keyed:
        r = keyed.post("/api/chat", json={"model": "m", "messages": ASK})
        assert r.status_code == 401 and set(r.json()) == {"error"}
        ok = keyed.post(
            "/api/chat",
            json={"model": "m", "messages": ASK, "stream": False, "options": {"num_predict": 2}},
            headers={"Authorization": "Bearer sk-1"},
        )
        assert ok.status_code == 200


def test_nothing_to_generate_loads_or_unloads(http):
    assert http.post("/api/generate", json={"model": "m"}).json()["done_reason"] == "load"
    r = http.post("/api/chat", json={"model": "m:latest", "messages": [], "keep_alive": 0}).json()
    assert r["done_reason"] == "unload" and r["message"] == {"role": "assistant", "content": ""}


def test_model_routes(http):
    names = [m["name"] for m in http.get("/api/tags").json()["models"]]
    assert names == ["fake-model:latest", "m:latest"]
    ps = http.get("/api/ps").json()["models"]
    assert ps[0]["context_length"] == 8192 and ps[0]["expires_at"]
    show = http.post("/api/show", json={"name": "m:latest"}).json()  # the older field name
    assert show["capabilities"][0] == "completion" and show["template"]
    assert http.get("/api/version").json()["version"]
    assert http.post("/api/pull", json={"model": "m"}).json() == {"status": "success"}
    r = http.post("/api/pull", json={"model": "llama3"})
    assert r.status_code == 400 and "does not download models" in r.json()["error"]


def test_logprobs_when_asked(http):
    body = {"model": "m", "messages": ASK, "logprobs": True, "top_logprobs": 1, "options": {"num_predict": 4}}
    whole = http.post("/api/chat", json={**body, "stream": False}).json()
    lps = whole["logprobs"]
    assert len(lps) == 4 and "".join(x["token"] for x in lps) == whole["message"]["content"]
    assert all(x["logprob"] <= 0 and len(x["top_logprobs"]) == 1 for x in lps)
    streamed = [x for line in _lines(http.post("/api/chat", json=body)) for x in line.get("logprobs", [])]
    assert streamed == lps
    plain = http.post("/api/chat", json={**body, "logprobs": False, "top_logprobs": None, "stream": False}).json()
    assert "logprobs" not in plain


def test_raw_generate_streams_what_it_answers_whole(http):
    body = {"model": "m", "prompt": "<fim_prefix>def f(", "raw": True, "options": {"num_predict": 5}}
    whole = http.post("/api/generate", json={**body, "stream": False}).json()
    ref = http.post("/v1/completions", json={"model": "m", "prompt": body["prompt"], "max_tokens": 5}).json()
    assert whole["response"] == ref["choices"][0]["text"] and whole["eval_count"] == 5
    lines = _lines(http.post("/api/generate", json=body))
    assert len(lines) > 2 and "".join(x["response"] for x in lines) == whole["response"]
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 5
    assert lines[-1]["prompt_eval_count"] == whole["prompt_eval_count"] > 0
