"""Ollama's reply objects, made from a chat run's events: NDJSON lines while streaming, one object
folded from the same events otherwise (so both modes carry the same text), with Ollama's
``done_reason`` and timings (nanoseconds, as Ollama reports them)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone

from llmkit.core.server.openai.chat_events import ChatEvent, ChatResult, ToolCallResult


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def tool_call(call: ToolCallResult, index: int) -> dict:
    """A call in Ollama's shape: arguments as an object, not a JSON string."""
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError:
        args = {}
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": args}}


class Reply:
    """Builds one request's objects; ``chat``: /api/chat's ``message`` shape, else /api/generate's."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.start = time.perf_counter_ns()
        self.first: int | None = None  # when the first token arrived (the prompt's evaluation ended)

    def piece(
        self, content: str = "", thinking: str = "", calls: list[dict] | None = None, done=False, lps=None
    ) -> dict:
        obj: dict = {"model": self.model, "created_at": now_iso()}
        if self.chat:
            msg: dict = {"role": "assistant", "content": content}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            obj["message"] = msg
        else:
            obj["response"] = content
            if thinking:
                obj["thinking"] = thinking
        if lps:  # asked for (logprobs: true): the OpenAI route's entries, token and logprob first
            obj["logprobs"] = lps
        obj["done"] = done
        return obj

    def final(self, result: ChatResult, content: str = "", thinking: str = "", calls=None, lps=None) -> dict:
        end = time.perf_counter_ns()
        first = self.first or end
        obj = self.piece(content, thinking, calls, done=True, lps=lps)
        obj["done_reason"] = "length" if result.finish_reason == "length" else "stop"
        obj.update(
            total_duration=end - self.start,
            load_duration=0,  # the model is loaded before the server listens
            prompt_eval_count=result.prompt_tokens,
            prompt_eval_duration=first - self.start,
            eval_count=result.completion_tokens,
            eval_duration=max(end - first, 1),  # clients divide by it for tokens per second
        )
        return obj

    def _mark(self, event: ChatEvent) -> None:
        if self.first is None and (event.content or event.reasoning or event.tool_start):
            self.first = time.perf_counter_ns()

    async def lines(self, events: AsyncIterator[ChatEvent]) -> AsyncIterator[str]:
        """The NDJSON stream: a line per piece of text, tool calls whole (Ollama sends them once
        complete), then the final line with the timings. An error mid-stream is an error line."""
        calls: list[ToolCallResult] = []
        try:
            async for event in events:
                self._mark(event)
                if event.error is not None:
                    yield _line({"error": event.error.message})
                    return
                if event.tool_start is not None:
                    calls.append(event.tool_start)
                elif event.content or event.reasoning:
                    yield _line(self.piece(event.content, event.reasoning, lps=event.logprobs))
                elif event.finished is not None:
                    if calls:
                        yield _line(self.piece(calls=[tool_call(c, i) for i, c in enumerate(calls)]))
                    yield _line(self.final(event.finished))
        finally:
            await events.aclose()

    async def whole(self, events: AsyncIterator[ChatEvent]) -> dict:
        """The non-streaming reply, folded from the same events."""
        try:
            async for event in events:
                self._mark(event)
                if event.error is not None:
                    raise event.error
                if event.finished is not None:
                    r = event.finished
                    calls = [tool_call(c, i) for i, c in enumerate(r.tool_calls)]
                    return self.final(r, r.content, r.reasoning, calls, lps=r.logprobs)
        finally:
            await events.aclose()
        raise RuntimeError("the chat run ended without a result")


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"
