"""``Glm4MoeForCausalLM`` (GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7): grouped-query attention with a
Q/K/V bias, optional per-head Q/K norms (``use_qk_norm``) and rotary on the first half of each head
(``partial_rotary_factor``); after the first ``first_k_dense_replace`` dense layers, DeepSeek-V3's
MoE (``core/model/decoder/deepseek.py``: sigmoid scores plus a correction bias within the best
expert groups, renormalised, times ``routed_scaling_factor``, plus the shared experts). The
multi-token-prediction layer the checkpoints ship after the last one is skipped."""

from __future__ import annotations

from typing import Iterable

import torch

from llmkit.core.model.decoder.deepseek import MoE
from llmkit.core.model.decoder.routed_moe import load_moe_decoder
from llmkit.core.model.decoder.stack import DecoderLM
from llmkit.core.model.decoder.variant_attention import VariantAttention
from llmkit.core.model.layers import _rope_params


class Glm4MoeForCausalLM(DecoderLM):
    supports_cuda_graph = False  # FusedExperts groups tokens by expert with host-side counts

    def __init__(self, config: dict, tp=None) -> None:
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act '{config['hidden_act']}' is not supported; supported: silu")
        quant = (config.get("quantization_config") or {}).get("quant_method")
        if quant:
            raise ValueError(f"quantization_config.quant_method '{quant}' is not supported for Glm4MoeForCausalLM")
        super().__init__(config, tp)

    @property
    def rotary_dim(self) -> int:
        params = _rope_params(self.config)
        factor = params.get("partial_rotary_factor", self.config.get("partial_rotary_factor", 0.5))
        return int(self.head_dim * float(factor))

    def build_attention(self, layer_id: int):
        c = self.config
        return VariantAttention(
            c,
            layer_id,
            self.head_dim,
            self.tp,
            qkv_bias=bool(c.get("attention_bias", False)),
            qk_norm="head" if c.get("use_qk_norm") else None,
            rotary_dim=self.rotary_dim,
        )

    def build_mlp(self, layer_id: int):
        c = self.config
        sparse = int(c.get("n_routed_experts") or 0) > 0 and layer_id >= int(c.get("first_k_dense_replace") or 0)
        return MoE(c, self.tp, "v3") if sparse else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_moe_decoder(self, weights)
