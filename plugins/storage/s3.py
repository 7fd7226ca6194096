"""The ``s3`` storage backend: everything as objects in one bucket under a prefix.

Options (``--storage-option KEY=VALUE``): ``bucket`` (required), ``prefix`` (default
``llmkit/``), ``endpoint_url`` (MinIO, moto, R2, ...), ``region``. Credentials come from boto3's
usual chain (environment, profile, instance role). Needs ``pip install 'llmkit[s3]'``.

Keys under the prefix::

    blobs/<file id>                      file contents
    files/<file id>.json                 file records
    batches/<batch id>.json              batch records
    results/<batch id>/<index:08d>.<kind>  one finished line each (kind: output | error)
    records/<kind>/<key>.json            keyed records (stored responses)
    leases/<batch id>.json               which replica runs a batch, until when
    loras/<name>/...                     assets a deployment uploads (read only: --lora-resolver storage)

A PUT is atomic in S3, so records and blobs are never torn. Blob uploads are spooled to a local
temporary file first (bounded memory), so an oversize upload is refused before anything reaches
the bucket. Listing reads every record, which suits the modest numbers of files and batches a
serving node keeps.

Leases use S3's conditional writes: a new lease is a PUT with ``If-None-Match: *`` and a renewal
or takeover a PUT with ``If-Match: <the ETag read>``, so of two replicas racing for a lease the
store lets one write win and refuses the other (412). Every lease write carries a fresh nonce, so
its ETag (an MD5 of the body) never repeats. The endpoint must implement conditional writes (AWS
S3 does since 2024, as do MinIO and moto); one that ignores the headers would let two replicas
run one batch. Result writes are conditional too (``If-None-Match: *``), and readers take one
result per line, so a line reaches the output once even from two writers.
"""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from typing import Any, Iterable, Iterator

from llmkit.core.batches.storage import (
    BLOB_CHUNK,
    BatchRecord,
    BatchResult,
    FileRecord,
    NotFoundError,
    StorageBackend,
    StorageError,
    capped,
    check_asset_key,
    check_batch_id,
    check_file_id,
    check_record_key,
)
from llmkit.core.hookspecs import hookimpl

_SPOOL_IN_MEMORY = 8 << 20
_LOST_RACE = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")  # another write won


class S3Storage(StorageBackend):
    """Blobs, records and results as S3 objects (see the module docstring)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "llmkit/",
        endpoint_url: str | None = None,
        region: str | None = None,
    ) -> None:
        try:
            import boto3
            from botocore.exceptions import ClientError
        except ImportError as exc:
            raise StorageError("the s3 storage backend needs boto3: pip install 'llmkit[s3]'") from exc
        if not bucket:
            raise StorageError("the s3 storage backend needs --storage-option bucket=NAME")
        self.bucket = bucket
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self._client_error = ClientError
        self._s3 = boto3.client("s3", endpoint_url=endpoint_url or None, region_name=region or None)

    # -- helpers -------------------------------------------------------------------------------
    def _key(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    def _code(self, exc: Exception) -> str:
        return getattr(exc, "response", {}).get("Error", {}).get("Code", "")

    def _missing(self, exc: Exception) -> bool:
        return self._code(exc) in ("NoSuchKey", "404", "NotFound")

    def _get_json(self, key: str, what: str) -> dict[str, Any]:
        try:
            body = self._s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self._client_error as exc:
            if self._missing(exc):
                raise NotFoundError(f"{what} not found") from None
            raise
        return json.loads(body)

    def _put_json(self, key: str, data: dict[str, Any]) -> None:
        body = json.dumps(data).encode()
        self._s3.put_object(Bucket=self.bucket, Key=key, Body=body, ContentType="application/json")

    def _keys(self, prefix: str) -> Iterator[str]:
        """Every key under ``prefix``, in lexicographic order (S3's listing order)."""
        pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                yield obj["Key"]

    def _delete(self, key: str) -> bool:
        try:
            self._s3.head_object(Bucket=self.bucket, Key=key)
        except self._client_error as exc:
            if self._missing(exc):
                return False
            raise
        self._s3.delete_object(Bucket=self.bucket, Key=key)
        return True

    # -- blobs ---------------------------------------------------------------------------------
    def write_blob(self, file_id: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> int:
        key = self._key("blobs", check_file_id(file_id))
        with tempfile.SpooledTemporaryFile(max_size=_SPOOL_IN_MEMORY) as spool:
            total = 0
            for chunk in capped(chunks, max_bytes):
                spool.write(chunk)
                total += len(chunk)
            spool.seek(0)
            self._s3.upload_fileobj(spool, self.bucket, key)  # multipart above 8 MB, atomic
        return total

    def read_blob(self, file_id: str) -> Iterator[bytes]:
        key = self._key("blobs", check_file_id(file_id))
        try:
            body = self._s3.get_object(Bucket=self.bucket, Key=key)["Body"]
        except self._client_error as exc:
            if self._missing(exc):
                raise NotFoundError("file not found") from None
            raise
        return _stream(body)

    def delete_blob(self, file_id: str) -> bool:
        return self._delete(self._key("blobs", check_file_id(file_id)))

    # -- file records --------------------------------------------------------------------------
    def put_file(self, record: FileRecord) -> None:
        self._put_json(self._key("files", check_file_id(record.id) + ".json"), record.to_dict())

    def get_file(self, file_id: str) -> FileRecord:
        key = self._key("files", check_file_id(file_id) + ".json")
        return FileRecord.from_dict(self._get_json(key, "file"))

    def list_files(self, *, purpose: str | None = None) -> list[FileRecord]:
        records = []
        for key in self._keys(self._key("files", "")):
            try:
                rec = FileRecord.from_dict(self._get_json(key, "file"))
            except NotFoundError:
                continue  # deleted since the listing
            if purpose is None or rec.purpose == purpose:
                records.append(rec)
        return sorted(records, key=lambda r: r.sort_key(), reverse=True)

    def delete_file(self, file_id: str) -> bool:
        return self._delete(self._key("files", check_file_id(file_id) + ".json"))

    # -- batch records -------------------------------------------------------------------------
    def put_batch(self, record: BatchRecord) -> None:
        self._put_json(self._key("batches", check_batch_id(record.id) + ".json"), record.to_dict())

    def get_batch(self, batch_id: str) -> BatchRecord:
        key = self._key("batches", check_batch_id(batch_id) + ".json")
        return BatchRecord.from_dict(self._get_json(key, "batch"))

    def list_batches(self, *, statuses: Iterable[str] | None = None) -> list[BatchRecord]:
        wanted = set(statuses) if statuses is not None else None
        records = []
        for key in self._keys(self._key("batches", "")):
            try:
                rec = BatchRecord.from_dict(self._get_json(key, "batch"))
            except NotFoundError:
                continue
            if wanted is None or rec.status in wanted:
                records.append(rec)
        return sorted(records, key=lambda r: r.sort_key(), reverse=True)

    # -- batch results -------------------------------------------------------------------------
    def _result_prefix(self, batch_id: str) -> str:
        return self._key("results", check_batch_id(batch_id), "")

    def put_result(self, batch_id: str, result: BatchResult) -> bool:
        base = self._result_prefix(batch_id) + f"{result.index:08d}"
        for kind in ("output", "error"):  # a line has one kind; the put below is the atomic check
            try:
                self._s3.head_object(Bucket=self.bucket, Key=f"{base}.{kind}")
                return False
            except self._client_error as exc:
                if not self._missing(exc):
                    raise
        try:  # conditional: a replica that lost its lease mid-line cannot store the line twice
            self._s3.put_object(
                Bucket=self.bucket, Key=f"{base}.{result.kind}", Body=result.line.encode(), IfNoneMatch="*"
            )
        except self._client_error as exc:
            if self._code(exc) in _LOST_RACE:
                return False
            raise
        return True

    def result_indices(self, batch_id: str) -> dict[int, str]:
        prefix = self._result_prefix(batch_id)
        out: dict[int, str] = {}
        for key in self._keys(prefix):
            idx, _, kind = key[len(prefix) :].partition(".")
            out.setdefault(int(idx), kind)
        return out

    def iter_results(self, batch_id: str, kind: str | None = None) -> Iterator[BatchResult]:
        prefix = self._result_prefix(batch_id)
        seen: set[int] = set()
        for key in self._keys(prefix):  # zero-padded names list in index order
            idx_s, _, k = key[len(prefix) :].partition(".")
            idx = int(idx_s)
            if idx in seen or (kind is not None and k != kind):
                continue
            seen.add(idx)
            body = self._s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            yield BatchResult(idx, k, body.decode())

    def delete_results(self, batch_id: str) -> None:
        keys = list(self._keys(self._result_prefix(batch_id)))
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            objs = [{"Key": k} for k in keys[i : i + 1000]]
            self._s3.delete_objects(Bucket=self.bucket, Delete={"Objects": objs, "Quiet": True})

    # -- records -------------------------------------------------------------------------------
    def _record_key(self, kind: str, key: str) -> str:
        kind, key = check_record_key(kind, key)
        return self._key("records", kind, key + ".json")

    def put_record(self, kind: str, key: str, data: dict[str, Any]) -> None:
        self._put_json(self._record_key(kind, key), data)

    def get_record(self, kind: str, key: str) -> dict[str, Any]:
        return self._get_json(self._record_key(kind, key), "record")

    def delete_record(self, kind: str, key: str) -> bool:
        return self._delete(self._record_key(kind, key))

    # -- leases --------------------------------------------------------------------------------
    def _read_lease(self, batch_id: str) -> tuple[str, dict[str, Any] | None, str | None]:
        """The lease's key, body (None: no lease) and ETag."""
        key = self._key("leases", check_batch_id(batch_id) + ".json")
        try:
            obj = self._s3.get_object(Bucket=self.bucket, Key=key)
        except self._client_error as exc:
            if self._missing(exc):
                return key, None, None
            raise
        return key, json.loads(obj["Body"].read()), obj["ETag"]

    def _write_lease(self, key: str, holder: str, expires_at: float, **condition: str) -> bool:
        body = json.dumps({"holder": holder, "expires_at": expires_at, "nonce": secrets.token_hex(8)})
        try:
            self._s3.put_object(Bucket=self.bucket, Key=key, Body=body.encode(), **condition)
        except self._client_error as exc:
            if self._code(exc) in _LOST_RACE or self._missing(exc):
                return False
            raise
        return True

    def acquire_lease(self, batch_id: str, holder: str, ttl: float) -> bool:
        key, lease, etag = self._read_lease(batch_id)
        if lease is None:
            return self._write_lease(key, holder, time.time() + ttl, IfNoneMatch="*")
        if lease["expires_at"] > time.time():
            return False
        return self._write_lease(key, holder, time.time() + ttl, IfMatch=etag)  # type: ignore[arg-type]

    def renew_lease(self, batch_id: str, holder: str, ttl: float) -> bool:
        key, lease, etag = self._read_lease(batch_id)
        if lease is None or lease["holder"] != holder:
            return False
        return self._write_lease(key, holder, time.time() + ttl, IfMatch=etag)  # type: ignore[arg-type]

    def release_lease(self, batch_id: str, holder: str) -> None:
        key, lease, etag = self._read_lease(batch_id)
        if lease is not None and lease["holder"] == holder:
            self._write_lease(key, holder, 0.0, IfMatch=etag)  # type: ignore[arg-type]

    # -- assets: objects placed under the prefix (``<prefix>loras/<name>/...``) --------------------
    def read_asset(self, key: str) -> Iterator[bytes]:
        try:
            body = self._s3.get_object(Bucket=self.bucket, Key=self.prefix + check_asset_key(key))["Body"]
        except self._client_error as exc:
            if self._missing(exc):
                raise NotFoundError("asset not found") from None
            raise
        return _stream(body)

    def close(self) -> None:
        self._s3.close()


def _stream(body) -> Iterator[bytes]:
    try:
        yield from body.iter_chunks(BLOB_CHUNK)
    finally:
        body.close()


@hookimpl
def llmkit_register_storage_backends(register):
    register("s3", "llmkit.plugins.storage.s3:S3Storage")
