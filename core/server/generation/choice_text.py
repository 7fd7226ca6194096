"""Per-choice text post-processing: reasoning separation and tool-call parsing.

One processor per choice serves streaming and non-streaming alike (non-streaming feeds the whole
text, then finishes), so both modes produce the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmkit.core.server.generation.reasoning import RequestReasoning


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChoiceProcessor:
    def __init__(self, *, reasoning: RequestReasoning | None, tool_parser: str | None, tools: list | None) -> None:
        """``reasoning``: the request's, resolved once (``generation/reasoning.py``); each choice
        gets its own parser from it (the parsers are streaming state machines)."""
        self.reasoning = reasoning.new_parser() if reasoning is not None else None
        self.tools = None
        if tool_parser and tools:
            from llmkit.core.parsing.tool_parser import create_tool_parser

            self.tools = create_tool_parser(tool_parser, tools=tools)
        self.reasoning_text = ""
        self.content_text = ""
        self.made_tool_calls = False

    def _route(self, r: str, c: str) -> ChoiceDelta:
        delta = ChoiceDelta(reasoning=r)
        if c and self.tools is not None:
            td = self.tools.feed(c)
            delta.content = td.content
            delta.tool_calls = [_call_delta(x) for x in td.calls]
        else:
            delta.content = c
        return delta

    def feed(self, text: str) -> ChoiceDelta:
        if self.reasoning is not None:
            r, c = self.reasoning.feed(text)
        else:
            r, c = "", text
        return self._account(self._route(r, c))

    def finish(self, finish_reason: str | None) -> ChoiceDelta:
        r, c = ("", "")
        if self.reasoning is not None:
            r, c = self.reasoning.finish(finish_reason or "stop")
        delta = self._route(r, c)
        if self.tools is not None:
            td = self.tools.finish()
            delta.content += td.content
            delta.tool_calls += [_call_delta(x) for x in td.calls]
        return self._account(delta)

    def _account(self, d: ChoiceDelta) -> ChoiceDelta:
        self.reasoning_text += d.reasoning
        self.content_text += d.content
        if d.tool_calls:
            self.made_tool_calls = True
        return d

    def final_tool_calls(self) -> list[dict]:
        if self.tools is None:
            return []
        return [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            for cid, name, args in (_call_tuple(c) for c in self.tools.calls)
        ]


def _call_delta(x) -> dict:
    out: dict = {"index": x.index}
    if getattr(x, "id", None):
        out["id"] = x.id
        out["type"] = "function"
    fn = {}
    if getattr(x, "name", None):
        fn["name"] = x.name
    fn["arguments"] = getattr(x, "arguments", "") or ""
    out["function"] = fn
    return out


def _call_tuple(c) -> tuple[str, str, str]:
    if isinstance(c, tuple):
        return c
    return c.id, c.name, c.arguments
