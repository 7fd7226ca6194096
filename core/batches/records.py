"""The records the Files and Batches storage keeps (``storage.py`` is the interface that stores
them): the OpenAI file and batch objects with their private fields, and one finished batch line."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping


class _Record:
    """JSON round-trip shared by the record dataclasses; unknown keys are ignored on load."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class FileRecord(_Record):
    """An OpenAI file object. ``purpose`` is ``batch`` (uploads) or ``batch_output`` (results)."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    created_ns: int = 0  # private: orders records made within the same second
    owner: str | None = None  # private: the owner id of the key that made it (None: no owner)

    def sort_key(self) -> tuple[int, str]:
        """Listing order key (lists are sorted by it, descending)."""
        return (self.created_ns or self.created_at * 10**9, self.id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }


TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled", "expired"})
ACTIVE_STATUSES = frozenset({"validating", "in_progress", "finalizing", "cancelling"})


@dataclass
class BatchRecord(_Record):
    """An OpenAI batch object; fields starting with ``pinned_``/``pending_`` are private."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = "validating"
    metadata: dict[str, str] | None = None
    model: str | None = None
    errors: list[dict[str, Any]] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: dict[str, int] = field(default_factory=lambda: {"total": 0, "completed": 0, "failed": 0})
    usage: dict[str, int] = field(default_factory=lambda: {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0})
    # The batch's own copy of its input, taken while validating, so deleting the input file
    # mid-batch cannot change or break the batch.
    pinned_input_id: str | None = None
    # Output/error file ids chosen on entering ``finalizing``, so a finalize redone after a
    # restart overwrites the same files instead of leaving orphans.
    pending_output_file_id: str | None = None
    pending_error_file_id: str | None = None
    created_ns: int = 0  # private: orders records made within the same second
    owner: str | None = None  # private: the owner id of the key that made it (None: no owner)

    def sort_key(self) -> tuple[int, str]:
        """Listing order key (lists are sorted by it, descending)."""
        return (self.created_ns or self.created_at * 10**9, self.id)

    def to_openai(self) -> dict[str, Any]:
        private = ("pinned_", "pending_", "created_ns", "owner")
        d = {k: v for k, v in self.to_dict().items() if not k.startswith(private)}
        d["object"] = "batch"
        d["errors"] = {"object": "list", "data": self.errors} if self.errors is not None else None
        u = self.usage
        d["usage"] = {
            "input_tokens": u["input_tokens"],
            "output_tokens": u["output_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
        return d


@dataclass(frozen=True)
class BatchResult:
    """One finished line: ``kind`` is ``"output"`` or ``"error"``; ``line`` is its JSON text."""

    index: int
    kind: str
    line: str
