"""A linear layer with per-row LoRA deltas added on its output.

The base layer runs as it always does (dense, int8, int4 or GGUF blocks: its kernel is untouched);
then, per adapter in the batch, the rows of that adapter are gathered, shrunk by ``A`` and expanded
by the scaled ``B``, and added back: two small matmuls per adapter group and layer (the CPU form
of SGMV). Rows of no adapter pay nothing, and a batch with no adapter rows only reads one field.

On CUDA (Triton installed, ``LLMKIT_DISABLE_FUSED_KERNELS`` not 1) the whole batch's deltas of a
layer are two launches instead (:mod:`llmkit.core.lora.triton_sgmv`): the manager gives each row
its adapter's slot once per forward, and each layer keeps its adapters' weights in a fixed set of
slots (:mod:`llmkit.core.lora.slot_pool`), written when an adapter takes one. Those launches read
only device tensors, so a decode step with adapter rows replays from a CUDA graph (captured over
every slot, :meth:`LoRAManager.stage_for_graph`) like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmkit.core.lora.slot_pool import SlotPool
from llmkit.core.model.hot_module import HotModule
from llmkit.core.model.linear import Linear, in_tiles


@dataclass
class LoRABatch:
    """Which rows of the current forward use which adapter, set by the model runner around each
    forward (empty: no adapter rows, the layers add nothing). ``rows`` None: every row."""

    groups: list[tuple[object, torch.Tensor | None]] = field(default_factory=list)
    # CUDA kernels only (else None / empty): each row's slot in ``pool`` (int32, -1: no adapter)
    # and the forward's slots (by slot: the adapter there, None for a slot this forward leaves)
    row_slot: torch.Tensor | None = None
    slots: tuple = ()
    pool: SlotPool | None = None
    # A CUDA graph is being captured: ``row_slot`` is the graph's static buffer and every layer
    # launches over all its slots, whatever a replay's rows use (their weights are written first).
    captured: bool = False

    def stack(self, layer: "LoRALinear"):
        """``layer``'s slots (:class:`~llmkit.core.lora.slot_pool.Stack`), or None where no
        adapter of this forward adapts it (or, while captured, where the layer has no slots)."""
        if self.captured:
            return self.pool.stacks.get(layer.name)
        used = [s for s, ad in enumerate(self.slots) if ad is not None]
        return self.pool.stack(layer.name, layer.local_in, layer.local_out, used)


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
        base = self.base_layer
        if base.parallel != "row" or not (self.batch.groups or self.batch.row_slot is not None):
            # one rank, or a column-parallel layer: this rank's output rows are whole, and its
            # share of B (those rows) gives exactly their delta
            y = base(x, deterministic)
            self._add_deltas(x, y, deterministic)
            return y
        # Row-parallel under tensor parallelism: ``x`` is this rank's input columns and A holds the
        # same columns, so ``(x_r A_r^T) B^T`` is this rank's share of the delta, as ``x_r W_r^T``
        # is of the base output. Both are summed by the layer's one all-reduce: sum_r (x_r A_r^T)
        # B^T = (x A^T) B^T, exactly the unsharded delta (up to the float order of the sum, as the
        # base output), with no collective of its own. The bias is added once, after the sum.
        y = base.format.apply(base, x, deterministic)
        self._add_deltas(x, y, deterministic)
        y = base.tp.all_reduce(y)
        return y if base.bias is None else y + base.bias

    def _add_deltas(self, x: torch.Tensor, y: torch.Tensor, deterministic: bool) -> None:
        batch = self.batch
        if batch.row_slot is not None:  # the Triton kernels (set on CUDA, or by the interpreter tests)
            stack = batch.stack(self)
            if stack is not None:
                from llmkit.core.lora.triton_sgmv import add_lora

                add_lora(y, x.to(stack.a.dtype), stack, batch.row_slot)  # one row's delta: its own only
            return
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
