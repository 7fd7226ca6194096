"""Validation of batch input files (hostile-input catalogue rows 36 and 37)."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from llmkit.core.batches import validation as bv
from llmkit.core.batches.validation import BatchValidator, iter_lines, normalize_url

CHAT = "/v1/chat/completions"


def line(i=0, **over) -> dict:
    d = {
        "custom_id": f"r-{i}",
        "method": "POST",
        "url": CHAT,
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    d.update(over)
    return d


def validate(data: bytes, endpoint: str = CHAT, chunk: int = 1 << 16) -> BatchValidator:
    v = BatchValidator(endpoint)
    for i in range(0, len(data), chunk):
        v.feed(data[i : i + chunk])
    v.finish()
    return v


def codes(v: BatchValidator) -> list[tuple[str, int | None]]:
    return [(e["code"], e["line"]) for e in v.errors]


def dump(*objs) -> bytes:
    return b"".join((o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n" for o in objs)


def test_valid_file_any_chunking():
    data = dump(line(0), line(1, url="/chat/completions"), line(2))  # the SGLang docs' short url
    for chunk in (1, 7, 1 << 16):
        v = validate(data, chunk=chunk)
        assert v.errors == [] and v.total == 3 and v.model == "m"


def test_blank_lines_and_missing_final_newline():
    v = validate(dump(line(0)) + b"\n  \n" + json.dumps(line(1)).encode())
    assert v.errors == [] and v.total == 2


@pytest.mark.parametrize(
    "bad, code, param",
    [
        (b"{not json", "invalid_json_line", None),
        (b"[1, 2]", "invalid_json_line", None),
        (b'"\\ud800 lone surrogate"', "invalid_json_line", None),
        (b"\xff\xfe garbage", "invalid_json_line", None),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json_line", None),
        (line(1, custom_id=None), "missing_required_parameter", "custom_id"),
        (line(1, custom_id=""), "missing_required_parameter", "custom_id"),
        (line(1, custom_id="x" * 600), "invalid_custom_id", "custom_id"),
        (line(1, method="GET"), "invalid_method", "method"),
        (line(1, url="/v1/completions"), "invalid_url", "url"),
        (line(1, url="/v1/embeddings"), "invalid_url", "url"),
        (line(1, body="text"), "invalid_request", "body"),
        (line(1, body={"messages": [], "model": "m"}), "invalid_request", "body"),
        (
            line(1, body={"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}),
            "invalid_request",
            "body.stream",
        ),
    ],
)
def test_bad_line_reports_code_param_and_line(bad, code, param):
    v = validate(dump(line(0), bad, line(2)))
    assert len(v.errors) == 1
    err = v.errors[0]
    assert (err["code"], err["line"], err["param"]) == (code, 2, param) and err["message"]


def test_duplicate_custom_id():
    v = validate(dump(line(0), line(1), line(0)))
    assert codes(v) == [("duplicate_custom_id", 3)]


def test_completions_endpoint():
    good = line(0, url="/v1/completions", body={"model": "m", "prompt": "hi"})
    bad = line(1, url="/v1/completions", body={"model": "m"})
    v = validate(dump(good, bad), endpoint="/v1/completions")
    assert codes(v) == [("invalid_request", 2)]


def test_custom_body_validator():
    v = BatchValidator(
        CHAT, body_validator=lambda ep, body: "max_tokens must be positive" if body.get("max_tokens", 1) <= 0 else None
    )
    v.feed(dump(line(0), line(1, body={"messages": [{}], "max_tokens": 0})))
    assert [(e["line"], e["message"]) for e in v.finish()] == [(2, "max_tokens must be positive")]


def test_empty_file():
    assert codes(validate(b"")) == [("empty_file", None)]
    assert codes(validate(b"\n\n  \n")) == [("empty_file", None)]


def test_too_many_lines_stops_with_bounded_memory():
    one = json.dumps(line(0)).encode()
    v = BatchValidator(CHAT)
    tracemalloc.start()
    for i in range(bv.MAX_LINES + 10):
        v.feed(one.replace(b"r-0", b"r-%d" % i) + b"\n")
        if v.full:
            break
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert codes(v)[-1] == ("too_many_requests", bv.MAX_LINES + 1)
    assert peak < 30 * 1024 * 1024  # the custom_id set, not the file


def test_error_list_is_capped():
    v = validate(b"{bad\n" * (bv.MAX_ERRORS * 3))
    assert len(v.errors) == bv.MAX_ERRORS and v.full


def test_overlong_line_is_refused_without_buffering(monkeypatch):
    monkeypatch.setattr(bv, "MAX_LINE_BYTES", 1000)
    v = BatchValidator(CHAT)
    v._splitter = bv.LineSplitter(1000)
    v.feed(dump(line(0)))
    for _ in range(10):
        v.feed(b"x" * 500)  # no newline: one endless line
    v.finish()
    assert codes(v) == [("line_too_long", 2)]


def test_file_size_cap(monkeypatch):
    monkeypatch.setattr(bv, "MAX_FILE_BYTES", 2000)
    v = validate(dump(*[line(i) for i in range(40)]), chunk=500)
    assert codes(v) == [("file_too_large", None)]


def test_iter_lines_indices_skip_blanks():
    data = b'{"a":1}\n\n{"a":2}\n  \n{"a":3}'
    assert [(i, json.loads(x)["a"]) for i, x in iter_lines([data[:5], data[5:]])] == [(0, 1), (1, 2), (2, 3)]


def test_normalize_url():
    assert normalize_url("/chat/completions") == CHAT
    assert normalize_url("chat/completions") == CHAT
    assert normalize_url(CHAT) == CHAT
