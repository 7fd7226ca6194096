"""``/v1/batches``: create, list, retrieve and cancel batches (OpenAI semantics)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from llmkit.core.batches.files_routes import int_param, not_found, paginate, visible_file
from llmkit.core.batches.runner import COMPLETION_WINDOWS, BatchRunner
from llmkit.core.batches.storage import BatchRecord, NotFoundError
from llmkit.core.batches.validation import SUPPORTED_ENDPOINTS, default_body_validator
from llmkit.core.server.access.owners import principal
from llmkit.core.server.body import read_json
from llmkit.core.server.errors import APIError, error_response

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def _check_metadata(metadata: Any) -> str | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        return f"metadata must be an object with at most {MAX_METADATA_PAIRS} pairs."
    for k, v in metadata.items():
        if not isinstance(v, str) or len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE:
            return (
                f"metadata keys are strings of at most {MAX_METADATA_KEY} characters and "
                f"values strings of at most {MAX_METADATA_VALUE}."
            )
    return None


def protocol_body_validator(endpoint: str, body: dict) -> str | None:
    """Check a batch line's body with the server's request models (pass as ``body_validator``)."""
    from pydantic import ValidationError

    from llmkit.core.server.openai.embeddings import EmbeddingRequest
    from llmkit.core.server.openai.protocol import ChatCompletionRequest, CompletionRequest

    problem = default_body_validator(endpoint, body)  # the fields each endpoint cannot do without
    if problem:
        return problem
    cls = {"/v1/chat/completions": ChatCompletionRequest, "/v1/embeddings": EmbeddingRequest}.get(
        endpoint, CompletionRequest
    )
    try:
        cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        return f"body.{where}: {err.get('msg')}" if where else "body is not valid for the endpoint"
    except (RecursionError, ValueError):
        return "body is not valid for the endpoint"
    return None


def batches_router(runner: BatchRunner, *, endpoints: tuple[str, ...] = SUPPORTED_ENDPOINTS) -> APIRouter:
    """The ``/v1/batches`` endpoints; ``endpoints`` lists the batch endpoints the server serves."""
    router = APIRouter()
    storage = runner.storage

    @router.post("/v1/batches")
    async def create_batch(request: Request):
        try:
            body = await read_json(request)
        except APIError as exc:
            return exc.response()
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str):
            return error_response(status=400, message="input_file_id is required.", param="input_file_id")
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if endpoint not in endpoints:
            return error_response(
                status=400, message=f"endpoint must be one of {', '.join(endpoints)}.", param="endpoint"
            )
        if window not in COMPLETION_WINDOWS:
            return error_response(
                status=400,
                message=f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}.",
                param="completion_window",
            )
        if problem := _check_metadata(body.get("metadata")):
            return error_response(status=400, message=problem, param="metadata")
        caller = principal(request)
        try:  # another key's file is not found, as OpenAI's projects do not see each other's
            record = await visible_file(storage, input_file_id, caller)
        except NotFoundError:
            return not_found("File", param="input_file_id")
        if record.purpose != "batch":
            return error_response(
                status=400, message="The input file must have purpose 'batch'.", param="input_file_id"
            )
        batch = await runner.create(input_file_id, endpoint, window, body.get("metadata"), owner=caller.owner)
        return batch.to_openai()

    @router.get("/v1/batches")
    async def list_batches(request: Request):
        limit = int_param(request, "limit", 20, 1, 100)
        if isinstance(limit, JSONResponse):
            return limit
        caller = principal(request)
        records = [r for r in await runner.list() if caller.sees(r.owner)]
        return paginate(
            [r.to_openai() for r in records], [r.id for r in records], request.query_params.get("after"), limit
        )

    async def visible_batch(batch_id: str, request: Request) -> BatchRecord:
        record = await runner.get(batch_id)
        if not principal(request).sees(record.owner):
            raise NotFoundError("batch not found")
        return record

    @router.post("/v1/batches/{batch_id:path}/cancel")
    async def cancel_batch(batch_id: str, request: Request):
        try:
            await visible_batch(batch_id, request)
            return (await runner.cancel(batch_id)).to_openai()
        except NotFoundError:
            return not_found("Batch")

    @router.get("/v1/batches/{batch_id:path}")
    async def retrieve_batch(batch_id: str, request: Request):
        try:
            return (await visible_batch(batch_id, request)).to_openai()
        except NotFoundError:
            return not_found("Batch")

    return router
