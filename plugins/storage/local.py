"""The ``local`` storage backend: blobs on disk under one root directory, records in SQLite.

Layout under ``path`` (``--file-storage-path``, default ``./llmkit_storage``)::

    blobs/<file id>      file contents (name = the validated id, never the client's filename)
    tmp/                 in-progress writes, renamed into blobs/ when complete
    llmkit.sqlite3       file and batch records, batch results, keyed records, batch leases (WAL mode)
    loras/<name>/...     assets a deployment puts there (read only: ``--lora-resolver storage``)

The root is created 0700 and files 0600. A blob write goes to ``tmp/``, is fsynced and renamed
(atomic on POSIX), so readers never see a partial blob and a crash leaves at most a temp file,
which the next start removes.

Leases are rows changed by one conditional statement each: SQLite serialises writers across every
process that opens the file (servers sharing one ``--file-storage-path``), so a conditional
``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` is a compare-and-swap, takeover of an expired
lease included. The file must be on a local disk: SQLite's locks are unreliable on network file
systems (use ``s3`` for replicas on several machines).
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

from llmkit.core.batches.storage import (
    BLOB_CHUNK,
    BatchRecord,
    BatchResult,
    FileRecord,
    NotFoundError,
    StorageBackend,
    capped,
    check_asset_key,
    check_batch_id,
    check_file_id,
    check_record_key,
)
from llmkit.core.hookspecs import hookimpl

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, created INTEGER, purpose TEXT, data TEXT);
CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, created INTEGER, status TEXT, data TEXT);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT, idx INTEGER, kind TEXT, line TEXT, PRIMARY KEY (batch_id, idx));
CREATE TABLE IF NOT EXISTS records (kind TEXT, key TEXT, data TEXT, PRIMARY KEY (kind, key));
CREATE TABLE IF NOT EXISTS leases (batch_id TEXT PRIMARY KEY, holder TEXT, expires REAL);
"""


WAL_WAIT_S = 10.0  # how long opening waits for another process's switch to WAL


class LocalStorage(StorageBackend):
    """Files on disk under ``path``; records and results in SQLite next to them."""

    def __init__(self, path: str = "./llmkit_storage") -> None:
        self.root = Path(path).resolve()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._blobs = self.root / "blobs"
        self._tmp = self.root / "tmp"
        for d in (self._blobs, self._tmp):
            d.mkdir(mode=0o700, exist_ok=True)
        for leftover in self._tmp.iterdir():  # writes interrupted by a crash
            leftover.unlink(missing_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.root / "llmkit.sqlite3", check_same_thread=False, isolation_level=None)
        os.chmod(self.root / "llmkit.sqlite3", 0o600)
        # WAL with synchronous=NORMAL survives a killed process (not necessarily a power cut).
        self._set_wal()
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def _set_wal(self) -> None:
        """Switching to WAL takes an exclusive lock, and SQLite answers "database is locked" at once
        (no busy wait) while another connection holds the file: two replicas started together on one
        directory collided there. Retry for a bounded time."""
        deadline = time.monotonic() + WAL_WAIT_S
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _blob_path(self, file_id: str) -> Path:
        path = self._blobs / check_file_id(file_id)
        # The id pattern already excludes separators; this is a second lock on the same door.
        if path.parent != self._blobs:
            raise NotFoundError("file not found")
        return path

    def _exec(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- blobs ---------------------------------------------------------------------------------
    def write_blob(self, file_id: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> int:
        dest = self._blob_path(file_id)
        fd, tmp_name = tempfile.mkstemp(dir=self._tmp, prefix="w-")
        total = 0
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in capped(chunks, max_bytes):
                    f.write(chunk)
                    total += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, dest)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        _fsync_dir(self._blobs)
        return total

    def read_blob(self, file_id: str) -> Iterator[bytes]:
        try:
            f = open(self._blob_path(file_id), "rb")  # noqa: SIM115 - closed by the generator
        except FileNotFoundError:
            raise NotFoundError("file not found") from None
        return _read_chunks(f)

    def delete_blob(self, file_id: str) -> bool:
        try:
            self._blob_path(file_id).unlink()
            return True
        except FileNotFoundError:
            return False

    # -- file records --------------------------------------------------------------------------
    def put_file(self, record: FileRecord) -> None:
        check_file_id(record.id)
        self._exec(
            "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?)",
            (record.id, record.sort_key()[0], record.purpose, json.dumps(record.to_dict())),
        )

    def get_file(self, file_id: str) -> FileRecord:
        rows = self._exec("SELECT data FROM files WHERE id = ?", (check_file_id(file_id),))
        if not rows:
            raise NotFoundError("file not found")
        return FileRecord.from_dict(json.loads(rows[0][0]))

    def list_files(self, *, purpose: str | None = None) -> list[FileRecord]:
        sql, args = "SELECT data FROM files", ()
        if purpose is not None:
            sql, args = sql + " WHERE purpose = ?", (purpose,)
        rows = self._exec(sql + " ORDER BY created DESC, id DESC", args)
        return [FileRecord.from_dict(json.loads(r[0])) for r in rows]

    def delete_file(self, file_id: str) -> bool:
        check_file_id(file_id)
        with self._lock:
            return self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0

    # -- batch records -------------------------------------------------------------------------
    def put_batch(self, record: BatchRecord) -> None:
        check_batch_id(record.id)
        self._exec(
            "INSERT OR REPLACE INTO batches VALUES (?, ?, ?, ?)",
            (record.id, record.sort_key()[0], record.status, json.dumps(record.to_dict())),
        )

    def get_batch(self, batch_id: str) -> BatchRecord:
        rows = self._exec("SELECT data FROM batches WHERE id = ?", (check_batch_id(batch_id),))
        if not rows:
            raise NotFoundError("batch not found")
        return BatchRecord.from_dict(json.loads(rows[0][0]))

    def list_batches(self, *, statuses: Iterable[str] | None = None) -> list[BatchRecord]:
        sql, args = "SELECT data FROM batches", ()
        if statuses is not None:
            wanted = tuple(statuses)
            sql += f" WHERE status IN ({', '.join('?' * len(wanted))})" if wanted else " WHERE 0"
            args = wanted
        rows = self._exec(sql + " ORDER BY created DESC, id DESC", args)
        return [BatchRecord.from_dict(json.loads(r[0])) for r in rows]

    # -- batch results -------------------------------------------------------------------------
    def put_result(self, batch_id: str, result: BatchResult) -> bool:
        check_batch_id(batch_id)
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                (batch_id, result.index, result.kind, result.line),
            )
            return cur.rowcount > 0

    def result_indices(self, batch_id: str) -> dict[int, str]:
        rows = self._exec("SELECT idx, kind FROM results WHERE batch_id = ?", (check_batch_id(batch_id),))
        return {idx: kind for idx, kind in rows}

    def iter_results(self, batch_id: str, kind: str | None = None) -> Iterator[BatchResult]:
        check_batch_id(batch_id)
        last = -1
        while True:  # pages keep memory bounded and never hold the lock across a yield
            sql = "SELECT idx, kind, line FROM results WHERE batch_id = ? AND idx > ?"
            args: tuple = (batch_id, last)
            if kind is not None:
                sql, args = sql + " AND kind = ?", args + (kind,)
            rows = self._exec(sql + " ORDER BY idx LIMIT 500", args)
            if not rows:
                return
            for idx, k, line in rows:
                yield BatchResult(idx, k, line)
            last = rows[-1][0]

    def delete_results(self, batch_id: str) -> None:
        self._exec("DELETE FROM results WHERE batch_id = ?", (check_batch_id(batch_id),))

    # -- records -------------------------------------------------------------------------------
    def put_record(self, kind: str, key: str, data: dict) -> None:
        self._exec("INSERT OR REPLACE INTO records VALUES (?, ?, ?)", (*check_record_key(kind, key), json.dumps(data)))

    def get_record(self, kind: str, key: str) -> dict:
        rows = self._exec("SELECT data FROM records WHERE kind = ? AND key = ?", check_record_key(kind, key))
        if not rows:
            raise NotFoundError("record not found")
        return json.loads(rows[0][0])

    def delete_record(self, kind: str, key: str) -> bool:
        args = check_record_key(kind, key)
        with self._lock:
            return self._db.execute("DELETE FROM records WHERE kind = ? AND key = ?", args).rowcount > 0

    # -- leases --------------------------------------------------------------------------------
    def _changed(self, sql: str, args: tuple) -> bool:
        with self._lock:
            return self._db.execute(sql, args).rowcount > 0

    def acquire_lease(self, batch_id: str, holder: str, ttl: float) -> bool:
        now = time.time()
        return self._changed(
            "INSERT INTO leases VALUES (?, ?, ?) ON CONFLICT (batch_id) DO UPDATE"
            " SET holder = excluded.holder, expires = excluded.expires WHERE leases.expires <= ?",
            (check_batch_id(batch_id), holder, now + ttl, now),
        )

    def renew_lease(self, batch_id: str, holder: str, ttl: float) -> bool:
        sql = "UPDATE leases SET expires = ? WHERE batch_id = ? AND holder = ?"
        return self._changed(sql, (time.time() + ttl, check_batch_id(batch_id), holder))

    def release_lease(self, batch_id: str, holder: str) -> None:
        self._changed(
            "UPDATE leases SET expires = 0 WHERE batch_id = ? AND holder = ?", (check_batch_id(batch_id), holder)
        )

    # -- assets: files placed under the storage directory (``<path>/loras/<name>/...``) -------------
    def read_asset(self, key: str) -> Iterator[bytes]:
        path = (self.root / check_asset_key(key)).resolve()
        if not path.is_relative_to(self.root) or not path.is_file():  # a link out of it included
            raise NotFoundError("asset not found")
        return _read_chunks(open(path, "rb"))  # noqa: SIM115 - closed by the generator

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _read_chunks(f) -> Iterator[bytes]:
    with f:
        while chunk := f.read(BLOB_CHUNK):
            yield chunk


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@hookimpl
def llmkit_register_storage_backends(register):
    # default: --batch-storage's default; path_option: the option --file-storage-path fills.
    register("local", "llmkit.plugins.storage.local:LocalStorage", default=True, path_option="path")
