"""The DeepSeek decoder block (V2, V3/R1, Kimi-K2): MLA attention and the MoE with shared experts.

The ``DeepseekV3ForCausalLM`` model plugin stacks these blocks; DeepSeek-V3's multi-token-prediction
draft (``--speculative-algorithm MTP``) runs one more of them, read from the same checkpoint: both
share the block, the config checks and the loading of its tensors (block-scaled FP8 dequantized).

MoE: sigmoid scores with ``e_score_correction_bias``, grouped top-k (``n_group``/``topk_group``),
renormalised weights times ``routed_scaling_factor``, plus ``n_shared_experts`` always-on experts;
the first ``first_k_dense_replace`` layers (and those off ``moe_layer_freq``) are dense.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from llmkit.core.model.decoder.mla import MLAttention
from llmkit.core.model.decoder.stack import MLP, PreNormBlock
from llmkit.core.model.decoder.weight_placement import place_tensor
from llmkit.core.model.layers import RMSNorm
from llmkit.core.model.linear import Linear
from llmkit.core.model.loader.source import materialize
from llmkit.core.model.moe import DOWN, GATE, UP, FusedExperts, grouped_topk
from llmkit.core.model.parallel import TPGroup
from llmkit.core.model.quant.fp8 import dequantize_fp8_blocks

REQUIRED = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_PROJ = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}
_FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def place_decoder_tensor(owner: nn.Module, modules: dict, params: dict, name: str, tensor) -> str | None:
    """One tensor of DeepSeek decoder layers (``name`` relative to ``owner``) into its place: a
    routed expert's into its :class:`FusedExperts`, anything else as :func:`place_tensor` places it
    (the router's correction bias is a buffer, named without ``.gate``). Returns the placed
    ``module.leaf.part`` for the missing-weights check (None: an expert's). KeyError: no place."""
    name = name.replace(".gate.e_score_correction_bias", ".e_score_correction_bias")
    parts = name.split(".")
    if "experts" in parts and "shared_experts" not in parts:
        i = parts.index("experts")
        experts = modules.get(".".join(parts[: i + 1]))
        if not isinstance(experts, FusedExperts) or len(parts) != i + 4 or parts[i + 2] not in _PROJ:
            raise KeyError(f"unexpected weight '{name}' for {type(owner).__name__}")
        experts.load(tensor, int(parts[i + 1]), _PROJ[parts[i + 2]])
        return None
    return ".".join(map(str, place_tensor(owner, modules, params, name, tensor, _FUSED)))


def fp8_dequantized(weights: Iterable[tuple[str, torch.Tensor]], config: dict) -> Iterable[tuple[str, torch.Tensor]]:
    """``weights`` with DeepSeek's block-scaled FP8 ones dequantized where ``config`` says the
    checkpoint is FP8 (:func:`check_config` has checked its block size). Read whole: FP8 weights
    are dequantized before a tensor-parallel rank slices them."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return weights
    return dequantize_fp8_blocks(((n, materialize(t)) for n, t in weights), tuple(quant["weight_block_size"]))


# per version: the routing methods and the scoring it runs (the first method is the default)
VARIANTS = {"v3": (("noaux_tc",), "sigmoid"), "v2": (("greedy", "group_limited_greedy"), "softmax")}


def check_config(config: dict, version: str, cls: str) -> None:
    """Refuse, naming the field, the variants this implementation does not run."""
    for field in REQUIRED:
        if not config.get(field):
            raise ValueError(f"{field} is missing from config.json: {cls} needs MLA ({', '.join(REQUIRED)})")
    methods, scoring = VARIANTS[version]
    method = config.get("topk_method", methods[0])
    if method not in methods:
        raise ValueError(f"topk_method '{method}' is not supported for {cls}; supported: {', '.join(methods)}")
    if config.get("scoring_func", scoring) != scoring:
        raise ValueError(f"scoring_func '{config['scoring_func']}' is not supported for {cls}; supported: {scoring}")
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") not in (None, "fp8"):
        raise ValueError(
            f"quantization_config.quant_method '{quant['quant_method']}' is not supported for {cls}; "
            "supported: fp8 with weight_block_size (DeepSeek's own checkpoints), or unquantized"
        )
    if quant.get("quant_method") == "fp8" and len(quant.get("weight_block_size") or ()) != 2:
        raise ValueError(
            "quantization_config.weight_block_size is missing: FP8 checkpoints are supported with "
            "block scales ([128, 128] in DeepSeek's)"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act '{config['hidden_act']}' is not supported; supported: silu")


class MoE(nn.Module):
    def __init__(self, config: dict, tp: TPGroup, version: str) -> None:
        super().__init__()
        methods, self.scoring = VARIANTS[version]
        # V2's "greedy" ignores the groups; V3 always ranks them
        self.grouped = config.get("topk_method", methods[0]) != "greedy"
        hidden, e = config["hidden_size"], int(config["n_routed_experts"])
        self.top_k = int(config["num_experts_per_tok"])
        self.n_group, self.topk_group = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
        if e % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) does not divide n_routed_experts ({e})")
        if self.top_k > e or self.topk_group > self.n_group:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) or topk_group ({self.topk_group}) is out of range")
        self.renormalize = bool(config.get("norm_topk_prob", version == "v3"))
        self.scale = float(config.get("routed_scaling_factor", 1.0))
        inter = int(config["moe_intermediate_size"])
        self.gate = Linear(hidden, e)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False) if version == "v3" else None
        )
        self.experts = FusedExperts(e, hidden, inter, tp=tp)
        shared = int(config.get("n_shared_experts") or 0)
        self.shared_experts = MLP(hidden, inter * shared, tp) if shared else None

    def forward(self, x: torch.Tensor, det: bool) -> torch.Tensor:
        w, ids = grouped_topk(
            self.gate(x, det),
            self.top_k,
            n_group=self.n_group if self.grouped else 1,
            topk_group=self.topk_group if self.grouped else 1,
            renormalize=self.renormalize,
            correction_bias=self.e_score_correction_bias,
            scale=self.scale,
            scoring=self.scoring,
        )
        y = self.experts(x, w, ids, det)
        return y if self.shared_experts is None else y + self.shared_experts(x, det)


class DecoderLayer(PreNormBlock):
    def __init__(self, config: dict, layer_id: int, tp: TPGroup, version: str) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        hidden = config["hidden_size"]
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = MLAttention(config, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        freq = int(config.get("moe_layer_freq") or 1)
        kinds = config.get("mlp_layer_types")  # GLM-4.7-Flash names each layer's kind
        sparse = (
            int(config.get("n_routed_experts") or 0) > 0
            and layer_id >= int(config.get("first_k_dense_replace") or 0)
            and layer_id % freq == 0
            if kinds is None
            else kinds[layer_id] == "sparse"
        )
        self.mlp = MoE(config, tp, version) if sparse else MLP(hidden, config["intermediate_size"], tp)
