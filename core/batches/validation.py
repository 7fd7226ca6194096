"""Validation of a batch input file, fed as a stream of chunks with bounded memory.

Every line must be a JSON object with a unique string ``custom_id``, ``method`` ``POST``, a
``url`` equal to the batch endpoint (``/chat/completions`` and ``/v1/chat/completions`` are the
same), and a ``body`` object valid for that endpoint without ``stream: true``. A file has at most
50,000 lines and 200 MB (OpenAI's limits). Errors carry OpenAI's ``{code, message, param, line}``
with 1-based line numbers; blank lines are skipped but counted.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Iterator

MAX_LINES = 50_000
MAX_FILE_BYTES = 200 * 1024 * 1024
MAX_LINE_BYTES = 32 * 1024 * 1024  # one request body; a longer "line" is refused, not buffered
MAX_CUSTOM_ID_CHARS = 512
MAX_ERRORS = 100  # the rest would only repeat the lesson; validation stops here
SUPPORTED_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")  # a generative model's
EMBEDDING_ENDPOINTS = ("/v1/embeddings",)  # an embedding model's

# (endpoint, body) -> an error message, or None when the body is valid. The server passes one
# built from its request models; the default only checks the shape.
BodyValidator = Callable[[str, dict], "str | None"]


def normalize_url(url: str) -> str:
    """``/chat/completions`` -> ``/v1/chat/completions`` (the SGLang docs use the short form)."""
    return url if url.startswith("/v1/") else "/v1" + (url if url.startswith("/") else "/" + url)


def default_body_validator(endpoint: str, body: dict) -> str | None:
    if endpoint == "/v1/chat/completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            return "body.messages must be a non-empty array of message objects"
    elif endpoint == "/v1/completions":
        if "prompt" not in body:
            return "body.prompt is required"
    elif endpoint == "/v1/embeddings":
        if "input" not in body:
            return "body.input is required"
    return None


class LineSplitter:
    """Turns chunks into ``(line_no, bytes)`` pairs without ever holding more than one line."""

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._buf = bytearray()
        self._line_no = 0
        self._max = max_line_bytes

    def feed(self, chunk: bytes) -> Iterator[tuple[int, bytes | None]]:
        """Yield complete lines; ``None`` stands for a line over the size cap."""
        self._buf += chunk
        while (nl := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            self._line_no += 1
            yield self._line_no, (line if len(line) <= self._max else None)
        if len(self._buf) > self._max:
            raise LineTooLongError(self._line_no + 1)

    def finish(self) -> Iterator[tuple[int, bytes]]:
        if self._buf:
            self._line_no += 1
            yield self._line_no, bytes(self._buf)
            self._buf.clear()


class LineTooLongError(ValueError):
    def __init__(self, line: int) -> None:
        super().__init__(f"line {line} is longer than {MAX_LINE_BYTES} bytes")
        self.line = line


def iter_lines(chunks: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """Yield ``(0-based index, raw line)`` for every non-blank line of an already-valid file."""
    splitter = LineSplitter(max_line_bytes=1 << 62)
    index = 0
    for chunk in chunks:
        for _, line in splitter.feed(chunk):
            if line and line.strip():
                yield index, line
                index += 1
    for _, line in splitter.finish():
        if line.strip():
            yield index, line


class BatchValidator:
    """Feed the input file chunk by chunk, then call :meth:`finish` for the errors and counts."""

    def __init__(self, endpoint: str, body_validator: BodyValidator | None = None) -> None:
        self.endpoint = endpoint
        self.body_validator = body_validator or default_body_validator
        self.errors: list[dict[str, Any]] = []
        self.total = 0  # non-blank lines = requests
        self.model: str | None = None
        self._bytes = 0
        self._custom_ids: set[str] = set()
        self._splitter = LineSplitter()
        self._stopped = False

    @property
    def full(self) -> bool:
        """True once validation has stopped early (too many errors or a hard limit)."""
        return self._stopped

    def _error(self, code: str, message: str, line: int | None, param: str | None = None) -> None:
        self.errors.append({"code": code, "message": message, "param": param, "line": line})
        if len(self.errors) >= MAX_ERRORS:
            self._stopped = True

    def feed(self, chunk: bytes) -> None:
        if self._stopped:
            return
        self._bytes += len(chunk)
        if self._bytes > MAX_FILE_BYTES:
            self._error("file_too_large", f"The input file is larger than {MAX_FILE_BYTES} bytes.", None)
            self._stopped = True
            return
        try:
            for line_no, line in self._splitter.feed(chunk):
                self._check_line(line_no, line)
                if self._stopped:
                    return
        except LineTooLongError as exc:
            self._error("line_too_long", str(exc), exc.line)
            self._stopped = True

    def finish(self) -> list[dict[str, Any]]:
        """Validate the last line and return every error (empty if the file is valid)."""
        if not self._stopped:
            for line_no, line in self._splitter.finish():
                self._check_line(line_no, line)
        if not self.errors and self.total == 0:
            self._error("empty_file", "The input file contains no requests.", None)
        return self.errors

    def _check_line(self, line_no: int, raw: bytes | None) -> None:
        if raw is None:
            self._error("line_too_long", f"Line is longer than {MAX_LINE_BYTES} bytes.", line_no)
            return
        if not raw.strip():
            return
        self.total += 1
        if self.total > MAX_LINES:
            self._error("too_many_requests", f"The input file has more than {MAX_LINES} requests.", line_no)
            self._stopped = True
            return
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: hostile nesting depth
            self._error("invalid_json_line", "This line is not valid JSON.", line_no)
            return
        if not isinstance(obj, dict):
            self._error("invalid_json_line", "Each line must be a JSON object.", line_no)
            return
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            self._error("missing_required_parameter", "custom_id must be a non-empty string.", line_no, "custom_id")
        elif len(cid) > MAX_CUSTOM_ID_CHARS:
            self._error(
                "invalid_custom_id", f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters.", line_no, "custom_id"
            )
        elif cid in self._custom_ids:
            self._error("duplicate_custom_id", f"The custom_id '{cid}' is used more than once.", line_no, "custom_id")
        else:
            self._custom_ids.add(cid)
        if obj.get("method") != "POST":
            self._error("invalid_method", "method must be POST.", line_no, "method")
        url = obj.get("url")
        if not isinstance(url, str) or normalize_url(url) != self.endpoint:
            self._error("invalid_url", f"url must be the batch endpoint {self.endpoint}.", line_no, "url")
        body = obj.get("body")
        if not isinstance(body, dict):
            self._error("invalid_request", "body must be a JSON object.", line_no, "body")
            return
        if body.get("stream"):
            self._error("invalid_request", "Streaming is not supported in batches.", line_no, "body.stream")
            return
        problem = self.body_validator(self.endpoint, body)
        if problem:
            self._error("invalid_request", problem, line_no, "body")
        if self.model is None and isinstance(body.get("model"), str):
            self.model = body["model"]
