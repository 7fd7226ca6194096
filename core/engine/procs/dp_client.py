"""``DataParallelClient``: one EngineClient over M engine replicas (``--dp-size M``).

Each replica is an engine in its own process (:class:`ProcessEngineClient`) with its own model
copy, KV pool and radix cache; the server above sees one engine. The queue limit is global; each
request goes to the replica :class:`PrefixRouter` picks and stays there. A replica that dies fails
its own requests at once and stops the server (fail fast: a half-capacity server behind a load
balancer is harder to notice than one that exits non-zero and is restarted).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from llmkit.core.engine.client import QueueSlots
from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.messages import GenerateRequest, RequestOutput
from llmkit.core.engine.procs.dp_router import PrefixRouter
from llmkit.core.grammar.contract import GrammarSpec

log = logging.getLogger("llmkit")
# Counters that add up over replicas; the rest are taken from replica 0 or recomputed.
_SUMMED = (
    "num_running_reqs",
    "num_waiting_reqs",
    "kv_pages_total",
    "kv_pages_free",
    "kv_pages_cached",
    "kv_pages_in_use",
    "steps",
    "preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "spec_verify_steps",
    "spec_draft_tokens",
    "spec_accepted_tokens",
)


def start_replicas(config: EngineConfig, dp_size: int) -> list:
    """Start ``dp_size`` engine processes at once; each gets an equal share of the CPU threads
    unless ``--num-threads`` says otherwise. If one fails to start, the others are stopped."""
    from llmkit.core.engine.procs.process_client import ProcessEngineClient

    threads = config.num_threads or max(1, (os.cpu_count() or 1) // (dp_size * config.tp_size))
    config = dataclasses.replace(config, num_threads=threads)
    on_cuda = config.device == "cuda" or (config.device == "auto" and _cuda_available())
    log.info("Starting %d engine replicas (%s)", dp_size, "one GPU each" if on_cuda else f"{threads} CPU threads each")

    def start(rank: int):
        # A tensor-parallel replica places its ranks itself (on GPUs rank_device counts from dp_rank).
        device = ("cuda" if config.tp_size > 1 else f"cuda:{rank}") if on_cuda else config.device
        cfg = dataclasses.replace(config, device=device, dp_rank=rank)
        return ProcessEngineClient(cfg, config.max_queued_requests, rank=rank)

    with ThreadPoolExecutor(dp_size) as pool:
        futures = [pool.submit(start, r) for r in range(dp_size)]
    started, errors = [], []
    for f in futures:
        try:
            started.append(f.result())
        except BaseException as exc:  # noqa: BLE001 - reported below, after stopping the rest
            errors.append(exc)
    if errors:
        for client in started:
            client.shutdown()
        raise errors[0]
    return started


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class DataParallelClient(QueueSlots):
    def __init__(self, replicas: list, max_queued: int, router: PrefixRouter | None = None) -> None:
        super().__init__(max_queued)  # one limit over all replicas
        first = replicas[0]
        self.replicas = replicas
        self.tokenizer = first.tokenizer
        self.max_context = first.max_context
        self.vocab_size = first.vocab_size
        self.model_dir = first.model_dir
        self.outstanding = [0] * len(replicas)  # running on each replica now: the router's load
        self.routed = [0] * len(replicas)  # requests each replica was given since start
        self.router = router or PrefixRouter(len(replicas))
        self._where: dict[str, int] = {}

    # -- EngineClient ------------------------------------------------------------------------------
    async def check_grammar(self, spec: GrammarSpec) -> None:
        await self.replicas[0].check_grammar(spec)  # the same backend and checks on every replica

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        r = self.router.route(req.prompt_ids, self.outstanding)
        self.outstanding[r] += 1
        self.routed[r] += 1
        self._where[req.rid] = r
        try:
            async for out in self.replicas[r].generate(req):
                yield out
        finally:
            self.outstanding[r] -= 1
            self._where.pop(req.rid, None)

    async def abort(self, rid: str) -> None:
        r = self._where.get(rid)
        if r is not None:
            await self.replicas[r].abort(rid)

    def alive(self) -> bool:
        return all(r.alive() for r in self.replicas)

    def progress_age(self) -> float:
        return max(r.progress_age() for r in self.replicas)  # one stuck replica strands its clients

    @property
    def dead(self) -> str | None:
        return next((r.dead for r in self.replicas if r.dead), None)

    def stats(self) -> dict:
        per = [r.stats() for r in self.replicas]
        out = dict(per[0])
        for key in _SUMMED:
            out[key] = sum(p.get(key, 0) for p in per)
        if out.get("kv_pages_total"):
            out["token_usage"] = out["kv_pages_in_use"] / out["kv_pages_total"]
        if all("last_step_age_s" in p for p in per):
            out["last_step_age_s"] = min(p["last_step_age_s"] for p in per)
        out["dp_size"] = len(self.replicas)
        out["replicas"] = [
            {
                "rank": i,
                "pid": self.replicas[i].engine_pid,
                "outstanding": self.outstanding[i],
                "routed": self.routed[i],
                **{
                    k: p.get(k)
                    for k in ("num_running_reqs", "num_waiting_reqs", "kv_pages_in_use", "token_usage", "tp_ranks")
                    if k in p or k != "tp_ranks"
                },
            }
            for i, p in enumerate(per)
        ]
        return out

    def shutdown(self) -> None:
        with ThreadPoolExecutor(len(self.replicas)) as pool:  # every rank drains at once
            list(pool.map(lambda r: r.shutdown(), self.replicas))
