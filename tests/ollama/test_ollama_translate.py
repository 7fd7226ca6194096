"""Ollama requests as the chat completion requests that serve them (no server: the translation
alone, each field Ollama takes onto the one the OpenAI routes read)."""

from __future__ import annotations

import json

import pytest

from llmkit.core.server.errors import APIError
from llmkit.core.server.ollama.protocol import OllamaChatRequest, OllamaGenerateRequest
from llmkit.core.server.ollama.translate import chat_of_chat, chat_of_generate, image_part, sampling_fields

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
JPEG = "/9j/4AAQSkZJRgABAQ"


def _chat(**kw):
    return chat_of_chat(OllamaChatRequest(model="m", messages=[{"role": "user", "content": "Hi"}], **kw))


def test_options_onto_sampling_fields():
    opts = {
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 3,
        "stop": ["\n"],
        "num_predict": 16,
        "repeat_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
    }
    chat = _chat(options=opts)
    got = {k: getattr(chat, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "max_tokens")}
    assert got == {
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 3,
        "stop": ["\n"],
        "max_tokens": 16,
    }
    assert (chat.repetition_penalty, chat.presence_penalty, chat.frequency_penalty) == (1.1, 0.5, 0.25)


@pytest.mark.parametrize("n", [-1, -2])
def test_num_predict_without_a_cap(n):
    assert _chat(options={"num_predict": n}).max_tokens is None


def test_load_time_options_are_ignored_and_unknown_ones_refused():
    assert sampling_fields({"num_ctx": 8192, "num_gpu": 1, "mirostat": 2, "temperature": None}) == {}
    with pytest.raises(APIError, match="options.mirostat_x is not a known option"):
        sampling_fields({"mirostat_x": 1})
    with pytest.raises(APIError, match="num_predict"):
        sampling_fields({"num_predict": -3})
    with pytest.raises(APIError, match="temperature"):  # the chat request's own type check
        _chat(options={"temperature": "hot"})


def test_format_onto_response_format():
    assert _chat(format="json").response_format == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert _chat(format=schema).response_format == {
        "type": "json_schema",
        "json_schema": {"name": "format", "schema": schema},
    }
    assert _chat(format="").response_format is None
    with pytest.raises(APIError, match="format must be"):
        _chat(format="yaml")


def test_think_onto_the_template_switch():
    assert _chat().chat_template_kwargs is None  # the template's default
    assert _chat(think=False).chat_template_kwargs == {"enable_thinking": False}
    high = _chat(think="high")
    assert (high.chat_template_kwargs, high.reasoning_effort) == ({"enable_thinking": True}, "high")
    with pytest.raises(APIError, match="think must be"):
        _chat(think="max")


def test_images_as_data_urls_before_the_text():
    assert image_part(PNG)["image_url"]["url"] == f"data:image/png;base64,{PNG}"
    assert image_part(JPEG)["image_url"]["url"].startswith("data:image/jpeg;base64,")
    chat = chat_of_chat(OllamaChatRequest(model="m", messages=[{"role": "user", "content": "What?", "images": [PNG]}]))
    parts = [p.model_dump(exclude_none=True) for p in chat.messages[0].content]
    assert parts == [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {"type": "text", "text": "What?"},
    ]


def test_tool_calls_and_answers():
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call], "thinking": "look it up"},
        {"role": "tool", "content": "18 C", "tool_name": "get_weather"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    chat = chat_of_chat(OllamaChatRequest(model="m", messages=messages, tools=tools))
    assistant, tool = chat.messages[1], chat.messages[2]
    (tc,) = assistant.tool_calls
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert assistant.reasoning_content == "look it up"
    assert (tool.role, tool.tool_call_id, tool.name) == ("tool", tc.id, "get_weather")
    assert chat.tools[0].function.name == "get_weather"
    with pytest.raises(APIError, match="function.name"):
        chat_of_chat(OllamaChatRequest(model="m", messages=[{"role": "assistant", "tool_calls": [{"x": 1}]}]))


def test_generate_is_a_system_and_a_user_message():
    chat = chat_of_generate(OllamaGenerateRequest(model="m", prompt="Hi", system="Be brief.", images=[PNG]))
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert chat.messages[0].content == "Be brief." and chat.messages[1].content[1].text == "Hi"
    for field, value in (("suffix", "}"), ("template", "{{ .Prompt }}"), ("context", [1, 2])):
        with pytest.raises(APIError, match=field):
            chat_of_generate(OllamaGenerateRequest(model="m", prompt="Hi", **{field: value}))
