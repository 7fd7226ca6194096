"""Structured-output constraints on requests: response_format, regex, ebnf, and the constrained
decoding behind ``tool_choice`` "required" or a named function."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from llmkit.core.server.errors import APIError

log = logging.getLogger("llmkit")

if TYPE_CHECKING:
    from llmkit.core.server.generation.reasoning import RequestReasoning


def tool_choice_schema(body) -> dict | None:
    """A JSON schema forcing ``[{"name", "parameters"}, ...]`` for required or named tool_choice."""
    tc = getattr(body, "tool_choice", None)
    tools = getattr(body, "tools", None) or []
    if not tools or tc in (None, "none", "auto"):
        return None
    if isinstance(tc, dict):
        name = (tc.get("function") or {}).get("name")
        tools = [t for t in tools if t.function.name == name]
    variants = []
    hoisted: dict[str, dict] = {}
    for t in tools:
        params = _hoist_defs(t.function.name, t.function.parameters or {"type": "object"}, hoisted)
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    item = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = {"type": "array", "items": item, "minItems": 1}
    if isinstance(tc, dict) or not body.parallel_tool_calls:
        schema["maxItems"] = 1
    for key, defs in hoisted.items():
        schema[key] = {name: d for name, (d, _) in defs.items()}
    return schema


_DEF_KEYS = ("$defs", "definitions")


def _hoist_defs(tool: str, params, hoisted: dict) -> dict:
    """Move a tool's local ``$defs`` / ``definitions`` to the root of the combined schema.

    A tool's parameters are nested under ``items.properties.parameters``, but their ``$ref``s
    (``#/$defs/Address``, what pydantic generates for nested models) are relative to the document
    root, so the definitions must live there. Two tools may share a definition name only if the
    definitions are identical; otherwise the references would be ambiguous (a 400).
    """
    if not isinstance(params, dict) or not any(isinstance(params.get(k), dict) for k in _DEF_KEYS):
        return params
    params = dict(params)
    for key in _DEF_KEYS:
        defs = params.pop(key, None)
        if not isinstance(defs, dict):
            if defs is not None:
                raise APIError(f"tool '{tool}': parameters.{key} must be an object", param="tools")
            continue
        seen = hoisted.setdefault(key, {})
        for name, definition in defs.items():
            if name in seen and seen[name][0] != definition:
                raise APIError(
                    f"tools '{seen[name][1]}' and '{tool}' define different schemas under the same name "
                    f"{key}/{name}; rename one of them to force a tool call",
                    param="tools",
                )
            seen.setdefault(name, (definition, tool))
    return params


@dataclass(frozen=True)
class Constraint:
    param: str
    prompt_suffix: str = ""


def _spec(state, body):
    from llmkit.core.grammar.contract import GrammarError, GrammarSpec, spec_from_request

    raw = body.model_dump(
        include={"response_format", "regex", "ebnf", "json_schema", "structural_tag"}, exclude_none=True
    )
    try:
        spec = spec_from_request(raw)
    except GrammarError as exc:
        raise APIError(exc.message, param=exc.param) from None
    schema = tool_choice_schema(body)
    if schema is not None:
        # A forced call is the whole answer: the format (checked above) governs text answers,
        # and there is none here. Letting the format win dropped the call (instructor's
        # RESPONSES_TOOLS mode sends both).
        spec = GrammarSpec("json_schema", schema, param="tool_choice")
    return spec


async def _strict_tools_spec(state, body):
    """The structural tag of strict tool calling for an "auto" request, or None. A grammar the
    backend cannot take (``--grammar-backend none``, a tool schema it refuses) leaves the calls
    unconstrained, as they were before strict calling: a server that cannot constrain still answers."""
    from llmkit.core.grammar.contract import GrammarError, GrammarSpec
    from llmkit.core.server.generation.strict_tools import strict_tools_tag

    tag = strict_tools_tag(body, state.options.tool_call_parser, state.options.strict_tool_calls)
    if tag is None:
        return None
    spec = GrammarSpec("structural_tag", tag, param="tools")
    try:
        await state.client.check_grammar(spec)
    except GrammarError as exc:
        log.info("tool calls left unconstrained: %s", exc.message)
        return None
    return spec


async def attach_grammar(state, body, reqs, reasoning: RequestReasoning | None = None) -> Constraint | None:
    """Check the request's constraint (if any) and put it on each of ``reqs`` (replaced in place:
    messages are frozen). The engine compiles it again from its cache and keeps the matchers.

    With the request's reasoning parser (``reasoning``, resolved once for the request; None for
    the routes without a chat template) starting inside a reasoning block, the grammar waits for
    the parser's end marker, so the reasoning stays free text and only the answer is constrained.
    Without a constraint of its own, a chat request with tools and ``tool_choice`` "auto" gets the
    strict tool-calling tag (:mod:`.strict_tools`). A reasoning budget (:mod:`.reasoning_budget`)
    puts the reasoning under the grammar as well, before the answer's constraint. Returns None when the request is unconstrained,
    else a :class:`Constraint`: the request field it came from (``"tool_choice"`` for a forced tool
    call, ``"tools"`` for strict "auto" calls) and the text added to the prompt
    (the reasoning parser's ``constrained_answer_prefix``, usually empty).
    """
    from llmkit.core.grammar.contract import GrammarError, GrammarSpec
    from llmkit.core.server.generation.reasoning_budget import answer_format, budget_tag, reasoning_budget

    spec = _spec(state, body)
    parser = reasoning.new_parser() if reasoning is not None else None  # where the prompt leaves it
    after = parser.reasoning_end_markers if parser is not None else ()
    prefix = parser.constrained_answer_prefix if parser is not None else ""
    budget = reasoning_budget(body)
    if spec is None and not prefix:
        # "auto" tool calls: constrained only where free text may follow the reasoning as is
        spec = await _strict_tools_spec(state, body)
    if budget is not None and after and not prefix:
        # the grammar covers the reasoning too: at most `budget` tokens, then the parser's end marker
        param = spec.param if spec is not None else "reasoning_effort"
        spec, after = GrammarSpec("structural_tag", budget_tag(budget, after[0], answer_format(spec)), param), ()
    if spec is None:
        return None
    try:
        await state.client.check_grammar(spec)
    except GrammarError as exc:
        raise APIError(exc.message, param=exc.param) from None
    if prefix:  # the prompt ends where no answer can start (gpt-oss: inside a message header)
        ids = state.tokenizer(prefix, add_special_tokens=False)["input_ids"]
        reqs[:] = [replace(r, prompt_ids=list(r.prompt_ids) + ids) for r in reqs]
    reqs[:] = [replace(r, grammar=spec, grammar_after=after) for r in reqs]
    return Constraint(spec.param, prefix)
