"""Storage for the Files and Batches API: the interface every backend implements.

A backend stores four things:

* **blobs** -- the bytes of a file, keyed by its file id (``file-`` + 32 hex digits);
* **file records** -- the OpenAI file object (:class:`FileRecord`);
* **batch records** -- the OpenAI batch object plus a few private fields (:class:`BatchRecord`);
* **batch results** -- one finished output or error line per input line of a running batch,
  keyed by ``(batch_id, line index)``, so a restarted server skips lines already done and every
  ``custom_id`` reaches the output exactly once;
* **records** (optional) -- small JSON objects keyed by ``(kind, key)``, e.g. stored Responses
  API responses (kind ``response``). A backend without them serves files and batches only;
* **leases** (optional) -- which replica runs each batch, until when: replicas sharing the
  storage run every batch exactly once, and take over one whose holder died. A backend without
  them (or without records) suits one server per storage only.

Writing a third-party backend
-----------------------------
Subclass :class:`StorageBackend`, implement every abstract method, and register it from your
package's ``llmkit`` entry point::

    # pyproject.toml:  [project.entry-points.llmkit]  my_storage = "my_pkg.storage"
    from llmkit.core.hookspecs import hookimpl

    @hookimpl
    def llmkit_register_storage_backends(register):
        register("mystore", "my_pkg.storage:MyStorage")

``llmkit serve --batch-storage mystore`` then builds it with ``MyStorage.from_options(options)``
(by default ``MyStorage(**options)``; options are strings from the command line).

Contract, checked by :class:`llmkit.testing.storage.StorageContract` (subclass it in your test suite):

* Methods are synchronous and may block; llmkit calls them from worker threads, possibly several
  at once, so a backend must be thread-safe.
* Every method taking an id calls :func:`check_file_id` / :func:`check_batch_id` before any I/O;
  a malformed id raises :class:`NotFoundError`, exactly as an unknown one does.
* Writes are atomic: a reader sees the old value or the new one, never a torn one; a failed or
  oversize blob write leaves nothing behind.
* Records round-trip through ``to_dict``/``from_dict`` (JSON only; never pickle), ``owner``
  included: the owner id of the API key that made the file or batch (None: no owner, as for
  records stored before keys had owners), which decides who sees it after a restart too
  (``core/server/access/owners.py``). Stored responses keep theirs under the record's ``owner``.
* Lease methods (checked by :class:`llmkit.testing.storage.LeaseContract`) are atomic across every process
  and machine sharing the storage: of concurrent callers on one batch, at most one succeeds. Expiry is wall-clock time (``time.time()``), so
  machines sharing a store need clocks that agree to well within the lease's duration.
"""

from __future__ import annotations

import abc
import re
import secrets
from typing import Any, Iterable, Iterator, Mapping

# the records are defined in records.py and imported from here too, where they used to live
from llmkit.core.batches.records import (  # noqa: F401
    ACTIVE_STATUSES,
    TERMINAL_STATUSES,
    BatchRecord,
    BatchResult,
    FileRecord,
)

FILE_ID_RE = re.compile(r"file-[0-9a-f]{32}")
BATCH_ID_RE = re.compile(r"batch_[0-9a-f]{32}")
RECORD_KIND_RE = re.compile(r"[a-z][a-z_]{0,31}")
RECORD_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
BLOB_CHUNK = 1 << 20  # read and write blobs in 1 MiB chunks


class StorageError(Exception):
    """A storage operation failed."""


class NotFoundError(StorageError, KeyError):
    """No such object; also raised for a malformed id, so the two are indistinguishable."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "not found"


class FileTooLargeError(StorageError):
    """A blob write went over its ``max_bytes``; nothing was stored."""


def new_file_id() -> str:
    return "file-" + secrets.token_hex(16)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(16)


def check_file_id(file_id: object) -> str:
    """Return ``file_id`` if it matches ``file-[0-9a-f]{32}``, else raise :class:`NotFoundError`."""
    if not isinstance(file_id, str) or not FILE_ID_RE.fullmatch(file_id):
        raise NotFoundError("file not found")
    return file_id


def check_record_key(kind: object, key: object) -> tuple[str, str]:
    """Return ``(kind, key)`` if both are well formed (``[a-z][a-z_]*`` and ``[A-Za-z0-9_-]+``),
    else raise :class:`NotFoundError`."""
    if not isinstance(kind, str) or not RECORD_KIND_RE.fullmatch(kind):
        raise NotFoundError("record not found")
    if not isinstance(key, str) or not RECORD_KEY_RE.fullmatch(key):
        raise NotFoundError("record not found")
    return kind, key


def check_asset_key(key: object) -> str:
    """``key`` if it is ``/``-separated plain segments (no empty, ``.`` or ``..`` segment, no
    backslash or NUL), else :class:`NotFoundError`: no key can reach outside the assets."""
    if not isinstance(key, str) or not key or len(key) > 1024 or "\\" in key or "\0" in key:
        raise NotFoundError("asset not found")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise NotFoundError("asset not found")
    return key


def check_batch_id(batch_id: object) -> str:
    """Return ``batch_id`` if it matches ``batch_[0-9a-f]{32}``, else raise :class:`NotFoundError`."""
    if not isinstance(batch_id, str) or not BATCH_ID_RE.fullmatch(batch_id):
        raise NotFoundError("batch not found")
    return batch_id


class StorageBackend(abc.ABC):
    """Where files, batch records and batch results live. See the module docstring."""

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> "StorageBackend":
        """Build the backend from ``--storage-option KEY=VALUE`` strings (default: ``cls(**options)``)."""
        return cls(**options)

    # -- blobs ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def write_blob(self, file_id: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> int:
        """Store the concatenated ``chunks`` as the blob of ``file_id`` and return its size.

        Consume ``chunks`` lazily (bounded memory). Replace an existing blob atomically. If the
        total exceeds ``max_bytes`` raise :class:`FileTooLargeError`; if ``chunks`` raises, let it
        propagate. In both cases nothing is stored and no temporary data is left behind.
        """

    @abc.abstractmethod
    def read_blob(self, file_id: str) -> Iterator[bytes]:
        """Yield the blob of ``file_id`` in chunks; raise :class:`NotFoundError` (before yielding)
        if there is none. The iterator must see one consistent version of the blob."""

    @abc.abstractmethod
    def delete_blob(self, file_id: str) -> bool:
        """Delete the blob of ``file_id``; return whether it existed."""

    # -- file records --------------------------------------------------------------------------
    @abc.abstractmethod
    def put_file(self, record: FileRecord) -> None:
        """Insert or replace a file record (atomically)."""

    @abc.abstractmethod
    def get_file(self, file_id: str) -> FileRecord:
        """Return the file record; raise :class:`NotFoundError` if absent or malformed."""

    @abc.abstractmethod
    def list_files(self, *, purpose: str | None = None) -> list[FileRecord]:
        """All file records (with ``purpose`` if given), sorted by ``sort_key()`` descending."""

    @abc.abstractmethod
    def delete_file(self, file_id: str) -> bool:
        """Delete the file record (not the blob); return whether it existed."""

    # -- batch records -------------------------------------------------------------------------
    @abc.abstractmethod
    def put_batch(self, record: BatchRecord) -> None:
        """Insert or replace a batch record (atomically)."""

    @abc.abstractmethod
    def get_batch(self, batch_id: str) -> BatchRecord:
        """Return the batch record; raise :class:`NotFoundError` if absent or malformed."""

    @abc.abstractmethod
    def list_batches(self, *, statuses: Iterable[str] | None = None) -> list[BatchRecord]:
        """All batch records (with a status in ``statuses`` if given), sorted by ``sort_key()``
        descending (newest first)."""

    # -- batch results -------------------------------------------------------------------------
    @abc.abstractmethod
    def put_result(self, batch_id: str, result: BatchResult) -> bool:
        """Durably record a finished line. The first write for ``(batch_id, result.index)`` wins;
        return False (storing nothing) if that index already has a result."""

    @abc.abstractmethod
    def result_indices(self, batch_id: str) -> dict[int, str]:
        """Map every line index of ``batch_id`` that has a result to its kind."""

    @abc.abstractmethod
    def iter_results(self, batch_id: str, kind: str | None = None) -> Iterator[BatchResult]:
        """Yield the results of ``batch_id`` (only ``kind`` if given) in ascending index order."""

    @abc.abstractmethod
    def delete_results(self, batch_id: str) -> None:
        """Delete every result of ``batch_id`` (called once the output files are written)."""

    # -- records (optional) --------------------------------------------------------------------
    # Not abstract, so backends written before records existed keep working for files and batches.
    @property
    def stores_records(self) -> bool:
        """Whether this backend implements the record methods below."""
        return type(self).put_record is not StorageBackend.put_record

    def put_record(self, kind: str, key: str, data: dict[str, Any]) -> None:
        """Insert or replace the JSON object ``data`` under ``(kind, key)`` (atomically), after
        :func:`check_record_key`."""
        raise NotImplementedError(f"{type(self).__name__} does not store records")

    def get_record(self, kind: str, key: str) -> dict[str, Any]:
        """Return the record; raise :class:`NotFoundError` if absent or the key is malformed."""
        raise NotImplementedError(f"{type(self).__name__} does not store records")

    def delete_record(self, kind: str, key: str) -> bool:
        """Delete the record; return whether it existed."""
        raise NotImplementedError(f"{type(self).__name__} does not store records")

    # -- leases (optional) ---------------------------------------------------------------------
    # A lease names one holder (a runner's id) of one batch until an expiry. The runner takes one
    # before running a batch, renews it while running and gives it up when done.
    @property
    def stores_leases(self) -> bool:
        """Whether this backend implements the lease methods below."""
        return type(self).acquire_lease is not StorageBackend.acquire_lease

    def acquire_lease(self, batch_id: str, holder: str, ttl: float) -> bool:
        """Give ``holder`` the lease on ``batch_id`` until ``ttl`` seconds from now if there is
        none or it has expired (whoever held it); return False, changing nothing, if a lease is
        live (``holder``'s own included). Atomic: of concurrent callers at most one succeeds."""
        raise NotImplementedError(f"{type(self).__name__} does not store leases")

    def renew_lease(self, batch_id: str, holder: str, ttl: float) -> bool:
        """Extend ``holder``'s lease to ``ttl`` seconds from now; return False, changing nothing,
        if the lease is not ``holder``'s (another took it over, or there is none)."""
        raise NotImplementedError(f"{type(self).__name__} does not store leases")

    def release_lease(self, batch_id: str, holder: str) -> None:
        """Expire ``holder``'s lease at once (another's is left alone), so another replica may
        take the batch without waiting; the lease keeps naming ``holder``, so a late
        :meth:`renew_lease` by it fails."""
        raise NotImplementedError(f"{type(self).__name__} does not store leases")

    # -- assets (optional) ---------------------------------------------------------------------
    # Files a deployment places in the store for the server to read, by key (``loras/<name>/...``:
    # LoRA adapters for ``--lora-resolver storage``). The server never writes them.
    @property
    def stores_assets(self) -> bool:
        """Whether this backend implements :meth:`read_asset`."""
        return type(self).read_asset is not StorageBackend.read_asset

    def read_asset(self, key: str) -> Iterator[bytes]:
        """Yield the asset ``key`` (``/``-separated segments, after :func:`check_asset_key`) in
        chunks; raise :class:`NotFoundError` (before yielding) if there is none."""
        raise NotImplementedError(f"{type(self).__name__} does not store assets")

    def close(self) -> None:
        """Release connections and handles; the default does nothing."""


def capped(chunks: Iterable[bytes], max_bytes: int | None) -> Iterator[bytes]:
    """Pass ``chunks`` through, raising :class:`FileTooLargeError` once more than ``max_bytes``
    have gone by (a helper for backends)."""
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if max_bytes is not None and total > max_bytes:
            raise FileTooLargeError(f"file is larger than {max_bytes} bytes")
        yield chunk


def parse_storage_options(pairs: Iterable[str]) -> dict[str, str]:
    """``["bucket=b", "prefix=p/"]`` (repeated ``--storage-option``) -> ``{"bucket": "b", ...}``."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--storage-option takes KEY=VALUE, got {pair!r}")
        options[key.strip()] = value
    return options


def open_storage(
    name: str, options: Mapping[str, str] | None = None, *, file_storage_path: str | None = None
) -> StorageBackend:
    """Build the storage backend registered as ``name`` (``--batch-storage NAME``).

    ``file_storage_path`` (``--file-storage-path``) fills the option a backend names as its
    ``path_option`` at registration (``local``: ``path``) unless ``options`` set it.
    """
    from llmkit.core.plugins import registry

    opts = dict(options or {})
    path_option = registry().entry("storage", name).meta.get("path_option")
    if path_option and file_storage_path and path_option not in opts:
        opts[path_option] = file_storage_path
    cls = registry().storage_backend(name)
    return cls.from_options(opts)
