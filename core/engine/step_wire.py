"""The tensor-parallel step on the wire: what rank 0 broadcasts before every forward.

Rank 0's model runner sends each step (:class:`StepBroadcaster`) and every follower rank receives
it (:func:`receive_step`) and runs the same forward on its shard; the collectives inside the layers
keep the ranks in lock step. A step on the wire is two int64 tensors (a fixed header, then a
payload), never a pickled object:

    header:  op, T tokens, B sequences, S sampled rows, P prompt-logit ranges, W slot writes, payload length,
             L LoRA uids (0 or B), F freed LoRA uids
    payload: ids[T] positions[T] q_lens[B] kv_lens[B] rows[B] decoding[B] sample_rows[S] lora uids[L]
             freed uids[F] prompt (start, end)[P] writes (row, start, n)[W] slots[sum n]

A run-time LoRA load is a frame of its own between steps (op ``OP_LORA_LOAD``, the adapter's uid in
the header, its name and path as UTF-8 JSON bytes in the payload); every rank reads the adapter and
they agree with a collective (:meth:`LoRAManager.load`).

The slot writes are the scheduler's changes to the request-to-token table since the last step
(new tokens, prefix-cache hits, reused rows), so every follower's table mirrors rank 0's without
ever copying whole rows. It sits beside the model runner, which uses it; the process plumbing that
starts the ranks (``procs/tp*.py``) sits above the engine builder.

While idle, rank 0 sends a heartbeat (a header alone, ``OP_HEARTBEAT``) every few seconds, which
the followers skip. A dead follower is then found within seconds even while idle (its closed
connection fails the next heartbeat), and a silent peer, whose connection never closes (a power
loss, a cut network), within ``PEER_TIMEOUT_S`` on both sides: rank 0's heartbeat is not taken up
(a gloo send completes only once the receiver has posted its receive), and a follower that hears
nothing that long gives up on rank 0.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass, field

import torch

from llmkit.core.model.parallel import TPGroup

OP_STEP, OP_STOP, OP_LORA_LOAD, OP_HEARTBEAT = 1, 2, 3, 4
_HEADER = 12
# Idle seconds before rank 0 sends a heartbeat: a dead peer is found this soon while idle, for one
# small broadcast per interval.
HEARTBEAT_INTERVAL_S = float(os.environ.get("LLMKIT_TP_HEARTBEAT_S", 5))
# How long a follower waits for a step or heartbeat, and rank 0 for its heartbeat to be taken up,
# before calling the peer lost: 12 missed heartbeats, so that a stall of rank 0's host (swapping, a
# long garbage collection) is not taken for a lost node. Steps never wait on it: a follower waits
# for the next header only while rank 0 does its host work between two steps. (Env: tests.)
PEER_TIMEOUT_S = float(os.environ.get("LLMKIT_TP_PEER_TIMEOUT_S", 60))


@dataclass
class LoRALoad:
    """A run-time LoRA load, for every rank to read (as ``uid``, the one rank 0 gave it)."""

    name: str
    path: str
    uid: int


def _wait(work, timeout_s: float | None, what: str) -> None:
    """Wait for a collective started with ``async_op=True``, at most ``timeout_s`` seconds."""
    if timeout_s is None:
        work.wait()
        return
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError:
        if work.is_completed():  # it failed (a closed connection), not timed out
            raise
        raise TimeoutError(f"{what} within {timeout_s:g} s") from None


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
    # (index in ids, row of the step in flight's picks): ids still on the device (rank 0 alone,
    # never on the wire: a tensor-parallel group does not chain steps)
    from_prev: list[tuple[int, int]] = field(default_factory=list)
    # per sequence: its LoRA adapter or None (empty: no adapter rows); on the wire by uid, 0 for none
    loras: list = field(default_factory=list)
    # the uids of LoRA adapters rank 0 no longer holds, for the other ranks to drop (wire only)
    lora_freed: list[int] = field(default_factory=list)
    # Images (rank 0 alone: vision-language models are not served under tensor parallelism):
    # ``images`` (first row, item, encoder rows a:b), ``rope`` the (t, h, w) positions of every row
    # (M-RoPE), ``bidirectional`` per sequence its spans that attend both ways (see plan_images)
    images: list = field(default_factory=list)
    rope: list | None = None
    bidirectional: list = field(default_factory=list)
    # Tree drafts: each node is a sequence of its own whose slot list is its request's with columns
    # ``first ..`` taken from the request's columns ``cols`` (its ancestors' and its own slots), as
    # ``(sequence, first, cols)``
    tree_keys: list = field(default_factory=list)
    # K/V that rank 0 moved since the last step (a tree's kept nodes, see core/speculative/verify.py):
    # flat (source slot, destination slot) pairs the other ranks move too before this forward
    kv_moves: list[int] = field(default_factory=list)
    # A hybrid model's state copies rank 0 made since the last step (snapshots taken and restored,
    # see core/kvcache/state_pool.py): flat (source slot, destination slot) pairs
    state_copies: list[int] = field(default_factory=list)


class StepBroadcaster:
    """Rank 0's side of the wire."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.on_fatal = None  # called with the exception when a step fails: the group is broken
        self.last_sent = 0.0  # (monotonic) the last header sent: the first idle moment sends a heartbeat

    def fail(self, exc: BaseException) -> None:
        """A step failed on rank 0: a peer is gone or out of step, so no later step can work."""
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def send(self, inp: StepInputs, writes: list[tuple[int, int, torch.Tensor]]) -> None:
        import torch.distributed as dist

        slots = [w[2] for w in writes]
        uids = [0 if a is None else a.uid for a in inp.loras]
        tree = [x for v, first, cols in inp.tree_keys for x in (v, first, len(cols), *cols)]
        flat = [
            torch.tensor(
                inp.ids
                + inp.positions
                + inp.q_lens
                + inp.kv_lens
                + inp.rows
                + inp.decoding
                + inp.sample_rows
                + uids
                + inp.lora_freed
            ),
            torch.tensor(
                [x for r in inp.prompt_ranges for x in r] + [x for w in writes for x in (w[0], w[1], len(w[2]))]
            ),
            torch.tensor(tree + inp.kv_moves + inp.state_copies, dtype=torch.int64),
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
                len(uids),
                len(inp.lora_freed),
                len(tree),
                len(inp.kv_moves),
                len(inp.state_copies),
            ],
            dtype=torch.int64,
        )
        dist.broadcast(header, 0, group=self.tp.group)
        dist.broadcast(payload, 0, group=self.tp.group)
        self.last_sent = time.monotonic()

    def keep_alive(self) -> None:
        """Between steps: a heartbeat if nothing was sent for ``HEARTBEAT_INTERVAL_S``; raises when
        a follower does not take it up within ``PEER_TIMEOUT_S`` (or its connection is closed)."""
        if time.monotonic() - self.last_sent < HEARTBEAT_INTERVAL_S:
            return
        import torch.distributed as dist

        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = OP_HEARTBEAT
        _wait(
            dist.broadcast(header, 0, group=self.tp.group, async_op=True),
            PEER_TIMEOUT_S,
            "the idle heartbeat was not taken up",
        )
        self.last_sent = time.monotonic()

    def send_lora_load(self, name: str, path: str, uid: int) -> None:
        """Have every other rank read the LoRA adapter at ``path`` as ``uid`` (between steps)."""
        import torch.distributed as dist

        data = json.dumps({"name": name, "path": path}).encode()
        payload = torch.tensor(list(data), dtype=torch.int64)
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1], header[6] = OP_LORA_LOAD, uid, payload.numel()
        dist.broadcast(header, 0, group=self.tp.group)
        dist.broadcast(payload, 0, group=self.tp.group)
        self.last_sent = time.monotonic()

    def stop(self) -> None:
        import torch.distributed as dist

        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = OP_STOP
        dist.broadcast(header, 0, group=self.tp.group)


def receive_step(
    tp: TPGroup, timeout_s: float | None = None
) -> tuple[StepInputs, list[tuple[int, int, torch.Tensor]]] | LoRALoad | None:
    """A follower's side of the wire: the next step, a LoRA load, or None when rank 0 stops. A
    step's ``loras`` are uids (the follower's LoRA manager resolves them). Heartbeats are skipped;
    ``timeout_s``: raise TimeoutError when neither a step nor a heartbeat comes that long."""
    import torch.distributed as dist

    header = torch.empty(_HEADER, dtype=torch.int64)
    while True:
        work = dist.broadcast(header, 0, group=tp.group, async_op=True)
        _wait(work, timeout_s, "no step or heartbeat from tensor-parallel rank 0")
        op, t, b, s, p, w, n, n_lora, n_freed, n_tree, n_moves, n_copies = header.tolist()
        if op != OP_HEARTBEAT:
            break
    if op == OP_STOP:
        return None
    payload = torch.empty(n, dtype=torch.int64)
    dist.broadcast(payload, 0, group=tp.group)
    if op == OP_LORA_LOAD:
        msg = json.loads(bytes(payload.tolist()).decode())
        return LoRALoad(msg["name"], msg["path"], t)
    sizes = [t, t, b, b, b, b, s, n_lora, n_freed, 2 * p, 3 * w, n_tree, n_moves, n_copies]
    parts = payload.split(sizes + [n - sum(sizes)])
    ids, pos, q_lens, kv_lens, rows, decoding, sample, loras, freed, prompt, write_hdr, tree, moves, copies, slots = (
        parts
    )
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
        loras=loras.tolist(),
        lora_freed=freed.tolist(),
        kv_moves=moves.tolist(),
        state_copies=copies.tolist(),
    )
    flat, i = tree.tolist(), 0
    while i < len(flat):  # (sequence, first column, count, columns...)
        v, first, k = flat[i : i + 3]
        inp.tree_keys.append((v, first, flat[i + 3 : i + 3 + k]))
        i += 3 + k
    writes, off = [], 0
    hdr = write_hdr.tolist()
    for i in range(0, len(hdr), 3):
        row, start, k = hdr[i : i + 3]
        writes.append((row, start, slots[off : off + k]))
        off += k
    return inp, writes
