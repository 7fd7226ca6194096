"""The adapters an engine serves: installed on the model once, loaded and unloaded by name.

Building a :class:`LoRAManager` wraps each targetable projection of every decoder layer in a
:class:`LoRALinear` (only when LoRA serving is on: a server without it runs the plain layers).
Requests hold their :class:`LoRAAdapter` object, so unloading a name stops new requests from
using it while the ones already running finish with it.

Under ``--tp-size N`` every rank has a manager over its shard of the model (each adapter split as
its layers are, see :mod:`~llmkit.core.lora.adapter`). Rank 0's is the one the engine calls: a
run-time load reads the adapter there, then on every other rank (the load travels on the step
wire, :meth:`StepBroadcaster.send_lora_load`), and is served only when every rank read it. The
other ranks know adapters by uid alone (the steps name each sequence's adapter by uid): they drop
one when rank 0 says the last holder of it there is gone (an unloaded adapter whose requests ended).
"""

from __future__ import annotations

import collections
import itertools
import logging
import weakref
from typing import Sequence

import torch
from torch import nn

from llmkit.core.lora.adapter import FUSED_PARTS, LoRAAdapter, build_adapter
from llmkit.core.lora.layer import LoRABatch, LoRALinear
from llmkit.core.lora.options import target_set
from llmkit.core.lora.slot_pool import SlotPool
from llmkit.core.model.layers import FUSED_ON_CUDA
from llmkit.core.model.linear import Linear
from llmkit.core.model.parallel import SINGLE

log = logging.getLogger("llmkit")


class LoRAManager:
    def __init__(self, model: nn.Module, *, max_rank: int, max_per_batch: int, targets: Sequence[str] = ()) -> None:
        self.model = model
        self.tp = getattr(model, "tp", None) or SINGLE
        self.channel = None  # rank 0 of a TP group: the StepBroadcaster run-time loads travel on
        self._held: dict[int, LoRAAdapter] = {}  # the other ranks: every adapter by uid, until freed
        self._freed: collections.deque[int] = collections.deque()  # rank 0: uids nothing holds any more
        self.max_rank = max_rank
        self.max_per_batch = max_per_batch
        self.allowed = target_set(targets)
        self.batch = LoRABatch()
        self.adapters: dict[str, LoRAAdapter] = {}
        self._uids = itertools.count(1)  # 0: the base model's prefix-cache space
        self.layers: dict[str, Linear] = {}
        self._install()
        dtype, device = self._param()
        if FUSED_ON_CUDA and device.type == "cuda":  # every layer's slots now, before the KV pool is sized
            self.batch.pool = SlotPool(max_per_batch, max_rank)
            size = self.batch.pool.allocate_layers(self.layers, dtype, device)
            log.info(
                "LoRA slots: %d per layer up to rank %d, %.2f GiB on %s", max_per_batch, max_rank, size / 2**30, device
            )

    def _install(self) -> None:
        wanted = {FUSED_PARTS[m][0] for m in self.allowed}
        # the decoder's layers: the model's own, or a vision-language model's language model's
        # (Gemma 3); adapters of the vision encoder are refused when read (adapter.py)
        decoder = self.model if hasattr(self.model, "layers") else getattr(self.model, "language_model", self.model)
        for i, layer in enumerate(getattr(decoder, "layers", [])):
            for path in sorted(wanted):
                owner_name, attr = path.split(".")
                owner = getattr(layer, owner_name, None)
                base = getattr(owner, attr, None)
                if isinstance(base, Linear):
                    name = f"layers.{i}.{path}"
                    self.layers[name] = base
                    setattr(owner, attr, LoRALinear(base, name, self.batch))
        if not self.layers:
            raise ValueError(f"{type(self.model).__name__} has no projections LoRA adapters can target")
        for owner in {id(self.model): self.model, id(decoder): decoder}.values():
            if hasattr(owner, "weights_changed"):
                owner.weights_changed()  # a fused C plan must be built again from the wrapped layers

    def _param(self) -> tuple[torch.dtype, torch.device]:
        # the compute dtype and device (a norm's weight: a quantized linear's weight is not it)
        p = next(p for p in self.model.parameters() if p.is_floating_point())
        return p.dtype, p.device

    def read(self, name: str, path: str, uid: int | None = None) -> LoRAAdapter:
        """The adapter at ``path``, checked against the model (any thread: it registers nothing)."""
        if not name:
            raise ValueError("a LoRA adapter needs a name")
        dtype, device = self._param()
        return build_adapter(
            name,
            path,
            next(self._uids) if uid is None else uid,
            self.layers,
            max_rank=self.max_rank,
            allowed=self.allowed,
            dtype=dtype,
            device=device,
        )

    def add(self, adapter: LoRAAdapter) -> None:
        """Serve ``adapter`` under its name (engine thread)."""
        if self.tp.rank > 0:  # rank 0 names adapters; here they are only looked up by uid
            self._held[adapter.uid] = adapter
            log.info("LoRA adapter '%s' (uid %d) loaded from %s", adapter.name, adapter.uid, adapter.path)
            return
        if adapter.name in self.adapters:
            raise ValueError(f"a LoRA adapter named '{adapter.name}' is already loaded")
        self.adapters[adapter.name] = adapter
        if self.tp.size > 1:  # the other ranks keep their share until nothing here holds it
            weakref.finalize(adapter, self._freed.append, adapter.uid)
        log.info("LoRA adapter '%s' loaded from %s (rank %d)", adapter.name, adapter.path, adapter.rank)

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read and serve the adapter at ``path`` as ``name``; on rank 0 of a tensor-parallel
        engine (once it serves) on every rank, or on none with a ValueError."""
        adapter = self.read(name, path)
        if self.channel is not None:
            if name in self.adapters:
                raise ValueError(f"a LoRA adapter named '{name}' is already loaded")
            try:
                self.channel.send_lora_load(name, path, adapter.uid)
                failed = self._agree(True)
            except Exception as exc:  # a collective failed: the group is broken
                self.channel.fail(exc)
                raise
            if failed:
                ranks = ", ".join(map(str, failed))
                raise ValueError(
                    f"LoRA adapter '{name}' at '{path}' could not be loaded on tensor-parallel rank {ranks} "
                    "(its log says why); it is loaded on no rank"
                )
        self.add(adapter)
        return adapter

    def load_on_follower(self, name: str, path: str, uid: int) -> None:
        """A rank other than 0: rank 0 read the adapter (as ``uid``); read this rank's share, and
        keep it only if every rank could."""
        try:
            adapter = self.read(name, path, uid)
        except Exception as exc:  # reported to rank 0 as this rank's failure (and logged here)
            log.error("LoRA adapter '%s' at '%s' cannot be loaded on this rank: %s", name, path, exc)
            adapter = None
        if not self._agree(adapter is not None) and adapter is not None:
            self.add(adapter)

    def _agree(self, ok: bool) -> list[int]:
        """Every rank says whether its read worked (a collective): the ranks where it failed."""
        flags = torch.zeros(self.tp.size, dtype=torch.int64, device=self._param()[1])
        flags[self.tp.rank] = 0 if ok else 1
        self.tp.all_reduce(flags)
        return [r for r, bad in enumerate(flags.tolist()) if bad]

    def take_freed(self) -> list[int]:
        """Rank 0: the uids of adapters nothing here holds any more (unloaded, their requests
        ended), for the other ranks to drop; each is given once."""
        out = []
        while self._freed:
            out.append(self._freed.popleft())
        return out

    def resolve(self, uids: Sequence[int]) -> list[LoRAAdapter | None]:
        """A rank other than 0: a step's per-sequence adapter uids (0: the base) as adapters."""
        return [self._held[u] if u else None for u in uids]

    def release(self, uids: Sequence[int]) -> None:
        """A rank other than 0: drop the adapters rank 0 freed."""
        for u in uids:
            adapter = self._held.pop(u, None)
            if adapter is not None:
                log.info("LoRA adapter '%s' (uid %d) dropped: unloaded, its requests ended", adapter.name, u)

    def unload(self, name: str) -> None:
        """Stop serving ``name`` (engine thread); requests already running keep their adapter."""
        if self.adapters.pop(name, None) is None:
            raise KeyError(name)
        log.info("LoRA adapter '%s' unloaded", name)

    def get(self, name: str) -> LoRAAdapter | None:
        return self.adapters.get(name)

    def activate(self, per_segment: Sequence[LoRAAdapter | None], q_lens: Sequence[int], device) -> bool:
        """Group the forward's rows by adapter (``per_segment``: each segment's, None for the
        base); False when no row uses one (the forward runs as without LoRA)."""
        self.batch.row_slot, self.batch.slots = None, ()
        if all(a is None for a in per_segment):
            self.batch.groups = []
            return False
        if FUSED_ON_CUDA and torch.device(device).type == "cuda":  # the kernels read the rows' slots only
            self._slot_rows(per_segment, q_lens, device)
            self.batch.groups = []
            return True
        first = per_segment[0]
        if all(a is first for a in per_segment):
            self.batch.groups = [(first, None)]
            return True
        rows: dict[int, list[int]] = {}
        owners: dict[int, LoRAAdapter] = {}
        start = 0
        for adapter, n in zip(per_segment, q_lens):
            if adapter is not None:
                owners[adapter.uid] = adapter
                rows.setdefault(adapter.uid, []).extend(range(start, start + n))
            start += n
        self.batch.groups = [
            (owners[uid], torch.tensor(r, dtype=torch.int64, device=device)) for uid, r in rows.items()
        ]
        return True

    def _slot_rows(self, per_segment: Sequence[LoRAAdapter | None], q_lens: Sequence[int], device) -> None:
        """The Triton kernels' inputs: each row's slot in the pool (one host-to-device copy per
        forward) and the forward's adapters by slot."""
        if self.batch.pool is None:
            self.batch.pool = SlotPool(self.max_per_batch, self.max_rank)
        distinct = list({a.uid: a for a in per_segment if a is not None}.values())
        slot_of = self.batch.pool.place(distinct)
        slots: list = [None] * self.batch.pool.num_slots
        per_row: list[int] = []
        for adapter, n in zip(per_segment, q_lens):
            if adapter is None:
                per_row += [-1] * n
                continue
            s = slot_of[adapter.uid]
            slots[s] = adapter
            per_row += [s] * n
        self.batch.slots = tuple(slots)
        self.batch.row_slot = torch.tensor(per_row, dtype=torch.int32, device=device)

    @property
    def graphable(self) -> bool:
        """Whether adapter rows run through the Triton kernels over slots allocated at start:
        launches a CUDA graph can capture (else adapter steps run eagerly)."""
        return self.batch.pool is not None and bool(self.batch.pool.stacks)

    def capture_with(self, row_slot: torch.Tensor) -> LoRABatch:
        """The batch a CUDA graph is captured with: each row's slot read from ``row_slot`` (the
        graph's static buffer) and every layer launched over all its slots."""
        self.batch.groups, self.batch.slots = [], ()
        self.batch.row_slot, self.batch.captured = row_slot, True
        return self.batch

    def end_capture(self) -> None:
        self.batch.captured = False
        self.deactivate()

    def stage_for_graph(self, row_slot: torch.Tensor, n: int) -> None:
        """Before a replay of a graph captured with :meth:`capture_with`: its ``row_slot`` buffer
        holds this forward's ``n`` rows' slots (-1 for padding and base rows), and each adapter
        of the forward has its weights in its slot in every layer (a graph asks for no slot)."""
        batch = self.batch
        if batch.row_slot is None:  # no adapter row in this forward (or none activated)
            row_slot.fill_(-1)
            return
        batch.pool.write_all([s for s, ad in enumerate(batch.slots) if ad is not None])
        row_slot[:n].copy_(batch.row_slot)
        row_slot[n:].fill_(-1)

    def deactivate(self) -> None:
        self.batch.groups = []
        self.batch.row_slot, self.batch.slots = None, ()
