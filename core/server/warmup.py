"""The routes' warm-up: a few requests served through the app before it takes connections.

The engine's warm-up compiles the device's kernels; the first client request still paid for what
only the HTTP side does once (FastAPI building each route's handler on first use, lazily imported
request and streaming modules, the tokenizer's first call, the detokenizer's byte table): 70 ms of
an 87 ms first TTFT on a 2-core CPU with the engine already warm. As SGLang does, the server sends
itself a completion and a chat completion, streamed and not, before ``/health`` can answer
(uvicorn accepts connections once the app's start-up is over). A request that fails only logs.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

log = logging.getLogger("llmkit")
TIMEOUT_S = 120.0


def _requests(model: str) -> list[tuple[str, dict]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    text = {"model": model, "prompt": "The warm-up of a server", "max_tokens": 4}
    return [
        ("/v1/completions", {**text, "stream": True}),
        ("/v1/completions", {**text, "temperature": 0}),
        ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/chat/completions", chat),
    ]


async def warm_routes(app, model: str, api_key: str | None) -> None:
    t0 = time.monotonic()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    codes = []
    quiet = logging.getLogger("httpx")
    level = quiet.level
    quiet.setLevel(max(level, logging.WARNING))  # no request log lines
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://llmkit-warmup", headers=headers)
    try:
        async with client:
            for path, body in _requests(model):
                try:
                    r = await asyncio.wait_for(client.post(path, json=body), TIMEOUT_S)
                    codes.append(r.status_code)
                except Exception as exc:  # noqa: BLE001 - a warm-up never stops the server from starting
                    log.warning("route warm-up: %s failed: %s", path, exc)
    finally:
        quiet.setLevel(level)
    log.info("Route warm-up: %d requests (HTTP %s) in %.2f s", len(codes), codes, time.monotonic() - t0)
