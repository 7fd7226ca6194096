"""Ollama's API with the official ``ollama`` client against a real server (the reasoning test
template, qwen3 reasoning parser, llama3 tool parser): chat, generate, streams, structured
``format``, ``think``, tools, the model routes, and embeddings from an embedding server. Every
greedy output equals the OpenAI route's for the same request."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import openai
import pytest

from llmkit.core.model.loader.embedded_encoder import ENCODER_NAME

from api_utils import THINK_TEMPLATE, WEATHER_SCHEMA
from server_utils import start_server, stop_server

ARGS = ["--chat-template", str(THINK_TEMPLATE), "--reasoning-parser", "qwen3", "--tool-call-parser", "llama3"]
GREEDY = {"temperature": 0, "num_predict": 8}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA}}
]
# A reply shaped as a llama3 tool call, which the tool parser reads as one
CALL_FORMAT = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER_SCHEMA},
    "required": ["name", "parameters"],
}


@pytest.fixture(scope="module")
def url():
    proc, base = start_server([*ARGS, "--batch-storage", "none", "--disable-web-ui"])
    try:
        yield base
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def client(url):
    return ollama.Client(host=url, timeout=300)


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def _openai_chat(oai, messages, think=False, **kw):
    r = oai.chat.completions.create(
        model="m",
        messages=messages,
        temperature=0,
        max_tokens=kw.pop("max_tokens", GREEDY["num_predict"]),
        extra_body={"chat_template_kwargs": {"enable_thinking": think}},
        **kw,
    )
    return r.choices[0]


def _streamed(chunks):
    """Pieces of a chat stream folded: (content, thinking, tool calls, last chunk)."""
    content, thinking, calls, last = "", "", [], None
    for c in chunks:
        content += c.message.content or ""
        thinking += c.message.thinking or ""
        calls += c.message.tool_calls or []
        last = c
    return content, thinking, calls, last


def test_chat_equals_the_openai_route_whole_and_streamed(client, oai):
    whole = client.chat(model="m", messages=ASK, options=GREEDY, think=False)
    ref = _openai_chat(oai, ASK)
    assert whole.message.content == ref.message.content and whole.message.content
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 8
    assert whole.prompt_eval_count > 0 and whole.eval_duration > 0 and whole.total_duration >= whole.eval_duration
    content, _, _, last = _streamed(
        client.chat(model="m:latest", messages=ASK, options=GREEDY, think=False, stream=True)
    )
    assert content == ref.message.content
    assert last.done and last.done_reason == "length" and last.eval_count == 8 and last.model == "m:latest"


def test_think_splits_the_reasoning_as_the_openai_route_does(client, oai):
    r = client.chat(model="m", messages=ASK, options=GREEDY, think=True)
    ref = _openai_chat(oai, ASK, think=True)
    assert r.message.thinking == ref.message.reasoning_content and r.message.thinking
    assert r.message.content == (ref.message.content or "")
    _, thinking, _, _ = _streamed(client.chat(model="m", messages=ASK, options=GREEDY, think=True, stream=True))
    assert thinking == r.message.thinking


def test_options_map_onto_sampling(client, oai):
    opts = {"temperature": 0, "num_predict": 20, "repeat_penalty": 1.3, "top_k": 5, "num_ctx": 4096}
    r = client.chat(model="m", messages=ASK, options=opts, think=False)
    ref = oai.chat.completions.create(
        model="m",
        messages=ASK,
        temperature=0,
        max_tokens=20,
        extra_body={"repetition_penalty": 1.3, "top_k": 5, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.message.content == ref.choices[0].message.content
    first = ref.choices[0].message.content.split()
    stopped = client.chat(model="m", messages=ASK, options={**opts, "stop": [first[1]]}, think=False)
    assert stopped.done_reason == "stop" and first[1] not in stopped.message.content
    seeded = [client.chat(model="m", messages=ASK, options={"seed": 7, "num_predict": 8}) for _ in range(2)]
    assert seeded[0].message.content == seeded[1].message.content


def test_generate_is_the_templated_prompt(client, oai):
    r = client.generate(model="m", prompt="Say hi", system="Be brief.", options=GREEDY, think=False)
    ref = _openai_chat(oai, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}])
    assert r.response == ref.message.content and r.done_reason == "length"
    pieces = list(
        client.generate(model="m", prompt="Say hi", system="Be brief.", options=GREEDY, think=False, stream=True)
    )
    assert "".join(p.response for p in pieces) == r.response and pieces[-1].done and not pieces[0].done


def test_raw_generate_is_the_completion(client, oai):
    r = client.generate(model="m", prompt="The capital of France is", raw=True, options=GREEDY)
    ref = oai.completions.create(model="m", prompt="The capital of France is", temperature=0, max_tokens=8)
    assert r.response == ref.choices[0].text and r.eval_count == 8


def test_empty_prompt_loads(client):
    r = client.generate(model="m", prompt="")
    assert r.done and r.done_reason == "load" and r.response == ""


@pytest.mark.parametrize("fmt", ["json", WEATHER_SCHEMA])
def test_structured_format(client, oai, fmt):
    r = client.chat(model="m", messages=ASK, format=fmt, options={"temperature": 0, "num_predict": 60}, think=False)
    value = json.loads(r.message.content)
    if fmt != "json":
        jsonschema.validate(value, fmt)
    rf = (
        {"type": "json_object"}
        if fmt == "json"
        else {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    )
    assert r.message.content == _openai_chat(oai, ASK, max_tokens=60, response_format=rf).message.content


def test_tool_calls_in_ollama_shape_and_back(client, oai):
    opts = {"temperature": 0, "num_predict": 60}
    r = client.chat(model="m", messages=ASK, tools=TOOLS, format=CALL_FORMAT, options=opts, think=False)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and r.done_reason == "stop"
    jsonschema.validate(dict(call.function.arguments), WEATHER_SCHEMA)
    rf = {"type": "json_schema", "json_schema": {"name": "format", "schema": CALL_FORMAT}}
    ref = _openai_chat(oai, ASK, max_tokens=60, tools=TOOLS, response_format=rf).message.tool_calls[0]
    assert (ref.function.name, json.loads(ref.function.arguments)) == ("get_weather", call.function.arguments)
    _, _, calls, _ = _streamed(
        client.chat(model="m", messages=ASK, tools=TOOLS, format=CALL_FORMAT, options=opts, think=False, stream=True)
    )
    assert [(c.function.name, c.function.arguments) for c in calls] == [(call.function.name, call.function.arguments)]
    follow = [*ASK, r.message, {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"}]
    answer = client.chat(
        model="m", messages=follow, tools=TOOLS, options={"temperature": 0, "num_predict": 4}, think=False
    )
    assert answer.message.content and not answer.message.tool_calls


def test_model_routes(client):
    (listed,) = [m for m in client.list().models if m.model == "m:latest"]
    assert listed.digest and listed.size > 0
    assert (listed.details.format, listed.details.family, listed.details.quantization_level) == (
        "gguf",
        "llama",
        "Q4_1",
    )
    shown = client.show("m")
    assert "completion" in shown.capabilities and "thinking" in shown.capabilities
    assert shown.template and shown.modelinfo["general.context_length"] > 0
    assert any(m.model == "m:latest" for m in client.ps().models)
    assert client.pull("m").status == "success"


def test_errors_in_ollama_shape(client, url):
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="llama3", messages=ASK)
    assert err.value.status_code == 404 and err.value.error == "model 'llama3' not found"
    with pytest.raises(ollama.ResponseError) as err:
        client.pull("llama3")
    assert err.value.status_code == 400 and "does not download models" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="m", messages=ASK, options={"mirostat_x": 1})
    assert err.value.status_code == 400 and "options.mirostat_x" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model="m", input="hi")
    assert err.value.status_code == 400
    assert httpx.get(url + "/api/version").json()["version"]
    # Ollama's own examples are curl -d: a form content type carrying JSON
    r = httpx.post(
        url + "/api/generate",
        content=b'{"model":"m","prompt":"Hi","stream":false,"options":{"num_predict":2}}',
        headers={"content-type": "application/x-www-form-urlencoded"},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["eval_count"] == 2


@pytest.fixture(scope="module")
def embed_url():
    proc, base = start_server(["--model-path", ENCODER_NAME, "--batch-storage", "none"])
    try:
        yield base
    finally:
        stop_server(proc)


def test_embed_equals_the_openai_route(embed_url):
    client = ollama.Client(host=embed_url, timeout=120)
    oai = openai.OpenAI(base_url=embed_url + "/v1", api_key="none", max_retries=0)
    texts = ["The cat sat on the mat.", "Dogs bark."]
    r = client.embed(model=ENCODER_NAME, input=texts)
    ref = oai.embeddings.create(model=ENCODER_NAME, input=texts)
    assert r.embeddings == [d.embedding for d in ref.data] and r.prompt_eval_count == ref.usage.prompt_tokens
    assert client.embeddings(model=ENCODER_NAME, prompt=texts[0]).embedding == ref.data[0].embedding
    shown = client.show(ENCODER_NAME)
    assert shown.capabilities == ["embedding"] and shown.details.format == "safetensors"
    assert shown.details.family == "bert" and shown.details.parameter_size == "22.7M"
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=ENCODER_NAME, messages=ASK)
    assert err.value.status_code == 400 and "embedding model" in err.value.error
