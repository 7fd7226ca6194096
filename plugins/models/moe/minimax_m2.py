"""``MiniMaxM2ForCausalLM`` (MiniMax-M2, M2.1): grouped-query attention with an RMSNorm over the whole
Q and the whole K projection and rotary on the first ``rotary_dim`` channels of each head; every
layer a routed MoE of SwiGLU experts, chosen on sigmoid scores plus a correction bias, weighted by
the unbiased scores renormalised (``core/model/decoder/routed_moe.py``), no shared expert. The
published checkpoints are block-scaled FP8 as DeepSeek-V3's (``weight_block_size`` [128, 128]):
dequantized at load through DeepSeek's reader."""

from __future__ import annotations

from typing import Iterable

import torch

from llmkit.core.model.decoder.deepseek import fp8_dequantized
from llmkit.core.model.decoder.routed_moe import RoutedMoE, load_moe_decoder
from llmkit.core.model.decoder.stack import DecoderLM
from llmkit.core.model.decoder.variant_attention import VariantAttention
from llmkit.core.model.layers import _rope_params


class MiniMaxM2ForCausalLM(DecoderLM):
    supports_tp = False  # the Q/K norms average over every head
    supports_cuda_graph = False  # FusedExperts groups tokens by expert with host-side counts
    reads_own_quantization = True  # block-scaled FP8, checked below

    def __init__(self, config: dict, tp=None) -> None:
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act '{config['hidden_act']}' is not supported; supported: silu")
        if 0 in (config.get("attn_type_list") or []):  # (MiniMax-Text-01 / M1's linear-attention layers)
            raise ValueError(
                "attn_type_list names lightning-attention layers (0), which MiniMaxM2ForCausalLM does not run"
            )
        if config.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"scoring_func '{config['scoring_func']}' is not supported; supported: sigmoid")
        quant = config.get("quantization_config") or {}
        if quant.get("quant_method") not in (None, "fp8") or (
            quant.get("quant_method") == "fp8" and len(quant.get("weight_block_size") or ()) != 2
        ):
            raise ValueError(
                f"quantization_config {quant} is not supported for MiniMaxM2ForCausalLM; supported: fp8 with "
                "weight_block_size (MiniMax's own checkpoints), or unquantized"
            )
        super().__init__(config, tp)

    @property
    def rotary_dim(self) -> int:
        c = self.config
        if c.get("rotary_dim"):  # the released checkpoints' field
            return int(c["rotary_dim"])
        factor = _rope_params(c).get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        return int(self.head_dim * float(factor))

    def build_attention(self, layer_id: int):
        return VariantAttention(
            self.config, layer_id, self.head_dim, self.tp, qk_norm="full", rotary_dim=self.rotary_dim
        )

    def build_mlp(self, layer_id: int):
        return RoutedMoE(self.config, self.tp, "sigmoid")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_moe_decoder(self, fp8_dequantized(weights, self.config))
