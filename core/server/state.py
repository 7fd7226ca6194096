"""What the HTTP handlers share: the engine client, the tokenizer, the template and options."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from llmkit.core.engine.client import QueueFullError
from llmkit.core.engine.messages import GenerateRequest as Request
from llmkit.core.engine.messages import RequestOutput
from llmkit.core.server.access.rate_limits import current_limiter
from llmkit.core.server.config import ServerConfig
from llmkit.core.server.prompts.chat_template import ChatTemplate
from llmkit.core.server.prompts.render_pool import render_pool


@dataclass
class ServerState:
    client: Any  # EngineClient
    tokenizer: Any
    chat_template: ChatTemplate | None
    options: ServerConfig
    max_context: int
    vocab_size: int
    # The sampling fields the generation config sets (--generation-config); every route resolves
    # a request's fields against them with generation/sampling_defaults.resolve ({}: neutral values)
    sampling_defaults: dict = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    metrics: Any = None  # ServerMetrics (create_app makes it unless --disable-metrics)
    render_pool: Any = field(default_factory=render_pool)  # chat templates render here (render_pool.py)
    in_flight: set = field(default_factory=set)  # Generations of HTTP requests (drained on shutdown)
    generate_rids: set = field(default_factory=set)  # caller-chosen /generate rids now running
    loras: dict = field(default_factory=dict)  # LoRA adapter name -> its path, least recently used first
    lora_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # resolver loads, one at a time
    lora_resolver: Any = None  # a LoRAResolver (--lora-resolver, --lora-dir), or None
    resolved_loras: set = field(default_factory=set)  # the loaded adapters it gave (evictable)
    # An embedding model's EmbeddingEngine (then also ``client``, for health and the drain); None
    # for a generative model
    embedder: Any = None
    # A speech-to-text model's SpeechEngine (then also ``client``); None where the model takes no audio
    speech: Any = None
    queued_inputs: int = 0  # inputs of HTTP embedding, rerank and score requests held (embedder_calls.py)
    # A vision-language model's MultimodalProcessor (None: the model reads text only) and the
    # limits on where its images come from (llmkit.core.multimodal.media)
    mm: Any = None
    media: Any = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int = 0) -> dict:
    """The ``usage`` object of chat and completions responses."""
    u = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens:  # SGLang's top-level field, and OpenAI's place for it
        u["reasoning_tokens"] = reasoning_tokens
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return u


def wants_stream_usage(state: "ServerState", body) -> bool:
    """Whether a stream ends with a usage chunk (request option or server default)."""
    return state.options.stream_include_usage_default or bool(body.stream_options and body.stream_options.include_usage)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class Generation:
    """The engine requests of one API call (n > 1 and list prompts give several), started at once.

    Starting happens in the handler, before any response is sent, so a queue slot is taken and
    given back exactly once per request: each request's task releases its slot when it ends,
    however it ends (finished, aborted, or cancelled before it ever ran).
    """

    _DONE = object()

    def __init__(
        self,
        client,
        reqs: list[Request],
        registry: set | None = None,
        queue_timeout: float | None = None,
        metrics=None,
        limiter=None,
    ) -> None:
        if len(reqs) > client.max_queued:
            # Never fits, however long the client waits: a 400 saying why, not a 429 to retry forever.
            from llmkit.core.server.errors import APIError

            raise APIError(
                f"this request needs {len(reqs)} engine requests (prompts x n) but the server holds "
                f"at most {client.max_queued} at once (--max-queued-requests); split it up",
                param="n",
                code="request_too_large",
            )
        try:
            client.check_capacity(len(reqs))  # reserves the slots, or raises QueueFullError
        except QueueFullError:
            if metrics is not None:
                metrics.on_rejected()
            raise
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = []
        self.started = False  # any output yet (the engine has taken it off its queue)
        self.registry = registry
        if registry is not None:
            registry.add(self)
        self._timer = None
        if queue_timeout:
            self._timer = asyncio.get_running_loop().call_later(queue_timeout, self._queue_timeout, queue_timeout)
        for i, req in enumerate(reqs):
            tracker = metrics.track(req) if metrics is not None else None
            task = asyncio.ensure_future(self._pump(client, i, req, tracker, limiter))
            task.add_done_callback(lambda _t, c=client: c.release(1))
            self.tasks.append(task)

    async def _pump(self, client, i: int, req: Request, tracker, limiter) -> None:
        last = None
        try:
            async for out in client.generate(req):
                self.started = True
                last = out
                if tracker is not None:
                    tracker.on_output(out)
                await self.queue.put((i, out))
        finally:
            if tracker is not None:
                tracker.close()  # a stream cut short (client gone) counts as an abort
            if limiter is not None and last is not None:  # the counts are totals so far, aborted or not
                limiter.charge(last.prompt_tokens + last.completion_tokens)
            await self.queue.put((i, self._DONE))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield ``(index, output)`` as they come; stopping early aborts the rest.

        Outputs that queued up while the handler was busy (the engine outran the event loop)
        come out merged, one per request, as vLLM's output collector does: a stream then sends
        one chunk for several tokens instead of falling further behind, one chunk per token."""
        remaining = len(self.tasks)
        try:
            while remaining:
                batch = [await self.queue.get()]
                while not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                merged: dict[int, RequestOutput] = {}
                for i, out in batch:
                    if out is self._DONE:
                        remaining -= 1
                    elif isinstance(out, Exception):  # fail(): the handler answers with it
                        for item in merged.items():
                            yield item
                        raise out
                    elif out.error:  # yielded in its place, after what came before it
                        for item in merged.items():
                            yield item
                        merged.clear()
                        yield i, out
                    else:
                        prev = merged.get(i)
                        merged[i] = out if prev is None else _merge(prev, out)
                for item in merged.items():
                    yield item
        finally:
            self.cancel()

    def fail(self, exc: Exception) -> None:
        """End the call with ``exc`` (an APIError: 503 on shutdown or queue timeout), which the
        handler turns into an error response or a final error event; the engine requests abort."""
        self.queue.put_nowait((-1, exc))  # ahead of the _DONE markers the cancelled pumps put
        self.cancel()

    def _queue_timeout(self, seconds: float) -> None:
        if not self.started:
            from llmkit.core.server.errors import APIError

            self.fail(
                APIError(
                    f"the request waited more than {seconds:g} s in the queue (--queue-timeout); retry later",
                    status=503,
                    code="queue_timeout",
                )
            )

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self._timer is not None:
            self._timer.cancel()
        if self.registry is not None:
            self.registry.discard(self)


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One output for ``a`` then ``b`` (both deltas of the same request): ``b``'s totals and end,
    the text, tokens and logprobs of both."""
    return replace(
        b,
        text=a.text + b.text,
        token_ids=a.token_ids + b.token_ids,
        logprobs=a.logprobs + b.logprobs,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        queue_time=a.queue_time if a.queue_time is not None else b.queue_time,
    )


def start_generation(state: ServerState, reqs: list[Request], http: bool) -> Generation:
    """Start an API call's engine requests. HTTP ones (not batch lines) are tracked for the
    shutdown drain, get the queue wait timeout, and count towards the caller's tokens per minute."""
    _check_vocabulary(state, reqs)
    reqs = _salted(reqs)
    if not http:
        return Generation(state.client, reqs, metrics=state.metrics)
    if state.client.draining:  # validated while SIGTERM came: the drain would not wait for it
        from llmkit.core.server.shutdown import shutting_down

        raise shutting_down()
    return Generation(
        state.client, reqs, state.in_flight, state.options.queue_timeout or None, state.metrics, current_limiter.get()
    )


def _salted(reqs: list[Request]) -> list[Request]:
    """The requests in their caller's prefix-cache space (its key's owner or shared space, and the
    ``cache_salt`` it sent): a prefix is reused only within one space."""
    from dataclasses import replace

    from llmkit.core.server.access.owners import cache_salt, current_cache_scope

    scope = current_cache_scope.get()
    return [replace(r, cache_salt=cache_salt(scope, r.cache_salt)) for r in reqs]


def _check_vocabulary(state: ServerState, reqs: list[Request]) -> None:
    """Token ids a client sends are checked where they come in; this catches the ones a text
    tokenizes to, when the tokenizer knows more tokens than the model has rows for (a tokenizer
    that does not fit the model): a 400 saying so, not the engine's refusal as a 500."""
    for req in reqs:
        if req.prompt_ids and max(req.prompt_ids) >= state.vocab_size:
            from llmkit.core.server.errors import APIError

            raise APIError(
                f"the prompt tokenizes to token id {max(req.prompt_ids)}, outside the model's vocabulary "
                f"(size {state.vocab_size}): the tokenizer does not fit this model",
                code="tokenizer_mismatch",
            )
