"""Typing tool-call arguments that a model writes as bare text (XML-style formats).

Formats such as Qwen3-Coder's ``<parameter=days>\\n3\\n</parameter>`` carry no JSON types: the
value is whatever text sits between the tags. As vLLM's and SGLang's parsers do, the request's
tool schema decides: a parameter declared only as ``string`` is the text verbatim; any other
declared type is read as JSON and kept when it has a declared type (a ``string`` alternative
falls back to the text); an undeclared parameter is JSON when the text parses, else the text.
"""

from __future__ import annotations

import json
from typing import Any

#: JSON Schema types, and the Python values json.loads gives for each.
_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}
# Loose names some tool definitions use (vLLM's parser accepts them too).
_ALIASES = {
    "str": "string",
    "text": "string",
    "varchar": "string",
    "char": "string",
    "int": "integer",
    "long": "integer",
    "short": "integer",
    "uint": "integer",
    "float": "number",
    "double": "number",
    "bool": "boolean",
    "dict": "object",
    "list": "array",
}
_ENUM_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN/Infinity would make the arguments invalid JSON


def schema_types(schema: Any) -> frozenset[str] | None:
    """The JSON types a parameter schema allows, or None when it does not say (or uses ``$ref``)."""
    if not isinstance(schema, dict):
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        declared = [declared]
    if isinstance(declared, list) and declared and all(isinstance(t, str) for t in declared):
        return frozenset(_ALIASES.get(t.lower(), t.lower()) for t in declared)
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            found = [schema_types(o) for o in options]
            if any(f is None for f in found):
                return None
            return frozenset().union(*found)  # type: ignore[arg-type]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        names = {_ENUM_TYPES.get(type(v)) for v in enum}
        return None if None in names else frozenset(names)  # type: ignore[arg-type]
    return None


def tool_param_types(tools: list[dict[str, Any]]) -> dict[str, dict[str, frozenset[str] | None]]:
    """``{function: {parameter: types}}`` from the request's OpenAI tool dicts."""
    out: dict[str, dict[str, frozenset[str] | None]] = {}
    for t in tools:
        fn = (t.get("function") or t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = {k: schema_types(v) for k, v in props.items()} if isinstance(props, dict) else {}
    return out


def is_plain_string(types: frozenset[str] | None) -> bool:
    """Whether a value of these types is always its text verbatim (so it can stream as written)."""
    return types == frozenset({"string"})


def convert_value(raw: str, types: frozenset[str] | None) -> Any:
    """The argument value for the text ``raw`` of a parameter declared with ``types``."""
    if is_plain_string(types):
        return raw
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        word = raw.strip().lower()
        if types and "boolean" in types and word in ("true", "false"):
            return word == "true"  # Python-style True/False
        return raw
    if types is None or any(_CHECKS.get(t, lambda v: True)(value) for t in types):
        return value
    return raw if "string" in types else value
