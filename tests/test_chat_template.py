"""Chat templates render in a sandbox with a deadline and an output cap."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llmkit.core.server.chat_template import ChatTemplate, TemplateRenderError, check_template_kwargs

MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("src", [
    "{{ lipsum.__globals__['os'].system('touch CANARY') }}",
    "{{ cycler.__init__.__globals__.os.popen('touch CANARY').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
])
def test_sandbox_escapes_fail(src, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TemplateRenderError):
        ChatTemplate(src).render(MSGS, add_generation_prompt=True)
    assert not Path("CANARY").exists()


@pytest.mark.parametrize("src", [
    "{{ 'x' * 10**9 }}",
    "{% for i in range(10**8) %}x{% endfor %}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
])
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
