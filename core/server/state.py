"""What the HTTP handlers share: the engine client, the tokenizer, the template and options."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from llmkit.core.chat_template import ChatTemplate
from llmkit.core.engine import RequestOutput
from llmkit.core.request import Request


@dataclass
class ServerOptions:
    served_model_name: str
    api_key: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    grammar_backend: str = "xgrammar"
    max_payload_size: int = 32 << 20
    max_prompt_list: int = 256
    stream_include_usage_default: bool = False


@dataclass
class ServerState:
    client: Any  # EngineClient
    tokenizer: Any
    chat_template: ChatTemplate | None
    options: ServerOptions
    max_context: int
    vocab_size: int
    sampling_defaults: dict = field(default_factory=dict)
    grammar: Any = None  # a grammar backend, or None when disabled
    started: float = field(default_factory=time.time)
    last_activity: float = field(default_factory=time.monotonic)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


async def merge_outputs(client, reqs: list[Request]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run several requests (n > 1, list prompts) and yield ``(index, output)`` as they come."""
    if len(reqs) == 1:
        async for out in client.generate(reqs[0]):
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, req: Request):
        try:
            async for out in client.generate(req):
                await q.put((i, out))
        finally:
            await q.put((i, done))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
    remaining = len(tasks)
    try:
        while remaining:
            i, out = await q.get()
            if out is done:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
