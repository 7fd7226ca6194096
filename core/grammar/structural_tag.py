"""``response_format: {"type": "structural_tag", ...}``: free text with tagged regions whose bodies
follow a format, in the two request shapes SGLang and vLLM accept.

* The older shape: ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``. Text is
  free until a trigger appears; the structure whose ``begin`` starts with it follows, its body a
  JSON value of ``schema``, then ``end``; free text again.
* xgrammar's newer shape: ``{"format": {...}}``, a tree of formats (``triggered_tags``, ``tag``,
  ``json_schema``, ``sequence``, ``any_text``, ...) that the backend validates.

Both become one canonical value, ``{"type": "structural_tag", "format": {...}}``, so the older shape
is the newer one's ``triggered_tags`` and one compiler entry point serves both. Only the shape of
the request is checked here; what a format means is the backend's to judge (a 400 either way).
"""

from __future__ import annotations

import json
from typing import Any

PARAM = "response_format"


def structural_tag_value(rf: dict) -> dict:
    """The canonical ``{"type": "structural_tag", "format": ...}`` of a ``response_format`` dict
    whose type is ``structural_tag``; raises ValueError (a client-facing message) on a bad shape."""
    has_format, has_legacy = "format" in rf, "structures" in rf or "triggers" in rf
    if has_format and has_legacy:
        raise ValueError("response_format: give either format, or structures and triggers, not both")
    if has_format:
        fmt = rf["format"]
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise ValueError("response_format.format must be an object with a type")
        return {"type": "structural_tag", "format": fmt}
    if not has_legacy:
        raise ValueError("response_format of type structural_tag needs format, or structures and triggers")
    return {"type": "structural_tag", "format": _triggered_tags(rf.get("structures"), rf.get("triggers"))}


def _triggered_tags(structures: Any, triggers: Any) -> dict:
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("response_format.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("response_format.structures must be a non-empty list")
    tags = []
    for i, s in enumerate(structures):
        where = f"response_format.structures[{i}]"
        if not isinstance(s, dict):
            raise ValueError(f"{where} must be an object")
        begin, end = s.get("begin"), s.get("end")
        schema = s.get("schema", s.get("schema_"))
        if not isinstance(begin, str) or not begin or not isinstance(end, str):
            raise ValueError(f"{where} needs a non-empty begin and an end string")
        if isinstance(schema, str):  # some clients send the schema as JSON text
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"{where}.schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{where}.schema must be a JSON schema object")
        if not any(begin.startswith(t) for t in triggers):
            # xgrammar would refuse it too, less clearly: text could never reach this structure
            raise ValueError(f"{where}.begin {begin!r} starts with none of the triggers")
        tags.append(
            {"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": schema}, "end": end}
        )
    return {"type": "triggered_tags", "triggers": list(triggers), "tags": tags}
