"""The new model families served end to end: a real ``llmkit serve`` on a tiny random-weight model
of each class (built from a transformers config here), with the family's parsers, driven by the
official ``openai`` client. A constrained ``tool_choice`` makes even random weights emit a call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Server

from model_utils import copy_embedded_tokenizer, save_tiny_model
from server_utils import start_server, stop_server

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).parent / "data" / "think_template.jinja"
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
def qwen3_moe_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-qwen3-moe")
    # the embedded tokenizer's vocabulary, so the grammar's tokens are all the model's
    save_tiny_model("qwen3_moe", d, vocab_size=49152, max_position_embeddings=1024)
    copy_embedded_tokenizer(d)
    proc, url = start_server(
        [
            "--model-path",
            str(d),
            "--chat-template",
            str(TEMPLATE),
            "--reasoning-parser",
            "qwen3",
            "--tool-call-parser",
            "hermes",
            "--page-size",
            "16",
            "--batch-storage",
            "none",
        ]
    )
    try:
        yield Server(proc, url)
    finally:
        stop_server(proc)


def test_qwen3_moe_forced_tool_call(qwen3_moe_server):
    """Thinking off (with it on the grammar waits for </think>, which random weights never say)."""
    r = qwen3_moe_server.client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Make it warmer."}],
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "set_thermostat"}},
        temperature=0,
        max_tokens=200,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "set_thermostat"
    args = json.loads(call.function.arguments)
    assert args["mode"] in ("heat", "cool", "off") and isinstance(args["eco"], bool)


def test_qwen3_moe_reasoning_is_separated(qwen3_moe_server):
    """The template opens <think>; a random model never closes it, so what it says is reasoning."""
    r = qwen3_moe_server.client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        max_tokens=16,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert msg.reasoning_content and not msg.content
    assert "Qwen3MoeForCausalLM" in qwen3_moe_server.log()
