"""The OpenAI Responses API with the official ``openai`` client against a real server (reasoning
test template, qwen3 reasoning parser, hermes tools, local storage), including a restart."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest

from api_utils import RAW_BAD_BODIES, REASONING_ARGS, WEATHER_SCHEMA, healthy, post_raw
from server_utils import start_server, stop_server

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": WEATHER_SCHEMA,
}
ASK = "What's the weather in Paris?"
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
    "additionalProperties": False,
}
NO_THINK = {"effort": "none"}  # the test template thinks by default


class Srv:
    def __init__(self, storage: str) -> None:
        self.storage = storage
        self.start()

    def start(self) -> None:
        self.proc, self.url = start_server(
            [*REASONING_ARGS, "--file-storage-path", self.storage, "--context-length", "2048"]
        )
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Srv(str(tmp_path_factory.mktemp("responses-storage")))
    try:
        yield s
    finally:
        stop_server(s.proc)


@pytest.fixture(scope="module")
def client(srv):
    return srv.client


def _items(resp):
    """Output items without their ids (fresh per call) and the SDK's client-side parsed fields."""
    return [
        {
            k: v
            for k, v in it.model_dump(exclude_none=True).items()
            if k not in ("id", "call_id") and not k.startswith("parsed")
        }
        for it in resp.output
    ]


def _sdk_stream(client, **kw):
    with client.responses.stream(**kw) as stream:
        types = [e.type for e in stream]
        return stream.get_final_response(), types


def _raw_stream(client, **kw):
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events[-1].response, [e.type for e in events]


def test_create_text(client):
    r = client.responses.create(
        model="m",
        input="Say hi",
        instructions="Be brief.",
        max_output_tokens=16,
        temperature=0,
        metadata={"k": "v"},
        user="u1",
        reasoning=NO_THINK,
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "m"
    assert r.output[0].type == "message" and r.output_text and r.metadata == {"k": "v"}
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 16
    u = r.usage
    assert u.input_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("effort", ["none", "high"])
def test_streaming_equals_non_streaming_with_reasoning(client, effort):
    kw = {"model": "m", "input": ASK, "max_output_tokens": 24, "temperature": 0, "reasoning": {"effort": effort}}
    whole = client.responses.create(**kw)
    streamed, types = _raw_stream(client, **kw)
    assert _items(streamed) == _items(whole) and streamed.status == whole.status
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == ("response.incomplete" if whole.status == "incomplete" else "response.completed")
    kinds = [it.type for it in whole.output]
    if effort == "high":  # the template opens <think>; cut by max tokens inside it
        assert kinds[0] == "reasoning" and whole.output[0].content[0].text
        assert whole.usage.output_tokens_details.reasoning_tokens > 0
        assert "response.reasoning_text.delta" in types and "response.reasoning_text.done" in types
    else:
        assert "reasoning" not in kinds and "response.output_text.delta" in types


LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 3}


@pytest.mark.parametrize("effort", ["none", "high"])
def test_output_text_logprobs(client, effort):
    """include=["message.output_text.logprobs"] with top_logprobs (vLLM's test_logprobs): one
    entry a generated token, each with the asked number of alternatives, greedy picking the first;
    streamed deltas carry theirs, and the streamed response equals the non-streamed one."""
    kw = {"model": "m", "input": "Say hi", "max_output_tokens": 6, "temperature": 0, "reasoning": {"effort": effort}}
    plain = client.responses.create(**kw)
    whole = client.responses.create(**kw, **LOGPROBS)
    assert whole.top_logprobs == 3 and plain.top_logprobs == 0
    msg = [it for it in whole.output if it.type == "message"]
    if effort == "high":  # the template thinks first: cut inside the reasoning, no message
        assert not msg
    else:
        assert plain.output[0].content[0].logprobs == []
        lps = msg[0].content[0].logprobs
        assert len(lps) == whole.usage.output_tokens and "".join(e.token for e in lps) == whole.output_text
        for e in lps:
            assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
            assert e.logprob <= 0 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    events = list(client.responses.create(stream=True, **kw, **LOGPROBS))
    assert _items(events[-1].response) == _items(whole)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    if effort == "none":
        assert deltas and all(len(x.top_logprobs) == 3 for e in deltas for x in e.logprobs)
        assert sum(len(e.logprobs) for e in deltas) > 0
        done = next(e for e in events if e.type == "response.output_text.done")
        assert [x.token for x in done.logprobs] == [x.token for x in msg[0].content[0].logprobs]


def test_function_call_round_trip_with_previous_response_id(client):
    kw = {
        "model": "m",
        "input": ASK,
        "tools": [WEATHER],
        "temperature": 0,
        "max_output_tokens": 64,
        "reasoning": NO_THINK,
        "tool_choice": {"type": "function", "name": "get_weather"},
    }
    first = client.responses.create(**kw)
    streamed, types = _sdk_stream(client, **kw)
    assert _items(streamed) == _items(first)
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    follow = client.responses.create(
        model="m",
        previous_response_id=first.id,
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=16,
        reasoning=NO_THINK,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}],
    )
    assert follow.previous_response_id == first.id and follow.output[0].type == "message"
    # the whole conversation was in the prompt
    assert follow.usage.input_tokens > first.usage.input_tokens + 5
    # the same conversation sent by hand gives the same answer
    manual = client.responses.create(
        model="m",
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=16,
        reasoning=NO_THINK,
        input=[
            {"role": "user", "content": ASK},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
        ],
    )
    assert manual.output_text == follow.output_text


def test_required_tool_choice(client):
    r = client.responses.create(
        model="m",
        input=ASK,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=64,
        reasoning=NO_THINK,
    )
    assert [it.type for it in r.output] == ["function_call"] and r.status == "completed"


def test_required_tool_choice_wins_over_text_format(client):
    """instructor's RESPONSES_TOOLS mode sends a forced tool choice and text.format together:
    the call is made (the format governs text answers)."""
    r = client.responses.create(
        model="m",
        input=ASK,
        tools=[WEATHER],
        tool_choice="required",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        temperature=0,
        max_output_tokens=64,
        reasoning=NO_THINK,
    )
    assert [it.type for it in r.output] == ["function_call"] and r.output[0].name == "get_weather"


def test_structured_text_format(client):
    kw = {
        "model": "m",
        # (greedy on this 135M model: "Describe Paris as JSON" runs its population's digits past
        # the token limit; the schema allows that, the JSON parse below does not)
        "input": "Paris as a JSON object",
        "temperature": 0,
        "max_output_tokens": 64,
        "reasoning": NO_THINK,
        "text": {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
    }
    r = client.responses.create(**kw)
    jsonschema.validate(json.loads(r.output_text), CITY)
    streamed, _ = _sdk_stream(client, **kw)
    assert streamed.output_text == r.output_text
    obj = client.responses.create(
        model="m",
        input="A JSON object:",
        temperature=0,
        max_output_tokens=32,
        text={"format": {"type": "json_object"}},
        reasoning=NO_THINK,
    )
    assert isinstance(json.loads(obj.output_text), dict)


def test_retrieve_input_items_delete(client):
    r = client.responses.create(
        model="m",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a fruit."},
        ],
        max_output_tokens=8,
        temperature=0,
        reasoning=NO_THINK,
    )
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    items = client.responses.input_items.list(r.id, order="asc")
    assert [i.role for i in items.data] == ["user", "assistant", "user"]
    assert items.data[2].content[0].text == "Name a fruit."
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    unstored = client.responses.create(model="m", input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def _wait(client, rid, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def test_background_and_cancel(client):
    r = client.responses.create(
        model="m", input="Count to three.", background=True, max_output_tokens=8, temperature=0, reasoning=NO_THINK
    )
    assert r.status == "queued" and r.background
    done = _wait(client, r.id)
    assert done.status in ("completed", "incomplete") and done.output_text
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        client.responses.cancel(client.responses.create(model="m", input="x", max_output_tokens=2).id)
    long = client.responses.create(
        model="m", input="Write a long story.", background=True, max_output_tokens=2000, temperature=0
    )
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"  # idempotent
    with pytest.raises(openai.BadRequestError):  # validated before it is queued
        client.responses.create(model="m", input="x", background=True, max_output_tokens=10**9)


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"input": "x", "extra_body": {"bogus": 1}}, "bogus"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "mcp", "server_label": "s", "server_url": "http://x"}]}, "tools[0].type"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
            "messages[0].content[0]",
        ),
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
        ({"input": [{"role": "hacker", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),
        ({"input": "x", "temperature": -1}, "temperature"),
        ({"input": "x", "top_p": 2}, "top_p"),
        ({"input": "x", "top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
        ({"input": "x", "top_logprobs": -1}, "top_logprobs"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": "x", "background": True, "stream": True}, "background"),
        ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ],
)
def test_bad_input_is_an_openai_400(srv, kw, param):
    with pytest.raises(openai.BadRequestError) as exc:
        srv.client.responses.create(model="m", **kw)
    assert exc.value.body["param"] == param, exc.value.body
    assert healthy(srv.url)


def test_unknown_previous_response_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model="m", input="x", previous_response_id="resp_" + "0" * 32)
    assert exc.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("../../etc/passwd")


def test_refusals_match_openai(client):
    """Where OpenAI refuses, with its status and words: a malformed id (not a 404), an output
    answering no call, and continuing from a response that is still running."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="m", input="x", previous_response_id="bad", max_output_tokens=2)
    assert exc.value.body["param"] == "previous_response_id"
    assert exc.value.body["message"] == "Invalid 'previous_response_id': 'bad'. Expected an ID that begins with 'resp'."
    orphan = [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "call_x", "output": "1"}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="m", input=orphan, max_output_tokens=2)
    assert exc.value.body["param"] == "input"
    assert exc.value.body["message"] == "No tool call found for function call output with call_id call_x."
    running = client.responses.create(
        model="m", input="Write a long story.", background=True, max_output_tokens=2000, temperature=0
    )
    try:
        with pytest.raises(openai.BadRequestError) as exc:
            client.responses.create(model="m", input="go on", previous_response_id=running.id, max_output_tokens=2)
        assert exc.value.body["param"] == "previous_response_id" and "still" in exc.value.body["message"]
    finally:
        assert client.responses.cancel(running.id).status == "cancelled"


def test_truncation_auto_drops_the_oldest_turns(client):
    ctx = client.models.list().data[0].model_extra["max_model_len"]
    big = "word " * (ctx * 6 // 10)  # two of these are over the context, one fits
    conv = [
        {"role": "user", "content": big},
        {"role": "assistant", "content": big},
        {"role": "user", "content": "Say hi."},
    ]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input=conv, max_output_tokens=4)
    r = client.responses.create(model="m", input=conv, max_output_tokens=4, truncation="auto")
    assert r.status in ("completed", "incomplete") and ctx // 2 < r.usage.input_tokens < ctx


def test_lone_surrogate(srv):
    r = post_raw(srv.url, "/v1/responses", json.dumps({"model": "m", "input": "\ud800"}).encode(), "application/json")
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


@pytest.mark.parametrize("content,ctype", RAW_BAD_BODIES)
def test_hostile_bodies(srv, content, ctype):
    r = post_raw(srv.url, "/v1/responses", content, ctype)
    assert 400 <= r.status_code < 500 and "error" in r.json()
    assert healthy(srv.url)


def test_stored_response_survives_a_restart(srv):
    """The last test using the module server: it restarts it on the same storage."""
    r = srv.client.responses.create(model="m", input="Remember the number 7.", max_output_tokens=8, temperature=0)
    stop_server(srv.proc)
    srv.start()
    got = srv.client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    follow = srv.client.responses.create(
        model="m", previous_response_id=r.id, input="Which number?", max_output_tokens=4, temperature=0
    )
    assert follow.usage.input_tokens > r.usage.input_tokens
    assert srv.client.responses.input_items.list(r.id).data[0].content[0].text == "Remember the number 7."


def test_stored_responses_on_s3_survive_a_kill(tmp_path):
    """The s3 storage plugin (moto's server on loopback) keeps responses across a kill -9."""
    pytest.importorskip("moto.server")
    from s3_utils import make_bucket, moto_endpoint
    from server_utils import kill_server

    with moto_endpoint() as endpoint:
        make_bucket(endpoint, "llmkit-responses")
        args = [
            "--batch-storage",
            "s3",
            "--storage-option",
            "bucket=llmkit-responses",
            "--storage-option",
            f"endpoint_url={endpoint}",
        ]
        proc, url = start_server(args)
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
            r = client.responses.create(model="m", input="Hi", max_output_tokens=4, temperature=0)
        finally:
            kill_server(proc)
        proc, url = start_server(args)
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
            assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
            client.responses.delete(r.id)
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(r.id)
        finally:
            stop_server(proc)


def test_store_on_a_backend_without_records_is_refused_before_generating(tmp_path):
    from fastapi.testclient import TestClient

    from llmkit.core.batches.storage import StorageBackend
    from llmkit.plugins.storage.local import LocalStorage

    from fake_engine import fake_app

    class FilesOnly(LocalStorage):  # a backend written before records existed
        put_record = StorageBackend.put_record
        get_record = StorageBackend.get_record

    app = fake_app(storage=FilesOnly(str(tmp_path)))
    with TestClient(app) as http:
        for extra in ({}, {"store": True}, {"background": True}):
            r = http.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == "store", r.text
        assert app.state.llmkit.client.submitted == []  # nothing was generated
        r = http.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2, "store": False})
        assert r.status_code == 200, r.text
