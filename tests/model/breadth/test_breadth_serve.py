"""GLM-4.5 served end to end: a real ``llmkit serve`` on a tiny random-weight ``Glm4MoeForCausalLM``
(the embedded tokenizer's vocabulary) with the ``glm45`` parsers and a template in GLM's format,
driven by the official ``openai`` client: a forced tool call streamed and not, reasoning separated
where the template opens it, and plain completions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from breadth_utils import save_tiny
from server_utils import start_server, stop_server
from tests.conftest import Server

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).resolve().parents[2] / "data" / "glm45_template.jinja"
TOOL = {
    "type": "function",
    "function": {
        "name": "set_thermostat",
        "description": "Set the thermostat mode.",
        "parameters": {
            "type": "object",
            "properties": {"mode": {"enum": ["heat", "cool", "off"]}, "eco": {"type": "boolean"}},
            "required": ["mode", "eco"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-glm45")
    save_tiny("glm4_moe", d, vocab_size=49152, max_position_embeddings=1024)
    args = ["--model-path", str(d), "--chat-template", str(TEMPLATE), "--page-size", "16", "--batch-storage", "none"]
    proc, url = start_server(args + ["--reasoning-parser", "glm45", "--tool-call-parser", "glm45"])
    try:
        yield Server(proc, url)
    finally:
        stop_server(proc)


def _forced(server, stream: bool):
    return server.client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Make it warmer."}],
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "set_thermostat"}},
        temperature=0,
        max_tokens=200,
        stream=stream,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )


def test_forced_tool_call_streamed_and_not(server):
    r = _forced(server, stream=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "set_thermostat"
    args = json.loads(call.function.arguments)
    assert args["mode"] in ("heat", "cool", "off") and isinstance(args["eco"], bool)
    name, pieces = None, []
    for chunk in _forced(server, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            name = tc.function.name or name
            pieces.append(tc.function.arguments or "")
    assert name == "set_thermostat" and json.loads("".join(pieces)) == args


def test_reasoning_is_separated(server):
    """The template opens ``<think>``; a random model never closes it: all of it is reasoning."""
    r = server.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=16
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert msg.reasoning_content and not msg.content


def test_completion_serves_the_model(server):
    r = server.client.completions.create(
        model="m", prompt="Once upon a time", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 8
    assert "Loaded Glm4MoeForCausalLM" in server.log()
