"""Rank 0's follower processes: started with it, watched while it serves, stopped with it.

A follower that dies takes the engine down at once, with its rank and cause: rank 0 sends a
``fatal`` frame to the server (which fails every waiting client and exits non-zero) and exits,
rather than wait forever in a collective the dead rank will never join.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from dataclasses import replace

import zmq

from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.procs import ipc
from llmkit.core.engine.procs.tp import (
    brief_error,
    follower_ended,
    free_port,
    init_tp,
    rank_device,
    ranks_of_node,
    spawn_followers,
)
from llmkit.core.model.parallel import TPGroup

log = logging.getLogger("llmkit")
WATCH_INTERVAL_S = 0.2


class Followers:
    def __init__(self, config: EngineConfig, procs: dict[int, subprocess.Popen], server_address: str) -> None:
        self.config = config
        self.procs = procs
        self.stopping = False
        self._server = server_address  # where fatal frames go (the server's engine-out socket)
        self._fatal_lock = threading.Lock()  # the watcher and a failed step may both get here
        threading.Thread(target=self._watch, name="llmkit-tp-watch", daemon=True).start()

    @classmethod
    def start(cls, config: EngineConfig, server_address: str) -> tuple[EngineConfig, "Followers"]:
        """Pick the rendezvous (on one node: a free loopback port), start this node's followers."""
        _check_model_shards(config)
        if config.device == "auto":
            import torch

            config = replace(config, device="cuda" if torch.cuda.is_available() else "cpu")
        if not config.dist_init_addr:
            config = replace(config, dist_init_addr=f"127.0.0.1:{free_port()}")
        if not config.num_threads and not config.device.startswith("cuda"):  # share the cores, don't fight
            local = len(ranks_of_node(config))
            config = replace(config, num_threads=max(1, (os.cpu_count() or 1) // local))
        procs = spawn_followers(config, ranks_of_node(config))
        log.info(
            "tensor parallel: %d ranks (%d on this node), rendezvous %s",
            config.tp_size,
            len(procs) + 1,
            config.dist_init_addr,
        )
        return replace(config, device=rank_device(config, 0)), cls(config, procs, server_address)

    def join_group(self) -> TPGroup:
        return init_tp(self.config, 0)

    def _watch(self) -> None:
        while not self.stopping:
            dead = self._dead_rank()
            if dead and not self.stopping:
                self.fatal(dead)
            time.sleep(WATCH_INTERVAL_S)

    def _dead_rank(self) -> str | None:
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) {follower_ended(proc, code)}"
        return None

    def step_failed(self, exc: BaseException) -> None:
        """A collective failed on rank 0. A local rank that died is usually why: name it (its exit
        may lag its closed connection by a moment); else the peer is on another node."""
        deadline = time.monotonic() + 2.0 if self.procs else 0.0  # no local ranks: nothing to wait for
        while (dead := self._dead_rank()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.fatal(
            dead or f"{self._remote_ranks()} died or is unreachable: a tensor-parallel step failed ({brief_error(exc)})"
        )

    def _remote_ranks(self) -> str:
        """The ranks on other nodes, by node: which peers the failed collective can have lost (gloo
        and NCCL name an address at best, not a rank)."""
        per_node, n = self.config.tp_size // self.config.nnodes, self.config.nnodes
        if n == 1:  # (every rank is local and none has exited yet)
            return "a tensor-parallel rank"
        last = self.config.tp_size - 1
        ranks = f"rank {last}" if per_node == 1 and n == 2 else f"ranks {per_node}-{last}"
        return f"node 1 (tensor-parallel {ranks})" if n == 2 else f"one of nodes 1-{n - 1} (tensor-parallel {ranks})"

    def fatal(self, why: str) -> None:
        """Tell the server why the engine stops, stop the other ranks, and exit."""
        self._fatal_lock.acquire()  # never released: the first caller exits the process
        log.error("%s; the engine stops", why)
        # A context of its own: terminating it waits (up to the linger) until the frame is sent.
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.connect(self._server)
        sock.send(ipc.pack("fatal", {"error": why}))
        sock.close(linger=2000)
        ctx.term()
        self.kill()
        os._exit(1)

    def wait(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()


def _check_model_shards(config: EngineConfig) -> None:
    """Refuse a model without tensor parallelism here, from its config alone, before any rank
    starts: otherwise each rank refuses it while building, and the first to die is reported."""
    from llmkit.core.engine.stages.plan import model_class
    from llmkit.core.model.loader.source import load_config, resolve_model_dir

    cls = model_class(load_config(resolve_model_dir(config.model_path, weights=False)), config.tp_size)
    if not cls.supports_tp:
        raise ValueError(f"{cls.__name__} does not support tensor parallelism (--tp-size {config.tp_size})")
