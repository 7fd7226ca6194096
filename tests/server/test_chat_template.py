"""Chat templates render in a sandbox with a deadline and an output cap."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llmkit.core.server.prompts.chat_template import ChatTemplate, TemplateRenderError, check_template_kwargs

MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "src",
    [
        "{{ lipsum.__globals__['os'].system('touch CANARY') }}",
        "{{ cycler.__init__.__globals__.os.popen('touch CANARY').read() }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    ],
)
def test_sandbox_escapes_fail(src, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TemplateRenderError):
        ChatTemplate(src).render(MSGS, add_generation_prompt=True)
    assert not Path("CANARY").exists()


@pytest.mark.parametrize(
    "src",
    [
        "{{ 'x' * 10**9 }}",
        "{% for i in range(10**8) %}x{% endfor %}",
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    ],
)
def test_render_limits(src):
    t0 = time.monotonic()
    with pytest.raises(TemplateRenderError):
        ChatTemplate(src).render(MSGS, add_generation_prompt=True)
    assert time.monotonic() - t0 < 8


def test_raise_exception_message():
    with pytest.raises(TemplateRenderError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render(MSGS, add_generation_prompt=True)


def test_kwargs_allowlist_and_synonyms():
    assert check_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False, "thinking": False}
    for bad in ({"tokenize": True}, {"chat_template": "x"}, {"x": {"nested": 1}}, {"x": [1]}):
        with pytest.raises(ValueError):
            check_template_kwargs(bad)


def _embedded_state(tool_call_parser):
    """A real ServerState around the embedded model's tokenizer and template (no engine needed
    to render a prompt)."""
    from transformers import AutoTokenizer

    from llmkit.core.model.loader.source import resolve_model_dir
    from llmkit.core.server.config import ServerConfig
    from llmkit.core.server.state import ServerState

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    return ServerState(
        client=None,
        tokenizer=tok,
        chat_template=ChatTemplate(tok.chat_template),
        options=ServerConfig("m", tool_call_parser=tool_call_parser),
        max_context=8192,
        vocab_size=len(tok),
    )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.mark.parametrize(
    "parser, choice, marker",
    [
        ("hermes", "auto", "<tool_call>"),
        ("pythonic", None, "function_name(argument=value"),
        ("qwen3_coder", "auto", "<function=<function-name>>\n<parameter=<parameter-name>>"),  # a plugin's call_format
        (None, "required", '[{"name": <function-name>, "parameters"'),
        (None, "auto", None),
    ],
)
def test_template_without_tools_gets_them_in_the_system_prompt(parser, choice, marker):
    from llmkit.core.server.openai.protocol import ChatCompletionRequest
    from llmkit.core.server.prompts.prompt import render_chat

    state = _embedded_state(parser)
    assert not state.chat_template.supports_tools
    body = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], tool_choice=choice
    )
    text = render_chat(state, body, {})
    if marker is None:  # "auto" without a parser cannot call a tool: the prompt is unchanged
        assert "get_weather" not in text
        return
    assert marker in text and '"name": "get_weather"' in text
    assert text.startswith("<|im_start|>system\n# Tools") and text.count("<|im_start|>system") == 1
    none = ChatCompletionRequest(model="m", messages=body.messages, tools=[WEATHER], tool_choice="none")
    assert "get_weather" not in render_chat(state, none, {})


def test_template_with_tools_renders_them_itself():
    src = "{% for t in tools %}{{ t.function.name }}{% endfor %}|{{ messages[0].content }}"
    assert ChatTemplate(src).supports_tools
    assert not ChatTemplate("{{ messages[0].content }}").supports_tools
