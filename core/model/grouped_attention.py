"""Attention for a model whose K/V layers differ in shape (``CausalLM.kv_layer_shapes``).

Every backend's metadata and kernels are built for one K/V head count and head size (the torch
backend's head rows, the Triton kernels' block sizes, the C kernel's strides), so a model with
two shapes of layer (Gemma 4: sliding layers of 256-wide heads, full ones of 512-wide heads and
fewer K/V heads) gets one backend instance per distinct shape. They share the pool, its pages and
slots (each layer's buffers have their own shape); a forward prepares each group's metadata once
and sends each layer to its group. No kernel changes, and a model of one shape gets the plain
backend, exactly as before.
"""

from __future__ import annotations

import dataclasses

import torch

from llmkit.core.model.attention import AttentionBackend, AttentionMetadata

Shape = tuple[int, int, int]  # (K/V heads, key channels, value channels) of one K/V layer


def build_attention(cls, shapes: list[Shape], *, num_heads: int, v_out: int, **common) -> AttentionBackend:
    """One ``cls`` instance if every K/V layer has the same shape, else a :class:`ShapeGroupedAttention`.
    ``v_out``: the output head size where the layers are alike (``CausalLM.attention_v_dim``);
    ``common``: the rest of the backend's keyword arguments (pool, device, scale)."""
    distinct = sorted(set(shapes), key=shapes.index)

    def make(shape: Shape, out: int) -> AttentionBackend:
        heads, k, _ = shape
        extra = {"v_head_dim": out} if out != k else {}
        return cls(num_heads=num_heads, num_kv_heads=heads, head_dim=k, **common, **extra)

    if len(distinct) == 1:
        return make(distinct[0], v_out)
    return ShapeGroupedAttention([make(s, s[2] or s[1]) for s in distinct], [distinct.index(s) for s in shapes])


class ShapeGroupedAttention(AttentionBackend):
    """Sends each K/V layer to the backend instance of its shape (see the module docstring)."""

    supports_cuda_graph = False  # (each group would need its own static buffers: not wired yet)

    def __init__(self, backends: list[AttentionBackend], group_of_layer: list[int]) -> None:
        first = backends[0]
        super().__init__(
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            pool=first.pool,
            device=first.device,
            scale=first.scale,
            v_head_dim=first.v_head_dim,
        )
        self.backends, self.group_of_layer = backends, group_of_layer
        self.features = frozenset.intersection(*(frozenset(b.features) for b in backends))

    def prepare_metadata(self, md: AttentionMetadata) -> AttentionMetadata:
        """Each group's own metadata (its private ``extra``), kept in this forward's ``extra``."""
        md.extra["shape_groups"] = [b.prepare_metadata(dataclasses.replace(md, extra={})) for b in self.backends]
        return md

    def forward(self, q, k, v, layer_id, metadata, *, sliding_window=None, sinks=None) -> torch.Tensor:
        g = self.group_of_layer[layer_id]
        kw = {"sliding_window": sliding_window} if sliding_window else {}
        if sinks is not None:
            kw["sinks"] = sinks
        return self.backends[g].forward(q, k, v, layer_id, metadata.extra["shape_groups"][g], **kw)
