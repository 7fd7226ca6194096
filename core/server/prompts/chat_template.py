"""Chat templates rendered in a sandbox with a deadline and an output cap.

Templates come from the model's tokenizer or ``--chat-template FILE``; requests cannot supply one.
The sandbox blocks attribute tricks (``lipsum.__globals__``); a trace hook stops a render that
runs past its deadline, and multiplication results are capped, so a hostile template cannot wedge
or exhaust the server.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_DEADLINE_S = 5.0
MAX_OUTPUT_CHARS = 8 << 20
# chat_template_kwargs may only carry scalars, and never override the renderer's own arguments.
RESERVED_KWARGS = {
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "chat_template",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "tokenizer_kwargs",
}


class TemplateRenderError(Exception):
    """The template failed, raised an exception on purpose, or exceeded a limit."""


class _Deadline(Exception):
    pass


class _Env(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*" and isinstance(left, (str, list)) and isinstance(right, int):
            if len(left) * right > MAX_OUTPUT_CHARS:
                raise TemplateRenderError("template output limit exceeded")
        if operator == "*" and isinstance(right, (str, list)) and isinstance(left, int):
            if len(right) * left > MAX_OUTPUT_CHARS:
                raise TemplateRenderError("template output limit exceeded")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 256:
            raise TemplateRenderError("exponent too large in template")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str):
    raise TemplateRenderError(message)


def _tojson(value, indent=None, ensure_ascii=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = _Env(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        self.source = source
        self.template = env.from_string(source)
        from jinja2 import meta

        # Templates that never read `tools` get them in the system prompt (server/tool_prompt.py).
        self.supports_tools = "tools" in meta.find_undeclared_variables(env.parse(source))
        self.special = {"bos_token": bos_token, "eos_token": eos_token}

    def render(
        self, messages: list[dict], *, add_generation_prompt: bool, tools=None, extra: dict[str, Any] | None = None
    ) -> str:
        variables = {
            **self.special,
            **(extra or {}),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        if tools:
            variables["tools"] = tools
        deadline = time.monotonic() + RENDER_DEADLINE_S

        def tracer(frame, event, arg):
            if time.monotonic() > deadline:
                raise _Deadline()
            return tracer

        old = sys.gettrace()
        sys.settrace(tracer)
        try:
            out = self.template.render(**variables)
        except _Deadline:
            raise TemplateRenderError(f"chat template rendering exceeded {RENDER_DEADLINE_S:.0f} s") from None
        except TemplateRenderError:
            raise
        except (
            TemplateError,
            TypeError,
            ValueError,
            OverflowError,
            AttributeError,
            KeyError,
            IndexError,
            RecursionError,
        ) as exc:
            raise TemplateRenderError(f"chat template error: {exc}") from None
        finally:
            sys.settrace(old)
        if len(out) > MAX_OUTPUT_CHARS:
            raise TemplateRenderError("template output limit exceeded")
        return out


def check_template_kwargs(kwargs: dict | None) -> dict:
    """Validate request ``chat_template_kwargs``; ``thinking`` and ``enable_thinking`` are synonyms."""
    if not kwargs:
        return {}
    out = {}
    for k, v in kwargs.items():
        if k in RESERVED_KWARGS:
            raise ValueError(f"chat_template_kwargs may not set '{k}'")
        if not isinstance(v, (str, int, float, bool, type(None))):
            raise ValueError(f"chat_template_kwargs['{k}'] must be a string, number, boolean or null")
        out[k] = v
    if "enable_thinking" in out and "thinking" not in out:
        out["thinking"] = out["enable_thinking"]
    elif "thinking" in out and "enable_thinking" not in out:
        out["enable_thinking"] = out["thinking"]
    return out
