"""``Phi3ForCausalLM`` (Phi-3, Phi-3.5, Phi-4, Phi-4-mini, Phi-4-reasoning): Llama's block with the
checkpoint's Q/K/V and gate/up already fused (``qkv_proj``, ``gate_up_proj``: split here into
the parts a tensor-parallel rank slices), rotary on the first ``partial_rotary_factor`` of each head
(Phi-4-mini: 0.75), LongRoPE scaling (``core/model/decoder/longrope.py``), and Phi-3-mini-4k's
2047-token sliding window."""

from __future__ import annotations

from typing import Iterable

import torch

from llmkit.core.model.attention import SLIDING_WINDOW
from llmkit.core.model.decoder.longrope import LongRopeEmbedding
from llmkit.core.model.decoder.stack import DecoderLM
from llmkit.core.model.decoder.variant_attention import VariantAttention, window_of
from llmkit.core.model.layers import _rope_params
from llmkit.core.model.loader.source import materialize


def _rope_type(config: dict) -> str:
    params = _rope_params(config)
    return params.get("rope_type", params.get("type")) or "default"


class Phi3ForCausalLM(DecoderLM):
    qkv_bias = False
    qk_norm = False
    attention_features = frozenset({SLIDING_WINDOW})

    @property
    def rotary_dim(self) -> int:
        params = _rope_params(self.config)
        factor = params.get("partial_rotary_factor", self.config.get("partial_rotary_factor")) or 1.0
        return int(self.head_dim * float(factor))

    def rotary_embedding(self, rotary_dim: int):
        if _rope_type(self.config) in ("longrope", "su"):  # ("su": Phi-3-128k's first name for it)
            return LongRopeEmbedding(rotary_dim, int(self.config["max_position_embeddings"]), self.config)
        return super().rotary_embedding(rotary_dim)

    def build_attention(self, layer_id: int):
        window = window_of(self.config)
        if window is None and self.rotary_dim == self.head_dim:
            return None
        return VariantAttention(
            self.config, layer_id, self.head_dim, self.tp, rotary_dim=self.rotary_dim, sliding_window=window
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        heads, d = self.config["num_attention_heads"], self.head_dim
        q, kv = heads * d, self.num_kv_heads * d

        def unfused(stream):
            for name, tensor in stream:
                if name.endswith("self_attn.qkv_proj.weight"):
                    t = materialize(tensor)
                    base = name.removesuffix("qkv_proj.weight")
                    yield from zip((base + f"{p}_proj.weight" for p in "qkv"), t.split([q, kv, kv]))
                elif name.endswith("mlp.gate_up_proj.weight"):
                    t = materialize(tensor)
                    base = name.removesuffix("gate_up_proj.weight")
                    yield from zip((base + "gate_proj.weight", base + "up_proj.weight"), t.chunk(2))
                else:
                    yield name, tensor

        super().load_weights(unfused(weights))
