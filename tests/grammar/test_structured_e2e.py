"""Structured outputs end to end: the embedded model behind the real server, through ``openai``.

Needs the ``server`` fixture from conftest.py (an object with ``.client``, an ``openai.OpenAI``);
every test here is skipped while that fixture does not exist.
"""

from __future__ import annotations

import io
import json
import re
import time

import jsonschema
import openai
import pytest

from grammar_schemas import CASES

MODEL = "m"  # the short name the test servers serve as an alias
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@pytest.fixture(scope="module")
def client(request) -> openai.OpenAI:
    try:
        server = request.getfixturevalue("server")
    except pytest.FixtureLookupError:
        pytest.skip("no `server` fixture (tests/conftest.py) yet")
    return server.client


def _chat(client, prompt: str, **kwargs):
    kwargs.setdefault("max_tokens", 200)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kwargs)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_json_schema_outputs_validate(client, index):
    what, schema = CASES[index]
    resp = _chat(client, f"Give me {what} as JSON.", response_format=_schema_format(schema))
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_mode(client):
    resp = _chat(client, "Describe a cat as a JSON object.", response_format={"type": "json_object"}, max_tokens=60)
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a valid JSON prefix starting an object
        assert resp.choices[0].message.content.startswith("{")


def test_ebnf(client):
    resp = _chat(client, "Greet me.", extra_body={"ebnf": 'root ::= "Hello" | "Hi" | "Hey"'})
    assert resp.choices[0].message.content in {"Hello", "Hi", "Hey"}


@pytest.mark.parametrize("pattern", [DATE, PHONE], ids=["date", "phone"])
def test_regex_matches_in_full(client, pattern):
    resp = _chat(client, "When and how can I reach you?", extra_body={"regex": pattern})
    assert re.fullmatch(pattern, resp.choices[0].message.content)
    comp = client.completions.create(
        model=MODEL, prompt="Contact:", max_tokens=30, temperature=0, extra_body={"regex": pattern}
    )
    assert re.fullmatch(pattern, comp.choices[0].text)


def test_completions_json_schema_string(client):
    schema = CASES[0][1]
    comp = client.completions.create(
        model=MODEL,
        prompt="A person as JSON:",
        max_tokens=100,
        temperature=0,
        extra_body={"json_schema": json.dumps(schema)},
    )
    jsonschema.validate(json.loads(comp.choices[0].text), schema)


def test_streaming_equals_non_streaming(client):
    schema = CASES[6][1]
    kwargs = dict(response_format=_schema_format(schema))
    full = _chat(client, "Give me a book as JSON.", **kwargs).choices[0].message.content
    stream = _chat(client, "Give me a book as JSON.", stream=True, **kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == full
    jsonschema.validate(json.loads(streamed), schema)


def test_n_greater_than_one(client):
    schema = CASES[17][1]
    resp = _chat(
        client, "Weather report as JSON.", n=3, temperature=0.9, seed=1, response_format=_schema_format(schema)
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    for choice in resp.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_constrained_and_free_requests_share_a_batch(client):
    from concurrent.futures import ThreadPoolExecutor

    schema = CASES[2][1]
    with ThreadPoolExecutor(6) as pool:
        futures = [
            pool.submit(
                _chat, client, "Pick a colour.", **({"response_format": _schema_format(schema)} if i % 2 else {})
            )
            for i in range(6)
        ]
        results = [f.result() for f in futures]
    for i, resp in enumerate(results):
        if i % 2:
            jsonschema.validate(json.loads(resp.choices[0].message.content), schema)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"regex": "(abc"}, "regex"),
        ({"ebnf": "root ::= nope"}, "ebnf"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            "response_format",
        ),
        ({"regex": "(a+)+$"}, "regex"),
        ({"regex": "a" * (1 << 20)}, "regex"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"enum": list(range(100_000))}},
                }
            },
            "response_format",
        ),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, None),
    ],
    ids=["bad-regex", "bad-ebnf", "bad-schema", "redos", "1mb-regex", "100k-enum", "two-constraints"],
)
def test_bad_constraints_are_400_and_server_keeps_serving(client, extra, param):
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, "hi", max_tokens=5, extra_body=extra)
    assert time.monotonic() - start < 5.0
    if param is not None:
        assert info.value.param == param
    assert _chat(client, "Say hi.", max_tokens=3).choices[0].message.content is not None  # canary


def test_batch_lines_with_schemas(client):
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Give me {what} as JSON."}],
                "max_tokens": 200,
                "temperature": 0,
                "response_format": _schema_format(schema),
            },
        }
        for i, (what, schema) in enumerate(CASES[:4])
    ]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    try:
        upload = client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
    except openai.NotFoundError:
        pytest.skip("the server has no /v1/files yet")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.output_file_id, batch
    results = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines() if line]
    assert sorted(r["custom_id"] for r in results) == [f"line-{i}" for i in range(4)]
    for r in results:
        schema = CASES[int(r["custom_id"].split("-")[1])][1]
        jsonschema.validate(json.loads(r["response"]["body"]["choices"][0]["message"]["content"]), schema)
