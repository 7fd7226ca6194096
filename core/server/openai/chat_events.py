"""Run a chat completion on behalf of another API (Anthropic Messages, OpenAI Responses).

Those APIs are translated into a :class:`ChatCompletionRequest` and served by a chat run
(template, sampling checks, grammar, reasoning and tool parsers), so every API gets the same
validation and the same text. Both modes fold into a :class:`ChatResult`: non-streaming from the
run's completion object, streaming from its chunk objects one by one, which is what makes the two
modes equal. The objects are read as the run makes them; nothing is encoded and parsed back.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.responses import Response

from llmkit.core.server.errors import APIError
from llmkit.core.server.openai.chat_run import start_chat
from llmkit.core.server.openai.protocol import ChatCompletionRequest, StreamOptions
from llmkit.core.server.streaming import watch_disconnect


@dataclass
class ToolCallResult:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ChatResult:
    """One choice's final text, split as the parsers split it, plus its finish and usage."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallResult] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    usage: dict = field(default_factory=dict)
    logprobs: list = field(default_factory=list)  # every token's, as chat's logprobs.content (if asked)

    @property
    def prompt_tokens(self) -> int:
        return self.usage.get("prompt_tokens", 0)

    @property
    def completion_tokens(self) -> int:
        return self.usage.get("completion_tokens", 0)

    @property
    def cached_tokens(self) -> int:
        return (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    @property
    def reasoning_tokens(self) -> int:
        return self.usage.get("reasoning_tokens", 0)


def chat_request(body: dict) -> ChatCompletionRequest:
    """Validate a translated body (its fields come from our own translation, so a failure names
    the field the client sent wrong)."""
    from llmkit.core.server.body import parse_model

    return parse_model(ChatCompletionRequest, body)


async def complete_chat(state, body: ChatCompletionRequest, raw) -> ChatResult | Response:
    """Non-streaming: the result, or the bare response when the client went away (499)."""
    run = await start_chat(state, body.model_copy(update={"stream": False, "n": 1}), raw)
    data = await watch_disconnect(raw, run.complete())
    if isinstance(data, Response):
        return data
    choice = data["choices"][0]
    msg = choice["message"]
    calls = [
        ToolCallResult(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []
    ]
    return ChatResult(
        reasoning=msg.get("reasoning_content") or "",
        content=msg.get("content") or "",
        tool_calls=calls,
        finish_reason=choice["finish_reason"],
        matched_stop=choice.get("matched_stop"),
        usage=data.get("usage") or {},
        logprobs=(choice.get("logprobs") or {}).get("content") or [],
    )


@dataclass
class ChatEvent:
    """One streamed piece: exactly one of the fields is set (``finished`` last, with the result)."""

    reasoning: str = ""
    content: str = ""
    tool_start: ToolCallResult | None = None  # a new call: id and name, arguments to follow
    tool_args: str = ""  # arguments fragment of the newest call
    error: APIError | None = None
    finished: ChatResult | None = None
    prompt_tokens: int | None = None  # first, once the request is accepted: the prompt's size
    logprobs: list = field(default_factory=list)  # the tokens of this piece (with reasoning or content)


async def start_chat_stream(state, body: ChatCompletionRequest) -> AsyncIterator[ChatEvent]:
    """Start a streaming chat completion (validation errors raise here, before any response is
    sent) and return its events. Closing the iterator aborts the generation."""
    # usage arrives in the last chunk; model_copy does not validate, so pass the model itself
    # continuous usage: the role chunk tells the prompt's size before anything is generated
    options = StreamOptions(include_usage=True, continuous_usage_stats=True)
    body = body.model_copy(update={"stream": True, "n": 1, "stream_options": options})
    run = await start_chat(state, body, None, http=True)
    events = _events(run.chunks(include_usage=True))
    weakref.finalize(events, run.gen.cancel)  # never iterated: its finally never runs
    return events


async def _events(chunks) -> AsyncIterator[ChatEvent]:
    result = ChatResult()
    calls: dict[int, ToolCallResult] = {}
    try:
        async for data in chunks:
            if "error" in data:
                yield ChatEvent(error=APIError(data["error"].get("message") or "error", status=500))
                return
            if data.get("usage"):
                result.usage = data["usage"]
            for ch in data.get("choices") or []:
                d = ch.get("delta") or {}
                if "role" in d and data.get("usage"):
                    yield ChatEvent(prompt_tokens=data["usage"]["prompt_tokens"])
                lps = (ch.get("logprobs") or {}).get("content") or []
                result.logprobs += lps
                if d.get("reasoning_content"):
                    result.reasoning += d["reasoning_content"]
                    yield ChatEvent(reasoning=d["reasoning_content"], logprobs=[] if d.get("content") else lps)
                if d.get("content"):
                    result.content += d["content"]
                    yield ChatEvent(content=d["content"], logprobs=lps)
                for tc in d.get("tool_calls") or []:
                    fn = tc.get("function") or {}
                    call = calls.get(tc["index"])
                    if call is None:
                        call = calls[tc["index"]] = ToolCallResult(tc.get("id") or "", fn.get("name") or "")
                        result.tool_calls.append(call)
                        yield ChatEvent(tool_start=call)
                    if fn.get("arguments"):
                        call.arguments += fn["arguments"]
                        yield ChatEvent(tool_args=fn["arguments"])
                if ch.get("finish_reason"):
                    result.finish_reason = ch["finish_reason"]
                    result.matched_stop = ch.get("matched_stop")
        yield ChatEvent(finished=result)
    finally:
        await chunks.aclose()
