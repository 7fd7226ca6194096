"""Tensor parallelism (``--tp-size N``): N ranks on ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

Rank 0 is the engine: it schedules, samples and talks to the server. Before every forward it
broadcasts the step to the other ranks (the *followers*), which run the same forward on their
shard of the weights and of the KV cache (the step's wire format: :mod:`llmkit.core.engine.step_wire`).
This module joins the group, places and starts the follower ranks, and runs a follower's loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile

import torch

from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.stages.startup_gc import freeze_after_startup
from llmkit.core.engine.step_wire import PEER_TIMEOUT_S, LoRALoad, receive_step
from llmkit.core.model.parallel import TPGroup

log = logging.getLogger("llmkit")

# The group's timeout while the ranks start: nodes may be started minutes apart, and one may load
# its weights much slower than another (the ranks meet again after loading, to agree on the KV pool).
_IDLE_TIMEOUT = datetime.timedelta(days=30)
# Then, while serving, the longest any collective may wait for a peer (gloo's per-operation timeout),
# so that rank 0 inside a step with a silent peer (a power loss, a cut network: no connection is
# closed) fails within minutes, not days. Idle waits no longer need more (heartbeats: see
# step_wire). Inside a step a rank waits for the others only as long as they lag it by, at most a
# layer's compute; on CPU one layer of a long prefill can take tens of seconds, hence this margin.
STEP_TIMEOUT_S = float(os.environ.get("LLMKIT_TP_STEP_TIMEOUT_S", 300))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_of_node(config: EngineConfig) -> range:
    per_node = config.tp_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def init_tp(config: EngineConfig, rank: int) -> TPGroup:
    """Join the tensor-parallel group at ``config.dist_init_addr`` as ``rank``."""
    import torch.distributed as dist

    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{config.dist_init_addr}",
        rank=rank,
        world_size=config.tp_size,
        timeout=_IDLE_TIMEOUT,
    )
    return TPGroup(rank=rank, size=config.tp_size, group=dist.group.WORLD)


def bound_collectives(tp: TPGroup) -> None:
    """Once this rank is built: every later collective waits at most ``STEP_TIMEOUT_S``."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(seconds=STEP_TIMEOUT_S), tp.group)


def rank_device(config: EngineConfig, rank: int) -> str:
    """Each rank of a node on its own GPU (after the GPUs of the data-parallel replicas before it)."""
    if not config.device.startswith("cuda"):
        return config.device
    per_node = config.tp_size // config.nnodes
    return f"cuda:{config.dp_rank * per_node + rank % per_node}"


def spawn_followers(config: EngineConfig, ranks) -> dict[int, subprocess.Popen]:
    """Start follower ranks of this node as ``python -m llmkit.core.engine.procs.tp_worker``."""
    procs = {}
    for r in ranks:
        if r == 0:
            continue
        cfg = json.dumps(dataclasses.asdict(config))
        procs[r] = subprocess.Popen([sys.executable, "-m", "llmkit.core.engine.procs.tp_worker", cfg, str(r)])
    return procs


def describe_exit(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _exit_note(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"llmkit-tp-rank-{pid}.error")


def leave_exit_note(error: str) -> None:
    """A failing follower's last word: why it failed, for the rank that started it to report
    (the follower's own log line goes to the server's log, not to the client)."""
    with contextlib.suppress(OSError):
        with open(_exit_note(os.getpid()), "w") as f:
            f.write(error)


def follower_ended(proc: subprocess.Popen, code: int) -> str:
    """How a follower ended: ``failed: <its error>`` when it left a note, else ``died: <exit>``."""
    note = _exit_note(proc.pid)
    try:
        with open(note) as f:
            error = f.read().strip()
        os.unlink(note)
    except OSError:
        error = ""
    return f"failed: {error}" if error else f"died: {describe_exit(code)}"


def brief_error(exc: BaseException) -> str:
    """An error for a log line or a client; a failed gloo collective's without its source location
    and generic advice (``[.../pair.cc:553] Connection closed by peer ... This is typically ...``)."""
    text = re.sub(r"^\[[^\]]*\.cc:\d+\]\s*", "", str(exc)).split(" This is typically")[0]
    return f"{type(exc).__name__}: {text}"


def run_follower(config: EngineConfig, rank: int) -> int:
    """A follower rank: build this rank's shard of the engine, then run every step rank 0 sends."""
    from llmkit.core.engine.builder import build_engine_parts

    tp = init_tp(config, rank)
    parts = build_engine_parts(config, tp=tp)
    freeze_after_startup()
    log.info("tensor-parallel rank %d of %d ready (pid %d)", rank, tp.size, os.getpid())
    runner, req_pool = parts.runner, parts.runner.req_pool
    timeout = None  # the first step may wait for rank 0 to finish its build; from then on, heartbeats
    with torch.inference_mode():
        while True:
            step = receive_step(tp, timeout)
            if timeout is None:
                bound_collectives(tp)
                timeout = PEER_TIMEOUT_S
            if step is None:
                break
            if isinstance(step, LoRALoad):  # between steps: read it here too (or tell rank 0 why not)
                runner.lora.load_on_follower(step.name, step.path, step.uid)
                continue
            inp, writes = step
            for row, start, slots in writes:
                req_pool.write(row, start, slots)
            if inp.kv_moves:  # a tree's kept nodes: moved on rank 0 when it verified them
                runner.move_kv(inp.kv_moves)
            if inp.state_copies:  # a hybrid model's snapshots, taken or restored on rank 0
                runner.states.copy_pairs(inp.state_copies)
            if inp.lora_freed:
                runner.lora.release(inp.lora_freed)
            if inp.loras:
                inp.loras = runner.lora.resolve(inp.loras)
            runner.execute(inp)
    log.info("tensor-parallel rank %d stopped", rank)
    return 0
