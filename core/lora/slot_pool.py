"""Adapter slots for the CUDA kernels (:mod:`~llmkit.core.lora.triton_sgmv`): a fixed number per
adapted layer, allocated once, each adapter's weights written into its slot once.

The kernels read a forward's adapters from one stacked tensor per layer and pick each row's weights
by its slot. Stacking per *set* of adapters (as before) copied every layer's weights of every
adapter in the set whenever a batch's set changed, which in mixed traffic is most steps, and freed
the tensors a captured CUDA graph would still read. Here, as in SGLang's LoRA memory pool, each
layer owns ``num_slots`` slots sized for ``--max-lora-rank``; an adapter takes a slot when a
forward first needs it (an empty one, else the one least recently used by no adapter of this
forward) and keeps it until evicted, so the tensors never move and a steady mix of adapters costs
no copies at all.

On CUDA the manager allocates every layer's slots at start, before the KV pool is sized from the
free memory; elsewhere (the interpreter tests) a layer's slots are allocated on first use.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from llmkit.core.lora.adapter import FUSED_PARTS

MAX_BLOCKS = 3  # rank blocks of one fused layer at most (q, k, v)


@dataclass
class Stack:
    """One layer's slots, as the kernels read them (see triton_sgmv's module docstring)."""

    a: torch.Tensor  # [slots, R, in]: each slot's stacked A, zero rows past its own
    b: torch.Tensor  # [slots, out, r_max]: each output row's own rank block of B (scaled)
    r_total: torch.Tensor  # [slots] int32
    rank: torch.Tensor  # [slots] int32
    lo: torch.Tensor  # [slots, MAX_BLOCKS] int32
    hi: torch.Tensor  # [slots, MAX_BLOCKS] int32


def blocks_of(name: str) -> int:
    """Rank blocks an adapter can have in layer ``name`` (``layers.3.self_attn.qkv_proj``: 3)."""
    n = sum(1 for layer, _ in FUSED_PARTS.values() if name.endswith(layer))
    return n if 0 < n <= MAX_BLOCKS else MAX_BLOCKS


class SlotPool:
    def __init__(self, num_slots: int, max_rank: int) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self._owner: list[weakref.ref | None] = [None] * num_slots  # (weak: unloading frees the uid)
        self._owner_uid = [0] * num_slots
        self._used = [0] * num_slots  # the last forward (clock) that used each slot
        self._clock = 0
        self.stacks: dict[str, Stack] = {}
        self._written: dict[str, list[int]] = {}  # per layer: the uid whose weights each slot holds
        self._ranks: dict[str, list[int]] = {}  # per layer: each slot's rank there (0: not adapted)

    def owner(self, slot: int):
        ref = self._owner[slot]
        return None if ref is None else ref()

    def place(self, adapters: Sequence) -> dict[int, int]:
        """Slots for a forward's distinct ``adapters`` (at most ``num_slots``), by uid."""
        if len(adapters) > self.num_slots:
            raise ValueError(f"{len(adapters)} adapters in one forward; the pool has {self.num_slots} slots")
        self._clock += 1
        where = {ad.uid: s for s in range(self.num_slots) for ad in adapters if self._owner_uid[s] == ad.uid}
        for ad in adapters:
            if ad.uid in where:
                continue
            taken = set(where.values())
            free = [s for s in range(self.num_slots) if s not in taken]
            s = min(free, key=lambda s: (self.owner(s) is not None, self._used[s]))
            self._owner[s], self._owner_uid[s] = weakref.ref(ad), ad.uid
            where[ad.uid] = s
        for s in where.values():
            self._used[s] = self._clock
        return where

    def allocate(self, name: str, in_features: int, out_features: int, dtype, device) -> Stack:
        """Layer ``name``'s slots, all empty (zeros: rank 0 everywhere)."""
        r_pad = blocks_of(name) * self.max_rank
        n = self.num_slots

        def ints(*shape):
            return torch.zeros(*shape, dtype=torch.int32, device=device)

        stack = Stack(
            a=torch.zeros(n, r_pad, in_features, dtype=dtype, device=device),
            b=torch.zeros(n, out_features, self.max_rank, dtype=dtype, device=device),
            r_total=ints(n),
            rank=ints(n),
            lo=ints(n, MAX_BLOCKS),
            hi=ints(n, MAX_BLOCKS),
        )
        self.stacks[name] = stack
        self._written[name] = [0] * n
        self._ranks[name] = [0] * n
        return stack

    def allocate_layers(self, layers: dict, dtype, device) -> int:
        """Every layer's slots (``layers``: name -> the base ``Linear``); the bytes they take."""
        stacks = [self.allocate(name, base.local_in, base.local_out, dtype, device) for name, base in layers.items()]
        return sum(t.numel() * t.element_size() for st in stacks for t in (st.a, st.b))

    def stack(self, name: str, in_features: int, out_features: int, slots: Sequence[int]) -> Stack | None:
        """Layer ``name``'s slots, each holding its owner's weights, or None where no slot of
        ``slots`` (the forward's) adapts the layer (no launches)."""
        stack = self.stacks.get(name)
        if stack is None:
            first = next((ad for s in slots if (ad := self.owner(s)) is not None and name in ad.weights), None)
            if first is None:
                return None
            a0 = first.weights[name][0]
            stack = self.allocate(name, in_features, out_features, a0.dtype, a0.device)
        self._fill(name, slots)
        return stack if any(self._ranks[name][s] for s in slots) else None

    def write_all(self, slots: Sequence[int]) -> None:
        """Every allocated layer's ``slots`` hold their owners' weights: before a CUDA graph
        replay, whose captured launches read each layer's slots without asking for them."""
        for name in self.stacks:
            self._fill(name, slots)

    def _fill(self, name: str, slots: Sequence[int]) -> None:
        """Write each of ``slots`` whose owner changed since layer ``name`` last held it."""
        stack, written, ranks = self.stacks[name], self._written[name], self._ranks[name]
        for s in slots:
            if written[s] != self._owner_uid[s]:
                ranks[s] = _write(stack, s, self.owner(s), name)
                written[s] = self._owner_uid[s]


def _write(stack: Stack, s: int, adapter, name: str) -> int:
    """Slot ``s`` of one layer's stack holds ``adapter``'s weights there (or none); its rank there."""
    stack.a[s].zero_()
    stack.b[s].zero_()
    lo, hi = [0] * MAX_BLOCKS, [0] * MAX_BLOCKS
    r_total = r = 0
    if adapter is not None and name in adapter.weights:
        wa, wb = adapter.weights[name]
        parts, r = adapter.parts[name], adapter.rank
        if len(parts) > MAX_BLOCKS or wa.shape[0] != len(parts) * r or wa.shape[0] > stack.a.shape[1]:
            raise ValueError(f"LoRA adapter '{adapter.name}': {name} has {len(parts)} rank blocks of {r}")
        stack.a[s, : wa.shape[0]] = wa
        r_total = wa.shape[0]
        for i, (dst, rows) in enumerate(parts):
            stack.b[s, dst : dst + rows, :r] = wb[dst : dst + rows, i * r : (i + 1) * r]
            lo[i], hi[i] = dst, dst + rows
    stack.r_total[s], stack.rank[s] = r_total, r
    stack.lo[s].copy_(torch.tensor(lo, dtype=torch.int32))
    stack.hi[s].copy_(torch.tensor(hi, dtype=torch.int32))
    return r
