"""Fixed-size recurrent state of hybrid models, beside the paged K/V.

A hybrid model (Qwen3.5's Gated DeltaNet, Mamba2, short-convolution layers) declares, for each of
its state layers, the tensors a sequence keeps there whatever its length (a convolution's last
inputs, a recurrent matrix). The pool holds them in slots:

- two working slots per request row (of :class:`~llmkit.core.kvcache.kv_pool.ReqToTokenPool`): a
  step reads a request's current slot and writes the other, and only a step that succeeded flips
  which one is current. A step that raises halfway through its layers leaves every request's state
  as it was, so the engine can run its requests again one by one (a failing request fails alone)
  without recomputing anything;
- snapshot slots: copies of a state at a token position, which the prefix cache keeps with its
  radix nodes (``core/kvcache/state_radix_cache.py``) so a later request resumes from them.

Slot numbering: row ``r``'s working slots are ``2r`` and ``2r + 1``; snapshots follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: one state layer's tensors: (shape per slot, dtype) each
StateSpec = list[tuple[tuple[int, ...], torch.dtype]]


class StatePool:
    def __init__(self, specs: list[StateSpec], rows: int, snapshots: int, device: torch.device) -> None:
        self.specs = specs
        self.rows = rows
        self.num_snapshots = snapshots
        self.num_slots = 2 * rows + snapshots
        # torch.empty: on the CPU untouched slots commit no memory (a snapshot slot costs RAM once used)
        self.layers = [
            [torch.empty((self.num_slots, *shape), dtype=dtype, device=device) for shape, dtype in spec]
            for spec in specs
        ]
        self._bank = [0] * rows
        # Under tensor parallelism rank 0 logs its copies (flat source, destination pairs) for the
        # other ranks to make before the next step; their banks flip as rank 0's do.
        self.copy_log: list[int] | None = None
        self._free = list(range(self.num_slots - 1, 2 * rows - 1, -1))  # snapshot slots, a stack

    # -- working slots ----------------------------------------------------------------------
    def current(self, row: int) -> int:
        return 2 * row + self._bank[row]

    def slots(self, rows: list[int]) -> tuple[list[int], list[int]]:
        """Each row's slot to read and slot to write this step."""
        bank = self._bank
        return [2 * r + bank[r] for r in rows], [2 * r + 1 - bank[r] for r in rows]

    def flip(self, rows) -> None:
        """After a step that succeeded: what it wrote becomes current."""
        bank = self._bank
        for r in rows:
            bank[r] ^= 1

    def unflip(self, row: int) -> None:
        """Make the state before the last step current again (speculative decoding: the step ran
        draft tokens that were rejected; the step before left it intact in the other slot)."""
        self._bank[row] ^= 1
        if self.copy_log is not None:
            self.copy_log += [-1, row]

    # -- snapshots ----------------------------------------------------------------------------
    @property
    def num_free_snapshots(self) -> int:
        return len(self._free)

    def snapshot(self, row: int) -> int | None:
        """A copy of ``row``'s current state in a snapshot slot, or None when none is free."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.copy(self.current(row), slot)
        return slot

    def restore(self, row: int, slot: int) -> None:
        """Make snapshot ``slot`` the current state of ``row``."""
        self.copy(slot, self.current(row))

    def free_snapshot(self, slot: int) -> None:
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        if self.copy_log is not None:
            self.copy_log += [src, dst]
        for tensors in self.layers:
            for t in tensors:
                t[dst].copy_(t[src])

    def take_copy_log(self) -> list[int]:
        log, self.copy_log = self.copy_log or [], []
        return log

    def copy_pairs(self, pairs: list[int]) -> None:
        """Make rank 0's logged copies (flat source, destination pairs; source -1: an
        :meth:`unflip` of the row in destination), in order."""
        for i in range(0, len(pairs), 2):
            if pairs[i] < 0:
                self._bank[pairs[i + 1]] ^= 1
            else:
                self.copy(pairs[i], pairs[i + 1])

    def bytes_per_slot(self) -> int:
        return state_bytes(self.specs)


def state_bytes(specs: list[StateSpec]) -> int:
    """The bytes one slot holds over every state layer."""
    total = 0
    for spec in specs:
        for shape, dtype in spec:
            n = 1
            for d in shape:
                n *= d
            total += n * dtype.itemsize
    return total


@dataclass
class StateBatch:
    """A forward's view of the pool: per sequence (batch order), the slot its state layers read and
    the slot they write, and whether it starts from no state (its first token is position 0)."""

    pool: StatePool
    read: torch.Tensor  # [B] int64, on the pool's device
    write: torch.Tensor
    fresh: list[bool]

    @classmethod
    def build(cls, pool: StatePool, rows: list[int], starts: list[int], device) -> "StateBatch":
        read, write = pool.slots(rows)
        idx = torch.tensor([read, write], dtype=torch.int64).to(device)
        return cls(pool, idx[0], idx[1], [s == 0 for s in starts])
