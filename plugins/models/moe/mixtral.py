"""``MixtralForCausalLM`` (Mixtral 8x7B, 8x22B): Mistral's attention, every layer's feed-forward a
routed MoE (softmax over the experts, the top ``num_experts_per_tok`` renormalised), experts named
``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate, up, down)."""

from __future__ import annotations

from typing import Iterable

import torch

from llmkit.core.model.attention import SLIDING_WINDOW
from llmkit.core.model.decoder.routed_moe import RoutedMoE, load_expert
from llmkit.core.model.decoder.stack import DecoderLM, check_loaded, place_tensor
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
        self._native_plan = False
        modules, params = dict(self.named_modules()), dict(self.named_parameters())
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
        }
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
            if "rotary_emb" in name or (self.tie and name == "lm_head.weight"):
                continue
            # MiniMax-M2's correction bias sits beside the router, not in it
            name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
            if load_expert(modules, name, tensor):
                continue
            owner, leaf, part = place_tensor(self, modules, params, name, tensor, fused)
            loaded.add((f"{owner}.{leaf}", part))
        check_loaded(self, loaded)
