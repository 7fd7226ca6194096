"""A JSON ``null`` for any optional field of any request model is "not sent" (OpenAI's schema makes
nearly every optional field nullable; SGLang's Model Gateway forwards ``"stream": null`` and adds
its own sampling fields). The fields are enumerated from the models, so a field added later is
covered, and a request model missing from the table below fails the completeness check."""

from __future__ import annotations

import copy

import pytest

from llmkit.core.server.anthropic import protocol as anthropic_protocol
from llmkit.core.server.body import parse_model
from llmkit.core.server.nullable import NullMeansDefault, _admits_none
from llmkit.core.server.ollama import protocol as ollama_protocol
from llmkit.core.server.openai import embeddings, scores
from llmkit.core.server.openai import protocol as openai_protocol
from llmkit.core.server.responses import protocol as responses_protocol
from llmkit.core.server.sglang import generate, parsers, tokenize

HI = [{"role": "user", "content": "hi"}]
CHAT = {"model": "m", "messages": HI, "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
MESSAGES = {"model": "m", "max_tokens": 2, "messages": HI}
OLLAMA_CHAT = {"model": "m", "messages": HI, "stream": False, "options": {"num_predict": 2}}

# (model, route, a valid body, where in the body the model's object is). Routes the fake server
# (a generation model) does not serve are checked at the model: None.
CASES = [
    (openai_protocol.ChatCompletionRequest, "/v1/chat/completions", CHAT, ()),
    (openai_protocol.ChatMessage, "/v1/chat/completions", CHAT, ("messages", 0)),
    (
        openai_protocol.ContentPart,
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        ("messages", 0, "content", 0),
    ),
    (
        openai_protocol.ToolCall,
        "/v1/chat/completions",
        {
            **CHAT,
            "messages": [
                *HI,
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "1"},
            ],
        },
        ("messages", 1, "tool_calls", 0),
    ),
    (
        openai_protocol.ToolCallFunction,
        "/v1/chat/completions",
        {
            **CHAT,
            "messages": [
                *HI,
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "1"},
            ],
        },
        ("messages", 1, "tool_calls", 0, "function"),
    ),
    (openai_protocol.Tool, "/v1/chat/completions", {**CHAT, "tools": [TOOL]}, ("tools", 0)),
    (openai_protocol.FunctionDef, "/v1/chat/completions", {**CHAT, "tools": [TOOL]}, ("tools", 0, "function")),
    (
        openai_protocol.StreamOptions,
        "/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
        ("stream_options",),
    ),
    (openai_protocol.CompletionRequest, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}, ()),
    (responses_protocol.ResponsesRequest, "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 2}, ()),
    (anthropic_protocol.MessagesRequest, "/v1/messages", MESSAGES, ()),
    (anthropic_protocol.AnthropicMessage, "/v1/messages", MESSAGES, ("messages", 0)),
    (
        anthropic_protocol.AnthropicTool,
        "/v1/messages",
        {**MESSAGES, "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
        ("tools", 0),
    ),
    (anthropic_protocol.CountTokensRequest, "/v1/messages/count_tokens", {"model": "m", "messages": HI}, ()),
    (generate.GenerateRequest, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}, ()),
    (
        generate.GenerateSampling,
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
        ("sampling_params",),
    ),
    (tokenize.TokenizeRequest, "/tokenize", {"model": "m", "prompt": "hi"}, ()),
    (tokenize.DetokenizeRequest, "/detokenize", {"model": "m", "tokens": [1, 2]}, ()),
    (parsers.SeparateReasoningRequest, None, {"text": "<think>a</think>b", "reasoning_parser": "qwen3"}, ()),
    (parsers.ParseFunctionCallRequest, None, {"text": "hi", "tool_call_parser": "qwen"}, ()),
    (embeddings.EmbeddingRequest, None, {"model": "m", "input": "hi"}, ()),
    (scores.RerankRequest, None, {"model": "m", "query": "q", "documents": ["d"]}, ()),
    (scores.ScoreRequest, None, {"model": "m", "text_1": "a", "text_2": "b"}, ()),
    (ollama_protocol.OllamaChatRequest, "/api/chat", OLLAMA_CHAT, ()),
    (ollama_protocol.OllamaMessage, "/api/chat", OLLAMA_CHAT, ("messages", 0)),
    (
        ollama_protocol.OllamaGenerateRequest,
        "/api/generate",
        {"model": "m", "prompt": "hi", "stream": False, "options": {"num_predict": 2}},
        (),
    ),
    (ollama_protocol.OllamaModelRequest, "/api/show", {"model": "m"}, ()),
    (ollama_protocol.OllamaEmbedRequest, None, {"model": "m", "input": "hi"}, ()),
    (ollama_protocol.OllamaEmbeddingsRequest, None, {"model": "m", "prompt": "hi"}, ()),
]


def _optional_fields(cls) -> list[str]:
    return [f.alias or name for name, f in cls.model_fields.items() if not f.is_required()]


def _variants(body: dict, where: tuple, field: str) -> tuple[dict, dict]:
    """The body without ``field`` at ``where``, and with it null."""
    absent, null = copy.deepcopy(body), copy.deepcopy(body)
    for b in (absent, null):
        obj = b
        for key in where:
            obj = obj[key]
        obj.pop(field, None)
    target = null
    for key in where:
        target = target[key]
    target[field] = None
    return absent, null


def _params():
    for cls, route, body, where in CASES:
        for field in _optional_fields(cls):
            yield pytest.param(cls, route, body, where, field, id=f"{cls.__name__}.{field}")


def _request_models(cls=NullMeansDefault) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        if not sub.__name__.startswith("_") and sub.__module__.startswith("llmkit."):
            out.add(sub)
        out |= _request_models(sub)
    return out - {openai_protocol.RequestModel}


def test_every_request_model_is_covered():
    import llmkit.core.server.app  # noqa: F401  (imports every route's models)

    assert _request_models() - {c[0] for c in CASES} == set()


def test_case_bodies_are_valid(fake_server):
    """Each base body is accepted as it is, so a 400 below can only come from the null."""
    http = fake_server.http()
    for cls, route, body, _ in CASES:
        if route is None:
            parse_model(cls, body)
        else:
            r = http.post(route, json=body)
            assert r.status_code == 200, (route, r.text)


@pytest.mark.parametrize(("cls", "route", "body", "where", "field"), list(_params()))
def test_null_is_not_sent(fake_server, cls, route, body, where, field):
    absent, null = _variants(body, where, field)
    if route is None:
        # the server under test generates text: these models are checked where the route parses
        # them (the route's first step), a null taking the default as if absent
        obj = null
        for key in where:
            obj = obj[key]
        got = parse_model(cls, obj)
        if not _admits_none(cls.model_fields[field].annotation):
            want = parse_model(cls, {k: v for k, v in obj.items() if k != field})
            assert getattr(got, field) == getattr(want, field)
        return
    http = fake_server.http()
    r_absent, r_null = http.post(route, json=absent), http.post(route, json=null)
    assert r_null.status_code == r_absent.status_code, (field, r_null.text, r_absent.text)


@pytest.fixture(autouse=True)
def _serving(fake_server):
    """The in-process server is shared by the session: a test before this file may have run its
    lifespan's shutdown, which leaves its engine marked draining (every request a 503)."""
    fake_server.engine.draining = False
