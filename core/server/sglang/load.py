"""SGLang's ``GET /get_load``: what SGLang's Model Gateway polls to weigh workers (its
power-of-two policy and queue-aware routing; ``/get_loads`` on the gateway shows the sum).

SGLang answers one object per data-parallel rank; the gateway sums ``num_tokens`` over the list
and reads ``num_waiting_reqs``. llmkit's data-parallel replicas sit behind one URL, so it answers
one entry for the whole server.
"""

from __future__ import annotations

from fastapi import APIRouter

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

    return router
