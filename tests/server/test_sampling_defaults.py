"""Sampling defaults are decided once (issue 48): a request's omitted (or null) temperature,
top_p, top_k, min_p and repetition_penalty take the model's generation_config.json on every
route, a value it sends wins, and ``--generation-config vllm`` ignores the file. Also the one
length-limit decision and the one reasoning-parser resolution.

The resolve function and the file reading are checked alone; every route is checked in-process
on the fake engine (which records the engine requests, so the effective values are read exactly);
``test_sampling_defaults_e2e.py`` checks the same on a real server."""

from __future__ import annotations

import asyncio
import json

import pytest

from llmkit.core.server.errors import APIError
from llmkit.core.server.generation.length_limit import max_new_tokens
from llmkit.core.server.generation.reasoning import named_reasoning, request_reasoning
from llmkit.core.server.generation.sampling_defaults import (
    NEUTRAL,
    generation_config_path,
    load_sampling_defaults,
    read_generation_config,
    resolve,
)

FILE = {"temperature": 0.25, "top_p": 0.5, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1}
ASKED = {"temperature": 0.75, "top_p": 0.9, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.2}
HI = [{"role": "user", "content": "hi"}]


# -- the resolve function ------------------------------------------------------------------------


def test_omitted_and_null_take_the_default_a_value_wins():
    assert resolve({}, FILE) == FILE
    assert resolve(dict.fromkeys(FILE), FILE) == FILE  # OpenAI's null means "the default"
    assert resolve(ASKED, FILE) == ASKED
    assert resolve({"temperature": 0}, FILE) == {**FILE, "temperature": 0}  # 0 is a value, not "unset"


def test_without_a_file_the_neutral_values():
    neutral = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    assert resolve({}, {}) == resolve({}, None) == NEUTRAL == neutral
    assert resolve({}, {"top_p": 0.8}) == {**NEUTRAL, "top_p": 0.8}  # a file setting some fields


def test_resolve_reads_request_models_by_attribute():
    from llmkit.core.server.openai.protocol import ChatCompletionRequest, CompletionRequest
    from llmkit.core.server.sglang.generate import GenerateSampling

    for model in (
        ChatCompletionRequest(messages=HI),
        CompletionRequest(prompt="hi"),
        GenerateSampling(),
        CompletionRequest.model_validate({"prompt": "hi", "temperature": None, "top_p": None}),
    ):
        assert resolve(model, FILE) == FILE, type(model).__name__
    assert resolve(CompletionRequest(prompt="hi", temperature=0.0, top_k=3), FILE) == {
        **FILE,
        "temperature": 0.0,
        "top_k": 3,
    }


def test_no_request_model_declares_a_sampling_default():
    """The defaults live in one place: every request model leaves the five fields None."""
    from llmkit.core.server.anthropic.protocol import MessagesRequest
    from llmkit.core.server.openai.protocol import ChatCompletionRequest, CompletionRequest
    from llmkit.core.server.responses.protocol import ResponsesRequest
    from llmkit.core.server.sglang.generate import GenerateSampling

    for cls in (ChatCompletionRequest, CompletionRequest, ResponsesRequest, MessagesRequest, GenerateSampling):
        for name in NEUTRAL:
            if name in cls.model_fields:
                assert cls.model_fields[name].default is None, (cls.__name__, name)


# -- the generation config and the switch --------------------------------------------------------


def _write(path, cfg) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(cfg))


def test_the_file_fields_and_do_sample(tmp_path):
    _write(tmp_path, {**FILE, "do_sample": True, "max_length": 20, "eos_token_id": 2, "bos_token_id": 1})
    assert read_generation_config(tmp_path / "generation_config.json") == FILE
    _write(tmp_path, {"do_sample": False, "temperature": 0.6, "top_p": 0.9})  # greedy, as in transformers
    assert read_generation_config(tmp_path / "generation_config.json") == {"temperature": 0.0, "top_p": 0.9}
    _write(tmp_path, {"top_k": 0, "temperature": None})  # transformers' "no top-k"; a null sets nothing
    assert read_generation_config(tmp_path / "generation_config.json") == {"top_k": -1}


@pytest.mark.parametrize(
    "cfg",
    [{"top_p": 0}, {"temperature": -1}, {"top_k": 2.5}, {"min_p": 2}, {"repetition_penalty": 0}, {"top_p": "x"}],
)
def test_a_bad_file_fails_at_start_up(tmp_path, cfg):
    _write(tmp_path, cfg)
    with pytest.raises(ValueError, match="generation_config.json"):
        load_sampling_defaults("auto", tmp_path)


def test_the_switch(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    _write(model, {"temperature": 0.3})
    _write(other, {"temperature": 0.9})
    assert load_sampling_defaults("auto", model) == {"temperature": 0.3}
    assert load_sampling_defaults("vllm", model) == load_sampling_defaults("none", model) == {}
    assert load_sampling_defaults(str(other), model) == {"temperature": 0.9}  # a directory
    assert load_sampling_defaults(str(other / "generation_config.json"), model) == {"temperature": 0.9}  # the file
    assert load_sampling_defaults("auto", tmp_path / "no-file") == {}  # auto: a model without one
    assert generation_config_path("auto", None) is None  # a GGUF with no directory
    with pytest.raises(ValueError, match="--generation-config"):
        generation_config_path(str(tmp_path / "missing"), model)  # asked for by name: an error


def test_defaults_differing_from_neutral_are_logged(tmp_path, caplog):
    _write(tmp_path, {"temperature": 0.3, "top_p": 1.0})
    with caplog.at_level("INFO", logger="llmkit"):
        load_sampling_defaults("auto", tmp_path)
    assert "temperature=0.3" in caplog.text and "top_p" not in caplog.text


# -- the length limit ----------------------------------------------------------------------------


def test_the_length_decision():
    assert max_new_tokens(10, None, 100) == 90  # left out: up to the context
    assert max_new_tokens(10, 90, 100) == 90
    with pytest.raises(APIError, match="Requested token count exceeds") as exc:
        max_new_tokens(10, 91, 100, param="max_completion_tokens")
    assert (exc.value.param, exc.value.code) == ("max_completion_tokens", "context_length_exceeded")
    with pytest.raises(APIError, match="longer than the model's context length") as exc:
        max_new_tokens(100, None, 100, prompt_param="prompt")
    assert (exc.value.param, exc.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(APIError, match="max_new_tokens must be positive") as exc:
        max_new_tokens(100, 0, 100, param="max_new_tokens")  # the field first, as OpenAI validates it
    assert exc.value.param == "max_new_tokens"


# -- the reasoning parser, resolved once ---------------------------------------------------------


class _State:
    class options:
        reasoning_parser = "qwen3"


class _Body:
    separate_reasoning = True
    stream = False
    stream_reasoning = True


def test_one_reasoning_resolution_serves_grammar_and_choices():
    prompt = "<|im_start|>assistant\n<think>\n"
    r = request_reasoning(_State, _Body, prompt, {"reasoning_effort": "high"})
    assert r.stream_reasoning is False  # non-streaming buffers reasoning
    a, b = r.new_parser(), r.new_parser()
    assert a is not b and a.reasoning_end_markers == ("</think>",)  # a fresh machine per choice
    assert a.chat_template_kwargs == {"reasoning_effort": "high"}  # the kwargs the prompt rendered with
    assert r.after_prompt_suffix("x").new_parser().prompt_text == prompt + "x"
    off = type("B", (_Body,), {"separate_reasoning": False})
    assert request_reasoning(_State, off, prompt, {}) is None
    assert named_reasoning("gpt-oss").keep_special_tokens and not r.keep_special_tokens


def test_a_chat_request_resolves_its_parser_once(monkeypatch):
    """Special tokens, the grammar's wait and each choice's text read one resolution."""
    from fastapi.testclient import TestClient

    import llmkit.core.parsing.reasoning as reasoning_module

    from fake_engine import fake_app

    calls = []
    real = reasoning_module.reasoning_parser_class
    monkeypatch.setattr(reasoning_module, "reasoning_parser_class", lambda name: calls.append(name) or real(name))
    body = {"model": "m", "messages": HI, "max_tokens": 2, "n": 2, "response_format": {"type": "json_object"}}
    r = TestClient(fake_app(reasoning_parser="qwen3")).post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert calls == ["qwen3"]


# -- every route, in-process on the fake engine ---------------------------------------------------


@pytest.fixture(scope="module")
def app():
    from fake_engine import fake_app

    app = fake_app()
    app.state.llmkit.sampling_defaults = dict(FILE)  # as --generation-config would load it
    return app


@pytest.fixture(scope="module")
def http(app):
    from fastapi.testclient import TestClient

    return TestClient(app)


def _sent(app) -> dict:
    """The sampling fields of the engine request the last call made."""
    p = app.state.llmkit.client.submitted[-1].params
    return {k: getattr(p, k) for k in NEUTRAL}


ROUTES = {
    "chat": ("/v1/chat/completions", {"model": "m", "messages": HI, "max_tokens": 2}),
    "completions": ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}),
    "responses": ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 2, "store": False}),
    "anthropic": ("/v1/messages", {"model": "m", "messages": HI, "max_tokens": 2}),
    "generate": ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
}
# The fields each API lets a client send (Anthropic has no min_p or repetition_penalty).
SENDABLE = {"anthropic": ("temperature", "top_p", "top_k")}


def _with(route: str, body: dict, fields: dict) -> dict:
    body = json.loads(json.dumps(body))
    if route == "generate":
        body["sampling_params"].update(fields)
    else:
        body.update(fields)
    return body


@pytest.mark.parametrize("route", list(ROUTES))
def test_each_route_omitted_null_and_explicit(app, http, route):
    path, body = ROUTES[route]
    fields = SENDABLE.get(route, tuple(NEUTRAL))
    for sent, want in (
        ({}, FILE),
        (dict.fromkeys(fields), FILE),  # null: the default, on every route
        ({k: ASKED[k] for k in fields}, {**FILE, **{k: ASKED[k] for k in fields}}),
        ({"temperature": 0}, {**FILE, "temperature": 0.0}),
    ):
        r = http.post(path, json=_with(route, body, sent))
        assert r.status_code == 200, (route, sent, r.text)
        assert _sent(app) == pytest.approx(want), (route, sent)


def test_responses_report_the_temperature_they_sample_with(http):
    r = http.post("/v1/responses", json=ROUTES["responses"][1]).json()
    assert (r["temperature"], r["top_p"]) == (FILE["temperature"], FILE["top_p"])
    r = http.post("/v1/responses", json={**ROUTES["responses"][1], "temperature": 0.75}).json()
    assert (r["temperature"], r["top_p"]) == (0.75, FILE["top_p"])


def test_server_info_shows_the_defaults(http):
    assert http.get("/get_server_info").json()["sampling_defaults"] == FILE


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_batch_lines_take_the_defaults(app, endpoint):
    from llmkit.core.batches.executor import make_batch_executor

    execute = make_batch_executor(app.state.llmkit)
    body = ROUTES["chat" if "chat" in endpoint else "completions"][1]
    status, out = asyncio.run(execute(endpoint, body))
    assert status == 200, out
    assert _sent(app) == pytest.approx(FILE)


def test_a_bad_value_is_refused_whichever_side_it_came_from(app, http):
    r = http.post("/v1/completions", json={**ROUTES["completions"][1], "top_p": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"model": "m", "messages": HI, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"model": "m", "messages": HI, "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 9000}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "hi " * 8200, "max_tokens": 2}, "prompt"),
        ("/generate", {"text": "hi " * 8200, "sampling_params": {"max_new_tokens": 2}}, "text"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 9000}}, "max_new_tokens"),
    ],
)
def test_every_route_names_the_length_field_it_was_sent(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_length_refusal_precedes_a_prompt_refusal(http):
    """A bad max_tokens is a field error (OpenAI validates it first): before the prompt is read."""
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": HI * 3000, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_omitted_max_tokens_is_up_to_the_context(app, http):
    http.post("/v1/chat/completions", json={"model": "m", "messages": HI, "stop": ["."]})  # the fake's 7th token
    req = app.state.llmkit.client.submitted[-1]
    assert req.params.max_new_tokens == app.state.llmkit.max_context - len(req.prompt_ids)
    http.post("/v1/completions", json={"model": "m", "prompt": "hi", "stop": ["."]})
    assert app.state.llmkit.client.submitted[-1].params.max_new_tokens == 16  # OpenAI's default
    http.post("/generate", json={"text": "hi", "sampling_params": {"stop": ["."]}})
    assert app.state.llmkit.client.submitted[-1].params.max_new_tokens == 128  # SGLang's default
