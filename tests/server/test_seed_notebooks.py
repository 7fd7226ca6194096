"""Every chat and completions cell of the user's seed notebooks (../shared/seeds), run against
``llmkit serve`` with the embedded model in place of SGLang's launch command and model: at the
GGUF's native precision (the default) and dequantized (``--quantization none``)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", params=["native", "dense"])
def client(request):
    return request.getfixturevalue("server" if request.param == "native" else "dense_server").client


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_chat_basic(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are a helpful AI assistant"},
            {"role": "user", "content": "List 3 countries and their capitals."},
        ],
        temperature=0,
        max_tokens=64,
    )
    choice = response.choices[0]
    assert response.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens > 0 and response.usage.completion_tokens <= 64
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_chat_detailed_parameters(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are a knowledgeable historian who provides concise responses."},
            {"role": "user", "content": "Tell me about ancient Rome"},
            {"role": "assistant", "content": "Ancient Rome was a civilization centered in Italy."},
            {"role": "user", "content": "What were their major achievements?"},
        ],
        temperature=0.3,
        max_tokens=128,
        top_p=0.95,
        presence_penalty=0.2,
        frequency_penalty=0.2,
        n=1,
        seed=42,
    )
    assert len(response.choices) == 1
    assert response.choices[0].message.content
    assert response.usage.completion_tokens <= 128


def test_chat_with_template_kwargs(client, model):
    """The 2025 notebooks pass chat_template_kwargs through extra_body; without a reasoning
    parser everything is content and reasoning_content is None."""
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "9.11 and 9.8, which is greater?"}],
        max_tokens=48,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}, "separate_reasoning": True},
    )
    assert response.choices[0].message.content
    assert response.choices[0].message.reasoning_content is None


def test_chat_streaming(client, model):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say this is a test"}],
        stream=True,
        max_tokens=64,
    )
    text = ""
    for chunk in stream:
        if chunk.choices[0].delta.content is not None:
            text += chunk.choices[0].delta.content
    assert text


def test_completion_basic(client, model):
    response = client.completions.create(
        model=model,
        prompt="List 3 countries and their capitals.",
        temperature=0,
        max_tokens=64,
        n=1,
        stop=None,
    )
    assert response.object == "text_completion"
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens == 8 or response.usage.prompt_tokens > 0


def test_completion_detailed_parameters(client, model):
    response = client.completions.create(
        model=model,
        prompt="Write a short story about a space explorer.",
        temperature=0.7,
        max_tokens=150,
        top_p=0.9,
        stop=["\n\n", "THE END"],
        presence_penalty=0.3,
        frequency_penalty=0.3,
        n=1,
        seed=123,
    )
    choice = response.choices[0]
    assert "\n\n" not in choice.text and "THE END" not in choice.text
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "stop" and choice.matched_stop is not None:
        assert choice.matched_stop in ("\n\n", "THE END") or isinstance(choice.matched_stop, int)
