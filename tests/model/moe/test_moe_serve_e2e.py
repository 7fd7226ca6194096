"""The new model families served end to end: a real ``llmkit serve`` on a tiny random-weight model
of each class (built from a transformers config here, with the embedded tokenizer's vocabulary),
the family's parsers and a test template in its format, driven by the official ``openai`` client.
A constrained ``tool_choice`` makes even random weights emit a call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_utils import copy_embedded_tokenizer, save_tiny_model
from server_utils import start_server, stop_server
from tests.conftest import Server

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[2] / "data"
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
# family: (model, template, parser options, chat_template_kwargs that turn thinking on / off)
FAMILIES = {
    "qwen3-moe": ("qwen3_moe", "think_template", ["qwen3", "hermes"], "enable_thinking"),
    "gpt-oss": ("gpt_oss", "harmony_template", ["gpt-oss", "gpt-oss"], None),
    "deepseek-v3": ("deepseek_v3", "deepseek_template", ["deepseek-v3", "deepseekv3"], "thinking"),
    "deepseek-r1": ("deepseek_v3", "deepseek_template", ["deepseek-r1", None], "thinking"),
    "kimi-k2": ("deepseek_v3", "kimi_template", ["kimi", "kimi_k2"], None),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for arch in ("qwen3_moe", "gpt_oss", "deepseek_v3"):
        d = tmp_path_factory.mktemp(f"tiny-{arch}")
        # the embedded tokenizer's vocabulary, so every token the grammar allows is the model's
        save_tiny_model(arch, d, vocab_size=49152, max_position_embeddings=1024)
        copy_embedded_tokenizer(d)
        dirs[arch] = d
    return dirs


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_server(request, model_dirs):
    arch, template, (reasoning, tools), think_kw = FAMILIES[request.param]
    args = ["--model-path", str(model_dirs[arch]), "--chat-template", str(DATA / f"{template}.jinja")]
    args += ["--reasoning-parser", reasoning] + (["--tool-call-parser", tools] if tools else [])
    args += ["--page-size", "16", "--batch-storage", "none"]
    proc, url = start_server(args)
    try:
        yield request.param, think_kw, Server(proc, url)
    finally:
        stop_server(proc)


def test_forced_tool_call(family_server):
    """With thinking off where the family has the switch (with it on, the grammar waits for the
    end of reasoning, which random weights never write)."""
    family, think_kw, server = family_server
    if family == "deepseek-r1":
        pytest.skip("R1 always reasons first: a forced call waits for </think>")
    r = server.client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Make it warmer."}],
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "set_thermostat"}},
        temperature=0,
        max_tokens=200,
        extra_body={"chat_template_kwargs": {think_kw: False}} if think_kw else None,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "set_thermostat"
    args = json.loads(call.function.arguments)
    assert args["mode"] in ("heat", "cool", "off") and isinstance(args["eco"], bool)


def test_reasoning_is_separated(family_server):
    """Where the template opens the reasoning block, a random model never closes it: what it says
    is reasoning, and the content is empty."""
    family, think_kw, server = family_server
    if think_kw is None:
        pytest.skip(f"{family}'s reasoning starts with a marker the model itself must write")
    r = server.client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        max_tokens=16,
        extra_body={"chat_template_kwargs": {think_kw: True}},
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert msg.reasoning_content and not msg.content


def test_completion_serves_the_model(family_server):
    family, _, server = family_server
    r = server.client.completions.create(
        model="m", prompt="Once upon a time", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 8
    arch = FAMILIES[family][0]
    expected = {"qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}.get(arch, "DeepseekV3ForCausalLM")
    assert f"Loaded {expected}" in server.log()
