"""``DataParallelClient``: one EngineClient over M engine replicas (``--dp-size M``).

Each replica is an engine in its own process (:class:`ProcessEngineClient`) with its own model
copy, KV pool and radix cache; the server above sees one engine. The queue limit is global; each
request goes to the replica :class:`PrefixRouter` picks and stays there.

A replica that dies fails its own requests at once; the others keep serving while it is started
again (``/health`` says ``degraded`` meanwhile). Past ``MAX_RESTARTS`` deaths within
``RESTART_WINDOW_S`` the server stops instead (fail fast: a replica that keeps dying will not be
fixed by another restart, and a server that exits non-zero gets noticed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from llmkit.core.engine.client import QueueSlots
from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.messages import GenerateRequest, RequestOutput
from llmkit.core.engine.procs.dp_router import PrefixRouter
from llmkit.core.grammar.contract import GrammarSpec

log = logging.getLogger("llmkit")
MAX_RESTARTS = 3  # replica deaths restarted within RESTART_WINDOW_S; one more stops the server
RESTART_WINDOW_S = 600.0
DOWN = 1 << 30  # the load the router sees on a replica that is down: never chosen while one is up
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


def replica_config(config: EngineConfig, dp_size: int, rank: int) -> EngineConfig:
    """Replica ``rank``'s config: an equal share of the CPU threads unless ``--num-threads`` says
    otherwise; on CUDA its own GPU."""
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // (dp_size * config.tp_size))
    on_cuda = config.device == "cuda" or (config.device == "auto" and _cuda_available())
    # A tensor-parallel replica places its ranks itself (on GPUs rank_device counts from dp_rank).
    device = ("cuda" if config.tp_size > 1 else f"cuda:{rank}") if on_cuda else config.device
    return dataclasses.replace(config, num_threads=threads, device=device, dp_rank=rank)


def start_replicas(config: EngineConfig, dp_size: int, on_death=None) -> list:
    """Start ``dp_size`` engine processes at once. If one fails to start, the others are stopped."""
    from llmkit.core.engine.procs.process_client import ProcessEngineClient

    first = replica_config(config, dp_size, 0)
    on_gpu = first.device.startswith("cuda")
    log.info(
        "Starting %d engine replicas (%s)",
        dp_size,
        "one GPU each" if on_gpu else f"{first.num_threads} CPU threads each",
    )

    def start(rank: int):
        cfg = replica_config(config, dp_size, rank)
        return ProcessEngineClient(cfg, config.max_queued_requests, rank=rank, on_death=on_death)

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


def _startup_loras(config: EngineConfig) -> dict[str, str]:
    from llmkit.core.lora.options import parse_lora_paths

    return dict(parse_lora_paths(config.lora_paths))


def _bring_loras(replica, has: dict[str, str], wanted: dict[str, str]) -> None:
    """Load and unload on a restarted ``replica`` (off the event loop) until it serves ``wanted``."""
    import asyncio

    async def sync() -> None:
        for name, path in has.items():
            if wanted.get(name) != path:
                await replica.unload_lora_adapter(name)
        for name, path in wanted.items():
            if has.get(name) != path:
                await replica.load_lora_adapter(name, path)

    asyncio.run(sync())


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class DataParallelClient(QueueSlots):
    @classmethod
    def start(cls, config: EngineConfig) -> "DataParallelClient":
        """``config.dp_size`` replicas, each restarted when it dies (see the module's docstring)."""
        box: list[DataParallelClient] = []  # the client, once built: replicas may die before that
        replicas = start_replicas(config, config.dp_size, on_death=lambda old: box[0]._replica_died(old))
        client = cls(replicas, config.max_queued_requests)
        client.config = config
        client.loras = _startup_loras(config)
        box.append(client)
        return client

    def __init__(self, replicas: list, max_queued: int, router: PrefixRouter | None = None) -> None:
        super().__init__(max_queued)  # one limit over all replicas
        self.config: EngineConfig | None = None  # set by start(): what a dead replica restarts with
        self.deaths: list[float] = []  # when replicas died, for the restart budget
        self.gave_up: str | None = None  # why the server stopped restarting replicas
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
        # the adapters every replica serves now (start-up ones, then as loaded and unloaded at run
        # time): what a restarted replica, which starts with the start-up ones, is brought back to
        self.loras: dict[str, str] = {}

    # -- EngineClient ------------------------------------------------------------------------------
    async def check_grammar(self, spec: GrammarSpec) -> None:
        await self.replicas[0].check_grammar(spec)  # the same backend and checks on every replica

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """On every live replica, or on none: one that refuses it unloads it from the others."""
        import asyncio

        live = [r for r in self.replicas if r.alive()]
        results = await asyncio.gather(*(r.load_lora_adapter(name, path) for r in live), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            loaded = [r for r, e in zip(live, results) if not isinstance(e, BaseException)]
            await asyncio.gather(*(r.unload_lora_adapter(name) for r in loaded), return_exceptions=True)
            raise errors[0]
        self.loras[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        import asyncio

        live = [r for r in self.replicas if r.alive()]
        results = await asyncio.gather(*(r.unload_lora_adapter(name) for r in live), return_exceptions=True)
        self.loras.pop(name, None)
        if all(isinstance(e, BaseException) for e in results):
            raise next(iter(results), KeyError(name))  # a KeyError: no replica had it

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        loads = [n if rep.alive() else DOWN for n, rep in zip(self.outstanding, self.replicas)]
        r = self.router.route(req.prompt_ids, loads)
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

    async def flush_cache(self) -> bool:
        """Every live replica's cache; True only if all of them dropped theirs."""
        import asyncio

        live = [r for r in self.replicas if r.alive()]
        return all(await asyncio.gather(*(r.flush_cache() for r in live)))

    def alive(self) -> bool:
        return self.gave_up is None and any(r.alive() for r in self.replicas)

    def degraded(self) -> str | None:
        down = [i for i, r in enumerate(self.replicas) if not r.alive()]
        return f"replica(s) {', '.join(map(str, down))} of {len(self.replicas)} down, restarting" if down else None

    def progress_age(self) -> float:
        # one stuck replica strands its clients; one that is down is being restarted
        return max((r.progress_age() for r in self.replicas if r.alive()), default=0.0)

    @property
    def dead(self) -> str | None:
        return self.gave_up

    # -- a replica died --------------------------------------------------------------------------
    def _replica_died(self, old) -> None:
        """On the dead replica's reader thread, after its clients got their errors."""
        from llmkit.core.engine.procs.process_client import stop_server_soon

        now = time.monotonic()
        self.deaths = [t for t in self.deaths if now - t < RESTART_WINDOW_S] + [now]
        if self.config is None or len(self.deaths) > MAX_RESTARTS or self.draining:
            self.gave_up = old.dead
            if len(self.deaths) > MAX_RESTARTS:
                log.error("%d replica deaths within %.0f s: not restarting again", len(self.deaths), RESTART_WINDOW_S)
            return stop_server_soon()
        log.warning("restarting replica %d (%d of %d restarts allowed)", old.rank, len(self.deaths), MAX_RESTARTS)
        threading.Thread(target=self._restart, args=(old,), name=f"llmkit-restart-{old.rank}", daemon=True).start()

    def _restart(self, old) -> None:
        from llmkit.core.engine.procs.process_client import ProcessEngineClient, stop_server_soon

        old.discard()
        cfg = replica_config(self.config, len(self.replicas), old.rank)
        try:
            new = ProcessEngineClient(cfg, self.config.max_queued_requests, rank=old.rank, on_death=self._replica_died)
        except Exception as exc:  # noqa: BLE001 - it cannot come back: stop rather than run degraded for ever
            log.error("replica %d did not restart: %s", old.rank, exc)
            self.gave_up = f"replica {old.rank} died and did not restart: {exc}"
            return stop_server_soon()
        try:
            has = _startup_loras(self.config)
            while has != self.loras:  # again if a load or unload landed on the others meanwhile
                wanted = dict(self.loras)
                _bring_loras(new, has, wanted)
                has = wanted
        except Exception as exc:  # noqa: BLE001 - it would answer its adapters' requests wrongly
            log.error("replica %d did not get its LoRA adapters back: %s", old.rank, exc)
            new.shutdown()
            self.gave_up = f"replica {old.rank} restarted without its LoRA adapters: {exc}"
            return stop_server_soon()
        self.replicas[old.rank] = new  # routed to only now, with the adapters the others serve
        log.info("replica %d is back (pid %d)", old.rank, new.engine_pid)

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
                "alive": self.replicas[i].alive(),
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
