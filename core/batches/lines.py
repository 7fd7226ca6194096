"""Building batch output/error lines, and writing a finished batch's output files.

Order of lines: the output file holds the successful lines and the error file the failed ones,
each in input-file order (not completion order), whichever run of the server produced them.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from llmkit.core.batches.storage import BatchRecord, BatchResult, FileRecord, StorageBackend


def output_line(batch_id: str, index: int, custom_id: str, status: int, body: dict) -> BatchResult:
    """The result of one executed line: 200 goes to the output file, anything else to errors."""
    line_id = "batch_req_" + secrets.token_hex(16)
    if status == 200:
        data: dict[str, Any] = {
            "id": line_id,
            "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": f"{batch_id}-req_{index}", "body": body},
            "error": None,
        }
        return BatchResult(index, "output", json.dumps(data, ensure_ascii=False))
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {}
    code = err.get("code") or err.get("type") or ("server_error" if status >= 500 else "invalid_request")
    message = str(err.get("message") or f"The request failed with status {status}.")
    return error_line(batch_id, index, custom_id, str(code), message)


def error_line(batch_id: str, index: int, custom_id: str, code: str, message: str) -> BatchResult:
    data = {
        "id": "batch_req_" + secrets.token_hex(16),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return BatchResult(index, "error", json.dumps(data, ensure_ascii=False))


def write_output_files(storage: StorageBackend, batch: BatchRecord) -> None:
    """Write the output and error files of ``batch`` from its stored results (blocking).

    Uses the ``pending_*`` ids chosen on entering finalization, so running it again after a
    crash replaces the same files. Sets ``output_file_id``/``error_file_id`` (None when that
    file would be empty), ``request_counts`` and ``usage`` on ``batch``.
    """
    counts = {"output": 0, "error": 0}
    usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
    for kind, file_id, suffix in (
        ("output", batch.pending_output_file_id, "output"),
        ("error", batch.pending_error_file_id, "error"),
    ):
        assert file_id is not None

        def lines(kind: str = kind):
            for result in storage.iter_results(batch.id, kind):
                counts[kind] += 1
                if kind == "output":
                    _add_usage(usage, result.line)
                yield result.line.encode() + b"\n"

        size = storage.write_blob(file_id, lines())
        if counts[kind] == 0:
            storage.delete_blob(file_id)
            continue
        storage.put_file(
            FileRecord(
                id=file_id,
                bytes=size,
                created_at=int(time.time()),
                filename=f"{batch.id}_{suffix}.jsonl",
                purpose="batch_output",
                created_ns=time.time_ns(),
                owner=batch.owner,  # the results belong to whoever made the batch
            )
        )
        setattr(batch, f"{suffix}_file_id", file_id)
    batch.request_counts = {
        "total": batch.request_counts.get("total", 0),
        "completed": counts["output"],
        "failed": counts["error"],
    }
    batch.usage = usage


def _add_usage(usage: dict[str, int], line: str) -> None:
    try:
        u = json.loads(line)["response"]["body"].get("usage") or {}
        usage["input_tokens"] += int(u.get("prompt_tokens") or 0)
        usage["output_tokens"] += int(u.get("completion_tokens") or 0)
        usage["total_tokens"] += int(u.get("total_tokens") or 0)
    except (ValueError, KeyError, TypeError, AttributeError):
        pass  # usage is informative; a body without it must not break finalization
