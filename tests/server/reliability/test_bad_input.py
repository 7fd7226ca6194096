"""Hostile and malformed input (reliability catalogue §3, reference §1.3): every case gets an
OpenAI-shaped 4xx, and the server keeps serving afterwards.

Validation happens before the engine sees a request, so these run in-process on the real app over
a FakeEngineClient (``fake_server``); the end-to-end checks on the real model are elsewhere."""

from __future__ import annotations

import pytest

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
OK_MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(fake_server):
    with fake_server.http() as client:
        yield client


def _post(client, path, body=None, content=None, headers=None):
    return client.post(path, json=body, content=content, headers=headers)


def _assert_error(resp, status=400, param=None, contains=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err


@pytest.fixture(autouse=True)
def canary(server):
    """After every hostile case, a normal request still succeeds."""
    yield
    r = _post(server, CHAT, {"model": "m", "messages": OK_MSG, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "content,status",
    [
        (b'{"model":', 400),
        (b"[1, 2]", 400),
        (b"42", 400),
        (b"null", 400),
        (b'"string"', 400),
        (b"\xff\xfe{}", 400),
        (b"[" * 100000 + b"]" * 100000, 400),
    ],
)
def test_malformed_bodies(server, content, status):
    _assert_error(_post(server, CHAT, content=content, headers={"content-type": "application/json"}), status)


def test_wrong_content_type(server):
    _assert_error(_post(server, CHAT, content=b"hello", headers={"content-type": "text/plain"}), 415)


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("max_tokens", "10", "max_tokens"),
        ("messages", {}, "messages"),
        ("temperature", "hot", "temperature"),
        ("temperature", -1, "temperature"),
        ("top_p", 1.5, "top_p"),
        ("top_p", 0, "top_p"),
        ("top_k", 0, "top_k"),
        ("top_k", -2, "top_k"),
        ("min_p", 2, "min_p"),
        ("frequency_penalty", 3, "frequency_penalty"),
        ("presence_penalty", -2.5, "presence_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("n", 0, "n"),
        ("n", 10000, "n"),
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", -1, "max_tokens"),
        ("max_tokens", 10**12, "max_tokens"),
        ("seed", 2**70, "seed"),
        ("stop", [""], "stop"),
        ("stop", ["x"] * 1000, "stop"),
        ("stop", "y" * 1_000_000, "stop"),
        ("logit_bias", {"99999999": 1}, "logit_bias"),
        ("logit_bias", {"-1": 1}, "logit_bias"),
        ("logit_bias", {"abc": 1}, "logit_bias"),
        ("logit_bias", {"5": 1000}, "logit_bias"),
        ("stop_token_ids", [10**9], "stop_token_ids"),
        ("top_logprobs", 1000000, "top_logprobs"),
        ("min_tokens", 100, "min_tokens"),
    ],
)
def test_out_of_range_fields(server, field, value, param):
    body = {"model": "m", "messages": OK_MSG, "max_tokens": 8 if field != "min_tokens" else 8}
    if field == "top_logprobs":
        body["logprobs"] = True
    body[field] = value
    _assert_error(_post(server, CHAT, body), 400, param=param)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_numbers(server, literal):
    content = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":' + literal + b"}"
    _assert_error(_post(server, CHAT, content=content, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize(
    "messages,param",
    [
        ([], "messages"),
        ([{"content": "hi"}], "messages.0.role"),
        ([{"role": "hacker", "content": "hi"}], "messages.0.role"),
        ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
            "messages[0].content[0]",
        ),
    ],
)
def test_bad_messages(server, messages, param):
    _assert_error(_post(server, CHAT, {"model": "m", "messages": messages}), 400, param=param)


def test_lone_surrogate(server):
    content = b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}'
    _assert_error(_post(server, CHAT, content=content, headers={"content-type": "application/json"}), 400)


def test_context_length(server):
    long = "hello " * 9000
    _assert_error(
        _post(server, CHAT, {"model": "m", "messages": [{"role": "user", "content": long}]}),
        400,
        contains="longer than the model's context length",
    )
    _assert_error(
        _post(server, CHAT, {"model": "m", "messages": OK_MSG, "max_tokens": 8190}),
        400,
        contains="Requested token count exceeds the model's maximum context length",
    )


@pytest.mark.parametrize(
    "prompt,param",
    [
        ("", "prompt"),
        ([], "prompt"),
        ([[]], "prompt"),
        ([-1, 5], "prompt"),
        ([10**7], "prompt"),
        (["a"] * 100000, "prompt"),
    ],
)
def test_bad_completion_prompts(server, prompt, param):
    _assert_error(_post(server, COMP, {"model": "m", "prompt": prompt, "max_tokens": 2}), 400, param=param)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tokenize": True},
        {"chat_template": "{{ 1 }}"},
        {"nested": {"a": 1}},
    ],
)
def test_chat_template_kwargs_allowlist(server, kwargs):
    body = {"model": "m", "messages": OK_MSG, "chat_template_kwargs": kwargs}
    _assert_error(_post(server, CHAT, body), 400, param="chat_template_kwargs")


@pytest.mark.parametrize(
    "tools,choice,contains",
    [
        (None, "required", "Tools cannot be empty"),
        (None, {"type": "function", "function": {"name": "f"}}, "Tools cannot be empty"),
        (
            [{"type": "function", "function": {"name": "g"}}],
            {"type": "function", "function": {"name": "f"}},
            "Tool 'f' not found",
        ),
    ],
)
def test_tool_choice_validation(server, tools, choice, contains):
    body = {"model": "m", "messages": OK_MSG, "tool_choice": choice}
    if tools:
        body["tools"] = tools
    _assert_error(_post(server, CHAT, body), 400, contains=contains)


def test_unknown_fields_are_ignored(server):
    r = _post(server, CHAT, {"model": "m", "messages": OK_MSG, "max_tokens": 2, "frobnicate": True})
    assert r.status_code == 200


def test_streaming_validation_error_is_plain_400(server):
    r = _post(server, CHAT, {"model": "m", "messages": OK_MSG, "stream": True, "temperature": -1})
    _assert_error(r, 400, param="temperature")
