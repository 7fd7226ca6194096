"""``MixtralForCausalLM`` (Mixtral 8x7B, 8x22B): Mistral's attention, every layer's feed-forward a
routed MoE (softmax over the experts, the top ``num_experts_per_tok`` renormalised), experts named
``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate, up, down)."""

from __future__ import annotations

from typing import Iterable

import torch

from llmkit.core.model.attention import SLIDING_WINDOW
from llmkit.core.model.decoder.routed_moe import RoutedMoE, load_moe_decoder
from llmkit.core.model.decoder.stack import DecoderLM
from llmkit.core.model.decoder.variant_attention import VariantAttention, window_of


class MixtralForCausalLM(DecoderLM):
    qkv_bias = False
    qk_norm = False
    supports_cuda_graph = False  # FusedExperts groups tokens by expert with host-side counts
    attention_features = frozenset({SLIDING_WINDOW})
    moe_scoring = "softmax"

    def __init__(self, config: dict, tp=None) -> None:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act '{act}' is not supported for {type(self).__name__}; supported: silu")
        super().__init__(config, tp)

    def build_attention(self, layer_id: int):
        window = window_of(self.config)
        if window is None:
            return None
        return VariantAttention(self.config, layer_id, self.head_dim, self.tp, sliding_window=window)

    def build_mlp(self, layer_id: int):
        return RoutedMoE(self.config, self.tp, self.moe_scoring)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_moe_decoder(self, weights)
