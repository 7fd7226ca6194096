"""What SGLang's Model Gateway asks of a worker besides the APIs, answered as SGLang does.

``GET /get_load``: what the gateway polls to weigh workers (its power-of-two policy and
queue-aware routing; ``/get_loads`` on the gateway shows the sum).

SGLang answers one object per data-parallel rank; the gateway sums ``num_tokens`` over the list
and reads ``num_waiting_reqs``. llmkit's data-parallel replicas sit behind one URL, so it answers
one entry for the whole server.

``POST /flush_cache`` (the gateway's ``/flush_cache`` fans out to it): drops the prefix cache,
refused with a 400 while requests run, as SGLang does.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from llmkit.core.server.state import ServerState


def load_report(stats: dict) -> list[dict]:
    running, waiting = stats.get("num_running_reqs", 0), stats.get("num_waiting_reqs", 0)
    # KV tokens held by requests (cached prefixes nobody uses are free to evict: not load)
    tokens = stats.get("kv_pages_in_use", 0) * stats.get("page_size", 1)
    return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": tokens}]


def load_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/get_load")
    async def get_load():
        return load_report(state.client.stats())

    @router.api_route("/flush_cache", methods=["GET", "POST"])  # SGLang takes both
    async def flush_cache():
        if await state.client.flush_cache():
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse(
            "Cache not flushed: requests are running or waiting; try again once they have finished.\n",
            status_code=400,
        )

    return router
