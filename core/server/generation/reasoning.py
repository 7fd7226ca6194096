"""A request's reasoning parser, resolved once where the request is parsed.

Three things read it: whether special tokens must survive detokenization (a parser's markers may
be special tokens), where a constraint may start (a grammar waits for the parser's end marker),
and each choice's text (a per-choice parser splits reasoning from content). They used to decide
separately whether a parser applies, look up its class, and build their own from the request's
fields, and could disagree (the grammar's parser did not see ``reasoning_effort``'s template
kwarg). :func:`request_reasoning` decides once; the three read the :class:`RequestReasoning` it
returns. ``/separate_reasoning`` (a parser named by the request) resolves through
:func:`named_reasoning`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from llmkit.core.parsing.reasoning import ReasoningParser


@dataclass(frozen=True)
class RequestReasoning:
    """One request's parser kind and what it parses against: the rendered prompt (where output
    starts: inside a block the template opened, or with thinking off) and the template kwargs."""

    parser_class: type[ReasoningParser]
    prompt_text: str = ""
    template_kwargs: Mapping[str, Any] | None = None
    stream_reasoning: bool = True

    @property
    def keep_special_tokens(self) -> bool:
        """Whether the parser's markers are special tokens that detokenizing must keep."""
        return bool(getattr(self.parser_class, "keep_special_tokens", False))

    def new_parser(self) -> ReasoningParser:
        """A fresh per-choice parser (a streaming state machine: one per choice)."""
        return self.parser_class(
            prompt_text=self.prompt_text,
            chat_template_kwargs=self.template_kwargs,
            stream_reasoning=self.stream_reasoning,
        )

    def after_prompt_suffix(self, suffix: str) -> RequestReasoning:
        """The same, parsing output that follows ``prompt_text + suffix`` (a constrained answer's
        prefix the server appended to the prompt)."""
        return replace(self, prompt_text=self.prompt_text + suffix) if suffix else self


def named_reasoning(name: str, **fields) -> RequestReasoning:
    """The parser registered as ``name`` (raises the registry's ``PluginError`` listing the valid
    names when unknown)."""
    from llmkit.core.parsing.reasoning import reasoning_parser_class

    return RequestReasoning(reasoning_parser_class(name), **fields)


def request_reasoning(state, body, prompt_text: str, template_kwargs: Mapping[str, Any]) -> RequestReasoning | None:
    """A chat request's reasoning: the server's ``--reasoning-parser`` unless the request turned
    separation off (``separate_reasoning: false``); None when there is none. ``template_kwargs``
    are the ones the prompt was rendered with (``reasoning_effort`` included). A non-streaming
    request buffers reasoning: a block the template opened that ends with "stop" and no end tag
    is then returned as the answer instead of being lost as reasoning."""
    name = state.options.reasoning_parser
    if not name or not getattr(body, "separate_reasoning", True):
        return None
    return named_reasoning(
        name,
        prompt_text=prompt_text,
        template_kwargs=dict(template_kwargs),
        stream_reasoning=bool(getattr(body, "stream_reasoning", True) and getattr(body, "stream", False)),
    )
