"""Shared pieces of the Anthropic and Responses API tests: a server with the reasoning test
template, tool schemas, and raw-body helpers for hostile input."""

from __future__ import annotations

from pathlib import Path

import httpx

THINK_TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "think_template.jinja"
REASONING_ARGS = ["--chat-template", str(THINK_TEMPLATE), "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"]

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TIME_SCHEMA = {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}

# Hostile bodies from the reliability catalogue: (raw bytes, content type), each must be a 4xx.
RAW_BAD_BODIES = [
    (b'{"model":', "application/json"),  # truncated JSON
    (b"[1, 2]", "application/json"),  # not an object
    (b"null", "application/json"),
    (b'"text"', "application/json"),
    (b'{"model": "\xff\xfe"}', "application/json"),  # invalid UTF-8
    (b"[" * 100_000 + b"]" * 100_000, "application/json"),  # nested deeply
    (b'{"model": "m"}', "text/plain"),  # wrong content type
    (b'{"temperature": NaN}', "application/json"),
]


def post_raw(base_url: str, path: str, content: bytes, ctype: str, headers: dict | None = None):
    return httpx.post(base_url + path, content=content, timeout=60, headers={"content-type": ctype, **(headers or {})})


def healthy(base_url: str) -> bool:
    return httpx.get(base_url + "/health", timeout=30).status_code == 200
