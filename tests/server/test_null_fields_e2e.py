"""A JSON null for an optional field is "not sent" on every generation route, as in OpenAI's
schema (SGLang's Model Gateway forwards ``"stream": null``), through the official clients."""

from __future__ import annotations

import anthropic
import pytest

HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def client(server):
    return server.client


def test_chat_completions_nulls(client):
    extra = {"n": None, "logprobs": None, "parallel_tool_calls": None, "ignore_eos": None, "min_tokens": None}
    r = client.chat.completions.create(model="m", messages=HI, max_tokens=3, stream=None, extra_body=extra)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None


def test_completions_nulls(client):
    r = client.completions.create(model="m", prompt="Hi", max_tokens=3, stream=None, echo=None, n=None)
    assert len(r.choices) == 1 and not r.choices[0].text.startswith("Hi")


def test_responses_nulls(client):
    extra = {"store": None, "background": None, "truncation": None}
    r = client.responses.create(model="m", input="Say hi.", max_output_tokens=3, stream=None, extra_body=extra)
    assert r.status in ("completed", "incomplete")


def test_messages_nulls(server):
    c = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
    r = c.messages.create(model="m", max_tokens=3, messages=HI, extra_body={"stream": None})
    assert r.type == "message" and r.content


def test_required_field_null_is_still_400(client):
    import openai

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=None, max_tokens=3)
