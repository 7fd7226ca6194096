"""Reasoning budgets that hold: ``reasoning_effort`` (OpenAI; Responses' ``reasoning.effort``),
vLLM's ``thinking_token_budget`` and Anthropic's ``thinking.budget_tokens`` become a token budget
for the reasoning section, enforced by the grammar backend.

The output's grammar becomes: reasoning as free text of at most the budget's tokens, closed by
the reasoning parser's own end marker (``</think>``) — the model may close it sooner; when the
budget runs out, only the marker is allowed — then the answer, under the request's own constraint
(a schema, a structural tag, strict tool calls) or free. Nothing is cut: the answer follows.
"""

from __future__ import annotations

from llmkit.core.server.errors import APIError

#: ``reasoning_effort`` -> reasoning tokens. One table for every family (the thinking models llmkit
#: serves all close reasoning with one marker); ``none`` asks the template not to think at all.
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384}


def reasoning_budget(body) -> int | None:
    """The request's reasoning budget in tokens, or None for no budget. An explicit
    ``thinking_token_budget`` wins over ``reasoning_effort``."""
    budget = getattr(body, "thinking_token_budget", None)
    if budget is not None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise APIError("thinking_token_budget must be a positive integer", param="thinking_token_budget")
        return budget
    return EFFORT_BUDGETS.get(getattr(body, "reasoning_effort", None) or "")


def answer_format(spec) -> dict:
    """A request constraint (:class:`~llmkit.core.grammar.contract.GrammarSpec`, or None for free
    text) as a structural-tag format, to follow the reasoning section."""
    import json

    if spec is None:
        return {"type": "any_text"}
    if spec.kind == "structural_tag":
        return spec.value["format"]
    if spec.kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if spec.kind == "json_schema":
        schema = json.loads(spec.value) if isinstance(spec.value, str) else spec.value
        return {"type": "json_schema", "json_schema": schema}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.value}
    return {"type": "grammar", "grammar": spec.value}


def budget_tag(budget: int, end_marker: str, answer: dict) -> dict:
    """The structural tag: at most ``budget`` tokens of reasoning, ``end_marker``, the answer."""
    reasoning = {"type": "tag", "begin": "", "content": {"type": "any_text", "max_tokens": budget}, "end": end_marker}
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": [reasoning, answer]}}
