"""A linear layer with per-row LoRA deltas added on its output.

The base layer runs as it always does (dense, int8, int4 or GGUF blocks: its kernel is untouched);
then, per adapter in the batch, the rows of that adapter are gathered, shrunk by ``A`` and expanded
by the scaled ``B``, and added back: two small matmuls per adapter group and layer (the CPU form
of SGMV). Rows of no adapter pay nothing, and a batch with no adapter rows only reads one field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmkit.core.model.hot_module import HotModule
from llmkit.core.model.linear import Linear, in_tiles


@dataclass
class LoRABatch:
    """Which rows of the current forward use which adapter, set by the model runner around each
    forward (empty: no adapter rows, the layers add nothing). ``rows`` None: every row."""

    groups: list[tuple[object, torch.Tensor | None]] = field(default_factory=list)


class LoRALinear(HotModule):
    """``base(x)`` plus ``(x[rows] @ A^T) @ B^T`` for each adapter group that adapts this layer."""

    def __init__(self, base: Linear, name: str, batch: LoRABatch) -> None:
        super().__init__()
        self.base_layer = base
        self.name = name  # the key of this layer in an adapter's weights
        self.batch = batch
        # what the layer's users read from a Linear
        self.in_features, self.out_features = base.in_features, base.out_features
        self.local_in, self.local_out = base.local_in, base.local_out
        self.bias_foldable = False  # the base's bias is added inside base_layer's forward

    def forward(self, x: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        y = self.base_layer(x, deterministic)
        for adapter, rows in self.batch.groups:
            ab = adapter.weights.get(self.name)
            if ab is None:
                continue
            a, b = ab
            xs = x if rows is None else x.index_select(0, rows)
            xs = xs.to(a.dtype)
            if deterministic:  # the same tiles as the base GEMM: a row's delta ignores its batch-mates
                delta = in_tiles(xs, lambda t: (t @ a.t()) @ b.t())
            else:
                delta = (xs @ a.t()) @ b.t()
            delta = delta.to(y.dtype)
            if rows is None:
                y.add_(delta)
            else:
                y.index_add_(0, rows, delta)
        return y
