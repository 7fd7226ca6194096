"""``/v1/responses``: create (plain, streamed or in the background), retrieve, list input items,
delete and cancel. Errors are OpenAI-shaped (the app's APIError handler)."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmkit.core.server.access.owners import Principal, principal
from llmkit.core.server.errors import APIError
from llmkit.core.server.openai.chat_events import chat_request, complete_chat, start_chat_stream
from llmkit.core.server.responses.objects import ItemIds, failed, finish, skeleton, stream_events
from llmkit.core.server.responses.protocol import (
    ResponsesRequest,
    check_call_outputs,
    items_to_messages,
    normalize_input,
    to_chat_body,
)
from llmkit.core.server.responses.store import ResponseStore
from llmkit.core.server.state import new_id

log = logging.getLogger("llmkit")
LIVE = ("queued", "in_progress")
# A background response's record names the server running it and is re-stored every BEAT_S
# while it runs: replicas sharing the storage tell a response running elsewhere (fresh beat) from
# one whose server died (no beat for STALE_S), which will never finish.
BEAT_S, STALE_S = 2.0, 20.0
# chat field names in errors -> the Responses field the client sent
PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "chat_template_kwargs": "reasoning",
}


async def _with_truncation(body: ResponsesRequest, msgs: list[dict], run):
    """Run ``run(chat)``; with ``truncation: auto`` drop the oldest turns while the conversation
    does not fit the context."""
    msgs = list(msgs)
    while True:
        try:
            return await run(chat_request(to_chat_body(body, msgs)))
        except APIError as exc:
            turns = [i for i, m in enumerate(msgs) if m["role"] != "system"]
            if body.truncation != "auto" or exc.code != "context_length_exceeded" or len(turns) <= 1:
                exc.param = PARAMS.get(exc.param, exc.param)
                raise
            del msgs[turns[0]]


def responses_router(state, storage=None) -> APIRouter:
    router = APIRouter()
    store = ResponseStore(storage)
    tasks: dict[str, asyncio.Task] = {}  # background responses running in this process
    runner = new_id("run_")  # this server, in the records of the background responses it runs

    async def run_background(events, record: dict) -> None:
        """Consume an already started (so already validated) generation into the record."""
        resp = record["response"]
        beat = None
        try:
            resp["status"] = "in_progress"
            record.update(runner=runner, beat_at=time.time())
            await store.put(record)
            beat = asyncio.create_task(heartbeat(record))
            async for e in events:
                if e.error is not None:
                    failed(resp, e.error.message)
                elif e.finished is not None:
                    finish(resp, e.finished, ItemIds())
        except asyncio.CancelledError:
            resp["status"] = "cancelled"
        except Exception as exc:  # recorded on the response, which the client polls
            log.exception("background response %s failed", resp["id"])
            failed(resp, f"internal error: {type(exc).__name__}")
        finally:
            try:
                if beat is not None:  # stopped first: its write must not land after the last one
                    beat.cancel()
                    await asyncio.gather(beat, return_exceptions=True)
                await events.aclose()  # aborts the generation if it is still running
                await store.put(record)
            finally:
                # only once the final state is stored: a poll in between would find the stored
                # "in_progress" with no task behind it and call the response lost to a restart
                tasks.pop(resp["id"], None)

    async def heartbeat(record: dict) -> None:
        while True:
            await asyncio.sleep(BEAT_S)
            record["beat_at"] = time.time()
            await store.put(record)

    def running_elsewhere(record: dict) -> bool:
        """Whether another live process (a replica sharing the storage) runs this response."""
        other, beat = record.get("runner"), record.get("beat_at")
        return other not in (None, runner) and beat is not None and time.time() - beat < STALE_S

    def elsewhere() -> APIError:
        return APIError(
            "This response is running on another replica; cancel or delete it through that one, "
            "or once it has finished.",
            status=409,
            param="response_id",
        )

    async def previous(pid: str, caller: Principal) -> dict:
        """The stored response a request continues from; refused as OpenAI does when the id is
        malformed or the response has not finished (its output is not known yet)."""
        if not pid.startswith("resp"):
            raise APIError(
                f"Invalid 'previous_response_id': '{pid}'. Expected an ID that begins with 'resp'.",
                param="previous_response_id",
                code="invalid_value",
            )
        prev = await store.get(pid, caller, param="previous_response_id")
        status = prev["response"]["status"]
        if status in LIVE and (pid in tasks or running_elsewhere(prev)):
            raise APIError(
                f"Previous response with id '{pid}' is still {status}; continue from it once it has finished.",
                param="previous_response_id",
            )
        return prev

    @router.post("/v1/responses")
    async def create(raw: HTTPRequest):
        from llmkit.core.server.body import parse_model, read_json

        body = parse_model(ResponsesRequest, await read_json(raw))
        from llmkit.core.server.model_names import resolve_adapter

        await resolve_adapter(state, body, raw)  # 404 before anything is stored (the chat request generates with it)
        if body.store or body.background:
            store.check_can_store()
        items = normalize_input(body)
        caller = principal(raw)
        context: list[dict] = []
        if body.previous_response_id is not None:
            prev = await previous(body.previous_response_id, caller)
            context = prev["context"] + prev["input_items"] + prev["response"]["output"]
        check_call_outputs(context + items)
        msgs = items_to_messages(context + items)
        if body.instructions:  # instructions are not carried over to continuations, as OpenAI
            msgs.insert(0, {"role": "system", "content": body.instructions})
        to_chat_body(body, msgs)  # request-level checks before anything starts
        resp = skeleton(body, new_id("resp_"), "in_progress", state.sampling_defaults)
        record = {"response": resp, "input_items": items, "context": context, "owner": caller.owner}

        if body.stream or body.background:
            # starting validates the request, so a bad background request is a 400 too
            events = await _with_truncation(body, msgs, lambda chat: start_chat_stream(state, chat))
        if body.background:
            resp["status"] = "queued"
            await store.put(record)
            tasks[resp["id"]] = asyncio.create_task(run_background(events, record))
            return JSONResponse(resp)
        if body.stream:

            async def save(final: dict) -> None:
                if body.store:
                    await store.put(record)

            return StreamingResponse(stream_events(events, resp, save), media_type="text/event-stream")
        result = await _with_truncation(body, msgs, lambda chat: complete_chat(state, chat, raw))
        if isinstance(result, Response):
            return result  # the client went away
        finish(resp, result, ItemIds())
        if body.store:
            await store.put(record)
        return JSONResponse(resp)

    async def load(rid: str, caller: Principal) -> dict:
        record = await store.get(rid, caller)
        resp = record["response"]
        if resp["status"] in LIVE and rid not in tasks and not running_elsewhere(record):
            # queued or running in a process that is gone: it will never finish
            failed(resp, "the server restarted before this response finished")
            await store.put(record)
        return record

    @router.get("/v1/responses/{rid}")
    async def retrieve(rid: str, raw: HTTPRequest):
        return (await load(rid, principal(raw)))["response"]

    @router.get("/v1/responses/{rid}/input_items")
    async def input_items(raw: HTTPRequest, rid: str, order: str = "desc", limit: int = 20, after: str | None = None):
        if order not in ("asc", "desc"):
            raise APIError("order must be asc or desc", param="order")
        if not 1 <= limit <= 100:
            raise APIError("limit must be between 1 and 100", param="limit")
        items = list((await load(rid, principal(raw)))["input_items"])
        if order == "desc":
            items.reverse()
        if after is not None:
            pos = next((i for i, it in enumerate(items) if it.get("id") == after), None)
            if pos is None:
                raise APIError(f"no input item with id '{after}'", param="after")
            items = items[pos + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    @router.delete("/v1/responses/{rid}")
    async def delete(rid: str, raw: HTTPRequest):
        record = await store.get(rid, principal(raw))  # another key's response is not found, and not stopped
        task = tasks.get(rid)
        if task is None and record["response"]["status"] in LIVE and running_elsewhere(record):
            # its runner's next beat would store it again: deleted it would not stay
            raise elsewhere()
        if task is not None:  # stop it first, or its last write would bring the record back
            task.cancel()
            await asyncio.wait([task])
        if not await store.delete(rid):
            raise APIError(f"Response with id '{rid}' not found.", status=404, code="not_found")
        return {"id": rid, "object": "response", "deleted": True}

    @router.post("/v1/responses/{rid}/cancel")
    async def cancel(rid: str, raw: HTTPRequest):
        caller = principal(raw)
        record = await load(rid, caller)
        if not record["response"]["background"]:
            raise APIError("Only responses created with background: true can be cancelled.", param="response_id")
        task = tasks.get(rid)
        if task is None and record["response"]["status"] in LIVE and running_elsewhere(record):
            raise elsewhere()
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # it records "cancelled" itself
            record = await store.get(rid, caller)
        return record["response"]

    return router
