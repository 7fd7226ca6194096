"""``/v1/files``: upload, list, retrieve, download and delete files (OpenAI semantics).

Client filenames are metadata only: blobs are stored under the generated id, and the name is
reduced to a clean basename. Unknown and malformed ids get the same 404 body, and so do the ids of
files another API key made (``core/server/access/owners.py``).
"""

from __future__ import annotations

import io
import time
import unicodedata
from typing import Any

from fastapi import APIRouter, Request, UploadFile
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from llmkit.core.batches.storage import (
    BLOB_CHUNK,
    FileRecord,
    FileTooLargeError,
    NotFoundError,
    StorageBackend,
    check_file_id,
    new_file_id,
)
from llmkit.core.batches.validation import MAX_FILE_BYTES
from llmkit.core.server.access.owners import Principal, principal
from llmkit.core.server.errors import error_response
from llmkit.core.server.limits import PayloadTooLarge

UPLOAD_PURPOSES = ("batch",)  # batch_output files are made by the server, never uploaded
MULTIPART_SLACK = 64 * 1024  # headers and boundaries around the file part
MAX_FILENAME_BYTES = 255


def not_found(what: str = "File", param: str | None = None) -> JSONResponse:
    # Deliberately never echoes the id: the body is identical for malformed and unknown ids.
    return error_response(status=404, message=f"No such {what} object.", param=param, code="not_found")


def sanitize_filename(name: Any) -> str:
    """A safe display name: basename only, no control characters, at most 255 UTF-8 bytes."""
    text = name if isinstance(name, str) else ""
    text = text.replace("\\", "/").rsplit("/", 1)[-1]
    text = "".join(ch for ch in text if unicodedata.category(ch)[0] != "C").strip()
    if text in ("", ".", ".."):
        text = "upload.jsonl"
    raw = text.encode("utf-8")
    if len(raw) > MAX_FILENAME_BYTES:
        text = raw[:MAX_FILENAME_BYTES].decode("utf-8", errors="ignore")
    return text


def int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int | JSONResponse:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        return error_response(status=400, message=f"{name} must be an integer from {lo} to {hi}.", param=name)
    return value


def paginate(items: list, ids: list[str], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor list: the ``limit`` items after the one with id ``after``."""
    start = ids.index(after) + 1 if after in ids else (len(ids) if after else 0)
    page = items[start : start + limit]
    page_ids = ids[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page_ids[0] if page_ids else None,
        "last_id": page_ids[-1] if page_ids else None,
        "has_more": start + limit < len(items),
    }


async def visible_file(storage: StorageBackend, file_id: str, caller: Principal) -> FileRecord:
    """The file record, or :class:`NotFoundError` when it is missing or not the caller's to see."""
    record = await run_in_threadpool(storage.get_file, check_file_id(file_id))
    if not caller.sees(record.owner):
        raise NotFoundError("file not found")
    return record


def files_router(storage: StorageBackend, *, max_upload_bytes: int = MAX_FILE_BYTES) -> APIRouter:
    """The ``/v1/files`` endpoints over ``storage``."""
    router = APIRouter()

    @router.post("/v1/files")
    async def upload_file(request: Request):
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > max_upload_bytes + MULTIPART_SLACK:
            return error_response(
                status=413,
                message=f"File is larger than {max_upload_bytes} bytes.",
                param="file",
                code="file_too_large",
            )
        try:
            form = await request.form(max_files=1, max_fields=8)
        except PayloadTooLarge:  # the server's body cap, hit while the form was read
            raise
        except Exception:  # starlette raises several types for malformed multipart bodies
            return error_response(status=400, message="Expected a multipart/form-data body with a 'file' part.")
        upload = form.get("file")
        purpose = form.get("purpose", "batch")
        if upload is None:
            return error_response(status=400, message="Missing the 'file' part.", param="file")
        if isinstance(upload, str):  # a part without a filename arrives as a plain field
            upload = UploadFile(io.BytesIO(upload.encode()), filename="")
        if purpose not in UPLOAD_PURPOSES:
            return error_response(
                status=400, message=f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}.", param="purpose"
            )
        file_id = new_file_id()

        def chunks():
            while chunk := upload.file.read(BLOB_CHUNK):
                yield chunk

        try:
            size = await run_in_threadpool(storage.write_blob, file_id, chunks(), max_bytes=max_upload_bytes)
        except FileTooLargeError:
            return error_response(
                status=413,
                message=f"File is larger than {max_upload_bytes} bytes.",
                param="file",
                code="file_too_large",
            )
        finally:
            await upload.close()
        if size == 0:
            await run_in_threadpool(storage.delete_blob, file_id)
            return error_response(status=400, message="The file is empty.", param="file", code="empty_file")
        record = FileRecord(
            id=file_id,
            bytes=size,
            created_at=int(time.time()),
            filename=sanitize_filename(upload.filename),
            purpose=purpose,
            created_ns=time.time_ns(),
            owner=principal(request).owner,
        )
        await run_in_threadpool(storage.put_file, record)
        return record.to_openai()

    @router.get("/v1/files")
    async def list_files(request: Request):
        limit = int_param(request, "limit", 10000, 1, 10000)
        if isinstance(limit, JSONResponse):
            return limit
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            return error_response(status=400, message="order must be 'asc' or 'desc'.", param="order")
        records = await run_in_threadpool(storage.list_files, purpose=request.query_params.get("purpose"))
        caller = principal(request)
        records = [r for r in records if caller.sees(r.owner)]
        if order == "asc":
            records.reverse()
        return paginate(
            [r.to_openai() for r in records], [r.id for r in records], request.query_params.get("after"), limit
        )

    # ``:path`` so that ids with encoded slashes still reach the handler and get the OpenAI 404.
    @router.get("/v1/files/{file_id:path}/content")
    async def file_content(file_id: str, request: Request):
        try:
            await visible_file(storage, file_id, principal(request))
            body = await run_in_threadpool(storage.read_blob, file_id)
        except NotFoundError:
            return not_found()
        return StreamingResponse(body, media_type="application/octet-stream")

    @router.get("/v1/files/{file_id:path}")
    async def retrieve_file(file_id: str, request: Request):
        try:
            record = await visible_file(storage, file_id, principal(request))
        except NotFoundError:
            return not_found()
        return record.to_openai()

    @router.delete("/v1/files/{file_id:path}")
    async def delete_file(file_id: str, request: Request):
        try:
            await visible_file(storage, file_id, principal(request))
            existed = await run_in_threadpool(storage.delete_file, file_id)
        except NotFoundError:
            existed = False
        if not existed:
            return not_found()
        # A running batch reads its own pinned copy, so deleting the input here is safe.
        await run_in_threadpool(storage.delete_blob, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    return router
