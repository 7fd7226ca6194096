"""vLLM's /tokenize and /detokenize, SGLang's /generate, /version and /v1/models' max_model_len,
against a real server over httpx."""

from __future__ import annotations

import json

import openai
import pytest

from server_utils import start_server, stop_server
from tests.conftest import Server

MSGS = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def srv():
    proc, url = start_server(["--batch-storage", "none"])
    try:
        yield Server(proc, url)
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def http(srv):
    with srv.http() as c:
        yield c


def test_tokenize_prompt_and_detokenize_roundtrip(http):
    r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] > 0
    assert len(r["token_strs"]) == r["count"]
    assert http.post("/v1/detokenize", json={"tokens": r["tokens"]}).json()["prompt"].endswith("Hello world")
    alias = http.post("/v1/tokenize", json={"prompt": "Hello world"}).json()
    assert alias["tokens"] == r["tokens"] and alias["token_strs"] is None


def test_tokenize_messages_counts_the_chat_prompt(http, srv):
    tok = http.post("/tokenize", json={"messages": MSGS}).json()
    chat = srv.client.chat.completions.create(model="m", messages=MSGS, max_tokens=1, temperature=0)
    assert tok["count"] == chat.usage.prompt_tokens
    no_gen = http.post("/tokenize", json={"messages": MSGS, "add_generation_prompt": False}).json()
    assert no_gen["count"] < tok["count"] and tok["tokens"][: no_gen["count"]] == no_gen["tokens"]


def test_tokenize_and_detokenize_have_the_generation_bounds(http):
    """Past the context's character bound the tokenizer never runs; past the context in tokens
    the answer (ids, token strings, decoded text) is refused rather than sent."""
    ctx = http.post("/tokenize", json={"prompt": "x"}).json()["max_model_len"]
    huge = "a" * (ctx * 32 + 1)
    for body, param in (({"prompt": huge}, "prompt"), ({"messages": [{"role": "user", "content": huge}]}, "messages")):
        r = http.post("/tokenize", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
        assert r.json()["error"]["code"] == "context_length_exceeded"
    r = http.post("/tokenize", json={"prompt": "a " * (ctx + 1), "return_token_strs": True})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text[:300]
    r = http.post("/detokenize", json={"tokens": [1] * (ctx + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text[:300]
    assert http.post("/detokenize", json={"tokens": [1] * 3000}).status_code == 200  # decoded off the loop


def test_prompt_logprobs_are_capped(http, srv):
    """Prompt logprobs are a vocabulary-wide softmax per prompt token (2,000 took 6.7 s): past
    --max-prompt-logprobs-tokens (1024 by default) a request is a 400, not seconds of CPU."""
    long = "word " * 1100
    body = {"text": long, "return_logprob": True, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 1}}
    r = http.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_logprob", r.text[:300]
    assert "--max-prompt-logprobs-tokens" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        srv.client.completions.create(model="m", prompt=long, echo=True, logprobs=1, max_tokens=1)
    assert exc.value.param == "echo"
    ok = srv.client.completions.create(model="m", prompt=long, logprobs=1, max_tokens=1)  # no prompt logprobs
    assert ok.choices[0].logprobs.tokens


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MSGS}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/generate", {"text": "hi", "input_ids": [1]}, "text"),
        ("/generate", {"text": ""}, "text"),
        ("/generate", {"input_ids": [10**9]}, "input_ids"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
        ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        ("/generate", {"text": "hi", "sampling_params": {"regex": "(a+)+$", "ebnf": "x"}}, "regex"),
        ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_bad_bodies(http):
    assert http.post("/generate", content=b'{"text":', headers={"content-type": "application/json"}).status_code == 400
    assert http.post("/tokenize", content=b"[1]", headers={"content-type": "application/json"}).status_code == 400
    assert http.get("/health").status_code == 200


def test_version_and_models(http):
    assert http.get("/version").json()["version"]
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] > 0


def test_generate_text_and_ids_agree(http):
    sp = {"max_new_tokens": 8, "temperature": 0}
    a = http.post("/generate", json={"text": "The capital of France is", "sampling_params": sp}).json()
    ids = http.post("/tokenize", json={"prompt": "The capital of France is", "add_special_tokens": False}).json()
    b = http.post("/generate", json={"input_ids": ids["tokens"], "sampling_params": sp}).json()
    assert a["text"] == b["text"] and a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 8
    m = a["meta_info"]
    assert m["prompt_tokens"] == ids["count"] and m["completion_tokens"] == 8
    assert m["finish_reason"] == {"type": "length", "length": 8}
    assert m["e2e_latency"] > 0 and m["cached_tokens"] >= 0
    assert b["meta_info"]["cached_tokens"] > 0  # the same prompt again hits the prefix cache


def test_generate_batch_stop_and_logprobs(http):
    body = {
        "text": ["1, 2, 3,", "Hello"],
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "stop": [" 5"]},
    }
    out = http.post("/generate", json=body).json()
    assert isinstance(out, list) and len(out) == 2
    m = out[0]["meta_info"]
    assert len(m["output_token_logprobs"]) == m["completion_tokens"] == len(out[0]["output_ids"])
    assert all(len(t) == 2 for t in m["output_top_logprobs"])
    lp, tid, text = m["output_token_logprobs"][0]
    assert lp <= 0 and tid == out[0]["output_ids"][0] and isinstance(text, str)
    assert m["input_token_logprobs"][0][0] is None and len(m["input_token_logprobs"]) == m["prompt_tokens"]
    if m["finish_reason"]["type"] == "stop":
        assert m["finish_reason"]["matched"] == " 5"


def test_generate_constrained(http):
    r = http.post(
        "/generate",
        json={
            "text": "Pick a number:",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "regex": "[0-9]{3}"},
        },
    ).json()
    assert len(r["text"]) == 3 and r["text"].isdigit()
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    r = http.post(
        "/generate",
        json={"text": "JSON:", "sampling_params": {"max_new_tokens": 32, "temperature": 0, "json_schema": schema}},
    ).json()
    assert isinstance(json.loads(r["text"])["a"], int)


def _stream(http, body) -> list[dict]:
    chunks = []
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert chunks
    return chunks


def test_generate_streaming_equals_non_streaming(http):
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    whole = http.post("/generate", json=body).json()
    chunks = _stream(http, body)
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    batch = _stream(http, {**body, "text": ["Once upon a time", "Hi"]})
    last = {}
    for c in batch:
        last[c["index"]] = c
    assert last[0]["text"] == whole["text"] and set(last) == {0, 1}


def test_streaming_bad_input_is_a_plain_400(http):
    r = http.post("/generate", json={"text": "x", "stream": True, "sampling_params": {"top_p": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"


def test_duplicate_rid_in_flight_is_a_400_and_leaks_nothing(srv):
    """A second /generate under the rid of one still running used to take over its engine stream:
    the first hung forever and its slot leaked. Now it is a 400, and the rid is free again once
    the first ends."""
    import httpx

    body = {"text": "Count: 1, 2, 3,", "rid": "dup-1", "stream": True}
    body["sampling_params"] = {"max_new_tokens": 48, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        with c.stream("POST", "/generate", json=body) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # it is running
            second = c.post("/generate", json={**body, "stream": False})
            assert second.status_code == 400, second.text
            assert second.json()["error"]["param"] == "rid" and "dup-1" in second.json()["error"]["message"]
            last = [line for line in lines if line.startswith("data: ")]
        assert last[-1] == "data: [DONE]"
        assert json.loads(last[-2][6:])["meta_info"]["finish_reason"]["type"] == "length"
        again = c.post("/generate", json={**body, "stream": False, "sampling_params": {"max_new_tokens": 2}})
        assert again.status_code == 200, again.text
        assert c.get("/get_server_info").json()["num_running_reqs"] == 0
