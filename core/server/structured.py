"""Structured-output constraints on requests (response_format, regex, ebnf)."""

from __future__ import annotations

from llmkit.core.server.errors import APIError


def requested_constraint(body) -> bool:
    rf = body.response_format
    has_rf = bool(rf) and rf.get("type") not in (None, "text")
    return has_rf or bool(body.regex) or bool(body.ebnf) or bool(getattr(body, "json_schema", None))


async def attach_grammar(state, body, reqs) -> None:
    """Compile the request's constraint (if any) and give each request its own matcher."""
    if not requested_constraint(body):
        return
    if state.grammar is None:
        raise APIError("structured output is disabled on this server (--grammar-backend none)",
                       param="response_format")
    raise APIError("structured output is not available yet", param="response_format")
