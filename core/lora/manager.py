"""The adapters an engine serves: installed on the model once, loaded and unloaded by name.

Building a :class:`LoRAManager` wraps each targetable projection of every decoder layer in a
:class:`LoRALinear` (only when LoRA serving is on: a server without it runs the plain layers).
Requests hold their :class:`LoRAAdapter` object, so unloading a name stops new requests from
using it while the ones already running finish with it.
"""

from __future__ import annotations

import itertools
import logging
from typing import Sequence

import torch
from torch import nn

from llmkit.core.lora.adapter import FUSED_PARTS, LoRAAdapter, build_adapter
from llmkit.core.lora.layer import LoRABatch, LoRALinear
from llmkit.core.lora.options import target_set
from llmkit.core.model.layers import FUSED_ON_CUDA
from llmkit.core.model.linear import Linear

log = logging.getLogger("llmkit")


class LoRAManager:
    def __init__(self, model: nn.Module, *, max_rank: int, max_per_batch: int, targets: Sequence[str] = ()) -> None:
        if getattr(model, "tp", None) is not None and model.tp.size > 1:
            raise ValueError("LoRA adapters under --tp-size > 1 are not supported yet")
        self.model = model
        self.max_rank = max_rank
        self.max_per_batch = max_per_batch
        self.allowed = target_set(targets)
        self.batch = LoRABatch()
        self.adapters: dict[str, LoRAAdapter] = {}
        self._uids = itertools.count(1)  # 0: the base model's prefix-cache space
        self.layers: dict[str, Linear] = {}
        self._install()

    def _install(self) -> None:
        wanted = {FUSED_PARTS[m][0] for m in self.allowed}
        for i, layer in enumerate(getattr(self.model, "layers", [])):
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
        if hasattr(self.model, "weights_changed"):
            self.model.weights_changed()  # a fused C plan must be built again from the wrapped layers

    def _param(self) -> tuple[torch.dtype, torch.device]:
        # the compute dtype and device (a norm's weight: a quantized linear's weight is not it)
        p = next(p for p in self.model.parameters() if p.is_floating_point())
        return p.dtype, p.device

    def read(self, name: str, path: str) -> LoRAAdapter:
        """The adapter at ``path``, checked against the model (any thread: it registers nothing)."""
        if not name:
            raise ValueError("a LoRA adapter needs a name")
        dtype, device = self._param()
        return build_adapter(
            name,
            path,
            next(self._uids),
            self.layers,
            max_rank=self.max_rank,
            allowed=self.allowed,
            dtype=dtype,
            device=device,
        )

    def add(self, adapter: LoRAAdapter) -> None:
        """Serve ``adapter`` under its name (engine thread)."""
        if adapter.name in self.adapters:
            raise ValueError(f"a LoRA adapter named '{adapter.name}' is already loaded")
        self.adapters[adapter.name] = adapter
        log.info("LoRA adapter '%s' loaded from %s (rank %d)", adapter.name, adapter.path, adapter.rank)

    def load(self, name: str, path: str) -> LoRAAdapter:
        adapter = self.read(name, path)
        self.add(adapter)
        return adapter

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
        if FUSED_ON_CUDA and torch.device(device).type == "cuda":
            self._slot_rows(per_segment, q_lens, device)
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
        """The Triton kernels' inputs: each row's slot (one host-to-device copy per forward) and
        the adapters in slot order (first appearance)."""
        slot_of: dict[int, int] = {}
        slots: list[LoRAAdapter] = []
        per_row: list[int] = []
        for adapter, n in zip(per_segment, q_lens):
            if adapter is None:
                per_row += [-1] * n
                continue
            s = slot_of.get(adapter.uid)
            if s is None:
                s = slot_of[adapter.uid] = len(slots)
                slots.append(adapter)
            per_row += [s] * n
        self.batch.slots = tuple(slots)
        self.batch.row_slot = torch.tensor(per_row, dtype=torch.int32, device=device)

    def deactivate(self) -> None:
        self.batch.groups = []
        self.batch.row_slot, self.batch.slots = None, ()
