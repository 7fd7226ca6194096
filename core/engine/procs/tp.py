"""Tensor parallelism (``--tp-size N``): N ranks on ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

Rank 0 is the engine: it schedules, samples and talks to the server. Before every forward it
broadcasts the step to the other ranks (the *followers*), which run the same forward on their
shard of the weights and of the KV cache; the collectives inside the layers (all-reduce after
row-parallel layers, all-gather of the logits) keep the ranks in lock step. A step on the wire is
two int64 tensors (a fixed header, then a payload), never a pickled object:

    header:  op, T tokens, B sequences, S sampled rows, P prompt-logit ranges, W slot writes, payload length
    payload: ids[T] positions[T] q_lens[B] kv_lens[B] rows[B] sample_rows[S] prompt (start, end)[P]
             writes (row, start, n)[W] slots[sum n]

The slot writes are the scheduler's changes to the request-to-token table since the last step
(new tokens, prefix-cache hits, reused rows), so every follower's table mirrors rank 0's without
ever copying whole rows.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field

import torch

from llmkit.core.engine.config import EngineConfig
from llmkit.core.model.parallel import TPGroup

log = logging.getLogger("llmkit")

OP_STEP, OP_STOP = 1, 2
_HEADER = 7
# A follower waits for the next step for as long as the server is idle; a dead peer is noticed
# through its closed connection (or, on one node, by rank 0 watching its followers), not a timeout.
_IDLE_TIMEOUT = datetime.timedelta(days=30)


@dataclass
class StepInputs:
    """One forward, as plain lists: what every rank needs to run it."""

    ids: list[int]
    positions: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    rows: list[int]
    sample_rows: list[int] = field(default_factory=list)  # rows of the hidden states to sample from
    prompt_ranges: list[tuple[int, int]] = field(default_factory=list)  # prompt-logprob spans
    decoding: list[int] = field(default_factory=list)  # per sequence: 1 if its token is a generated one


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


class StepBroadcaster:
    """Rank 0's side of the wire."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.on_fatal = None  # called with the exception when a step fails: the group is broken

    def fail(self, exc: BaseException) -> None:
        """A step failed on rank 0: a peer is gone or out of step, so no later step can work."""
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def send(self, inp: StepInputs, writes: list[tuple[int, int, torch.Tensor]]) -> None:
        import torch.distributed as dist

        slots = [w[2] for w in writes]
        flat = [
            torch.tensor(
                inp.ids + inp.positions + inp.q_lens + inp.kv_lens + inp.rows + inp.decoding + inp.sample_rows
            ),
            torch.tensor(
                [x for r in inp.prompt_ranges for x in r] + [x for w in writes for x in (w[0], w[1], len(w[2]))]
            ),
            *slots,
        ]
        payload = torch.cat([t.to(torch.int64) for t in flat])
        header = torch.tensor(
            [
                OP_STEP,
                len(inp.ids),
                len(inp.rows),
                len(inp.sample_rows),
                len(inp.prompt_ranges),
                len(writes),
                payload.numel(),
            ],
            dtype=torch.int64,
        )
        dist.broadcast(header, 0, group=self.tp.group)
        dist.broadcast(payload, 0, group=self.tp.group)

    def stop(self) -> None:
        import torch.distributed as dist

        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = OP_STOP
        dist.broadcast(header, 0, group=self.tp.group)


def receive_step(tp: TPGroup) -> tuple[StepInputs, list[tuple[int, int, torch.Tensor]]] | None:
    """A follower's side of the wire: the next step, or None when rank 0 stops."""
    import torch.distributed as dist

    header = torch.empty(_HEADER, dtype=torch.int64)
    dist.broadcast(header, 0, group=tp.group)
    op, t, b, s, p, w, n = header.tolist()
    if op == OP_STOP:
        return None
    payload = torch.empty(n, dtype=torch.int64)
    dist.broadcast(payload, 0, group=tp.group)
    sizes = [t, t, b, b, b, b, s, 2 * p, 3 * w]
    parts = payload.split(sizes + [n - sum(sizes)])
    ids, pos, q_lens, kv_lens, rows, decoding, sample, prompt, write_hdr, slots = parts
    flat_prompt = prompt.tolist()
    inp = StepInputs(
        ids=ids.tolist(),
        positions=pos.tolist(),
        q_lens=q_lens.tolist(),
        kv_lens=kv_lens.tolist(),
        rows=rows.tolist(),
        sample_rows=sample.tolist(),
        prompt_ranges=[(flat_prompt[i], flat_prompt[i + 1]) for i in range(0, len(flat_prompt), 2)],
        decoding=decoding.tolist(),
    )
    writes, off = [], 0
    hdr = write_hdr.tolist()
    for i in range(0, len(hdr), 3):
        row, start, k = hdr[i : i + 3]
        writes.append((row, start, slots[off : off + k]))
        off += k
    return inp, writes


def run_follower(config: EngineConfig, rank: int) -> int:
    """A follower rank: build this rank's shard of the engine, then run every step rank 0 sends."""
    from llmkit.core.engine.builder import build_engine_parts

    tp = init_tp(config, rank)
    parts = build_engine_parts(config, tp=tp)
    log.info("tensor-parallel rank %d of %d ready (pid %d)", rank, tp.size, os.getpid())
    runner, req_pool = parts.runner, parts.runner.req_pool
    with torch.inference_mode():
        while True:
            step = receive_step(tp)
            if step is None:
                break
            inp, writes = step
            for row, start, slots in writes:
                req_pool.write(row, start, slots)
            runner.execute(inp)
    log.info("tensor-parallel rank %d stopped", rank)
    return 0
