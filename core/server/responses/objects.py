"""Response objects and their streamed events, both built from a chat result.

Output items come in one order, streaming or not: reasoning, message, then one function_call per
call. The stream announces each item as its first text arrives and closes it when the next one
starts; the final ``response.completed`` carries the same items with the same ids.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from llmkit.core.server.generation.sampling_defaults import resolve
from llmkit.core.server.openai.chat_events import ChatEvent, ChatResult
from llmkit.core.server.responses.protocol import ResponsesRequest
from llmkit.core.server.state import new_id


def skeleton(body: ResponsesRequest, rid: str, status: str, sampling_defaults: dict | None = None) -> dict:
    """The response object before any output (``created_at`` is set here, once). ``temperature``
    and ``top_p`` are the ones the response samples with, as OpenAI and vLLM report them: the
    request's, else the server's defaults (``sampling_defaults``: the generation config's)."""
    sampling = resolve(body, sampling_defaults)
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "background": body.background,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": body.model,
        "output": [],
        "output_text": "",
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
        "store": body.store,
        "temperature": sampling["temperature"],
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_p": sampling["top_p"],
        "top_logprobs": body.top_logprobs or 0,
        "truncation": body.truncation,
        "usage": None,
        "user": body.user,
        "metadata": body.metadata or {},
    }


class ItemIds:
    """Item ids, chosen once so the stream and the final object agree."""

    def __init__(self) -> None:
        self.reasoning, self.message = new_id("rs_"), new_id("msg_")
        self.calls: list[str] = []

    def call(self, k: int) -> str:
        while len(self.calls) <= k:
            self.calls.append(new_id("fc_"))
        return self.calls[k]


def reasoning_item(rid: str, text: str, status: str = "completed") -> dict:
    return {
        "type": "reasoning",
        "id": rid,
        "summary": [],
        "status": status,
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
    }


def text_part(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(mid: str, text: str, status: str = "completed", logprobs: list | None = None) -> dict:
    content = [text_part(text, logprobs)] if status == "completed" else []
    return {"type": "message", "id": mid, "role": "assistant", "status": status, "content": content}


def call_item(fid: str, call, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": fid,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
        "status": status,
    }


def finish(resp: dict, result: ChatResult, ids: ItemIds) -> dict:
    """Fill ``resp`` with the result's output, status and usage."""
    output = []
    if result.reasoning:
        output.append(reasoning_item(ids.reasoning, result.reasoning))
    if result.content:
        output.append(message_item(ids.message, result.content, logprobs=result.logprobs))
    for k, c in enumerate(result.tool_calls):
        output.append(call_item(ids.call(k), c))
    incomplete = result.finish_reason == "length"
    resp.update(
        status="incomplete" if incomplete else "completed",
        output=output,
        output_text=result.content,
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
        usage={
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.cached_tokens},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens},
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        },
    )
    return resp


def failed(resp: dict, message: str) -> dict:
    resp.update(status="failed", error={"code": "server_error", "message": message})
    return resp


async def stream_events(events: AsyncIterator[ChatEvent], resp: dict, on_done=None):
    """The SSE events of a streamed response; ``on_done(resp)`` runs with the final object."""
    ids, seq = ItemIds(), 0
    index, kind, text, call_k = -1, None, "", -1
    current_call = None
    logprobs: list = []  # of every token so far (include=["message.output_text.logprobs"])

    def ev(etype: str, **data) -> str:
        nonlocal seq
        payload = {"type": etype, "sequence_number": seq, **data}
        seq += 1
        return f"event: {etype}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def close() -> str:
        nonlocal kind, text
        out, where = "", {"item_id": None, "output_index": index}
        if kind == "reasoning":
            where["item_id"] = ids.reasoning
            part = {"type": "reasoning_text", "text": text}
            out = (
                ev("response.reasoning_text.done", **where, content_index=0, text=text)
                + ev("response.content_part.done", **where, content_index=0, part=part)
                + ev("response.output_item.done", output_index=index, item=reasoning_item(ids.reasoning, text))
            )
        elif kind == "message":
            where["item_id"] = ids.message
            part = text_part(text, logprobs)
            out = (
                ev("response.output_text.done", **where, content_index=0, text=text, logprobs=logprobs)
                + ev("response.content_part.done", **where, content_index=0, part=part)
                + ev(
                    "response.output_item.done",
                    output_index=index,
                    item=message_item(ids.message, text, logprobs=logprobs),
                )
            )
        elif kind == "call":
            fid = ids.call(call_k)
            out = ev(
                "response.function_call_arguments.done",
                item_id=fid,
                output_index=index,
                name=current_call.name,
                arguments=current_call.arguments,
            ) + ev("response.output_item.done", output_index=index, item=call_item(fid, current_call))
        kind, text = None, ""
        return out

    def open_item(new_kind: str, item: dict, part: dict | None) -> str:
        nonlocal index, kind
        out = close()
        index, kind = index + 1, new_kind
        out += ev("response.output_item.added", output_index=index, item=item)
        if part is not None:
            out += ev("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part)
        return out

    yield ev("response.created", response=dict(resp))
    yield ev("response.in_progress", response=dict(resp))
    try:
        async for e in events:
            logprobs.extend(e.logprobs)
            if e.finished is not None:
                logprobs[:] = e.finished.logprobs  # with those no delta carried (the finish chunk's)
            if e.error is not None:
                yield close()
                failed(resp, e.error.message)
                if on_done is not None:
                    await on_done(resp)
                yield ev("response.failed", response=resp)
                return
            if e.reasoning:
                if kind != "reasoning":
                    yield open_item(
                        "reasoning",
                        reasoning_item(ids.reasoning, "", "in_progress"),
                        {"type": "reasoning_text", "text": ""},
                    )
                text += e.reasoning
                yield ev(
                    "response.reasoning_text.delta",
                    item_id=ids.reasoning,
                    output_index=index,
                    content_index=0,
                    delta=e.reasoning,
                )
            elif e.content:
                if kind != "message":
                    yield open_item(
                        "message",
                        message_item(ids.message, "", "in_progress"),
                        text_part(""),
                    )
                text += e.content
                yield ev(
                    "response.output_text.delta",
                    item_id=ids.message,
                    output_index=index,
                    content_index=0,
                    delta=e.content,
                    logprobs=e.logprobs,
                )
            elif e.tool_start is not None:
                call_k += 1
                current_call = e.tool_start
                yield open_item("call", call_item(ids.call(call_k), e.tool_start, "in_progress"), None)
            elif e.tool_args:
                yield ev(
                    "response.function_call_arguments.delta",
                    item_id=ids.call(call_k),
                    output_index=index,
                    delta=e.tool_args,
                )
            elif e.finished is not None:
                yield close()
                finish(resp, e.finished, ids)
                if on_done is not None:
                    await on_done(resp)
                etype = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
                yield ev(etype, response=resp)
    finally:
        await events.aclose()
