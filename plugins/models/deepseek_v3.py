"""``DeepseekV3ForCausalLM`` (DeepSeek-V3 / V3.1 / R1, Kimi-K2) and ``DeepseekV2ForCausalLM`` (V2, V2-Lite).

Multi-head latent attention (MLA). Per token and layer the KV cache holds only the compressed
latent: ``kv_lora_rank`` normalised channels plus the ``qk_rope_head_dim`` rotated key channels
shared by every head (576 numbers for V3, against 128 heads x (192 + 128) for decompressed K/V).
Attention runs in the *absorbed* form: each head's key up-projection ``W_UK`` is folded into its
query (``q_nope @ W_UK`` lives in latent space) and its value up-projection ``W_UV`` is applied to
the attention output, so attention itself is multi-query attention over the latent cache, its
values the latent's first ``kv_lora_rank`` channels (the ``latent_kv`` backend feature). Prefill
uses the same form (exact, and it reuses a cached prefix's latents as they are); a decompressed
prefill kernel would be faster for long prompts and is not written yet.

MoE: sigmoid scores with ``e_score_correction_bias``, grouped top-k (``n_group``/``topk_group``),
renormalised weights times ``routed_scaling_factor``, plus ``n_shared_experts`` always-on experts;
the first ``first_k_dense_replace`` layers (and those off ``moe_layer_freq``) are dense.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from llmkit.core.model.attention import LATENT_KV
from llmkit.core.model.layers import RMSNorm, _rope_params, _yarn_mscale
from llmkit.core.model.linear import Linear, VocabEmbedding
from llmkit.core.model.loader.source import materialize
from llmkit.core.model.moe import DOWN, GATE, UP, FusedExperts, grouped_topk
from llmkit.core.model.parallel import TPGroup
from llmkit.core.model.quant.fp8 import dequantize_fp8_blocks
from llmkit.plugins.models.decoder import MLP, PreNormBlock, StackedLM, place_tensor
from llmkit.plugins.models.mla import MLAttention

log = logging.getLogger("llmkit")

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
        sparse = (
            int(config.get("n_routed_experts") or 0) > 0
            and layer_id >= int(config.get("first_k_dense_replace") or 0)
            and layer_id % freq == 0
        )
        self.mlp = MoE(config, tp, version) if sparse else MLP(hidden, config["intermediate_size"], tp)


class DeepseekV3ForCausalLM(StackedLM):
    reads_own_quantization = True  # block-scaled FP8, checked by check_config
    supports_tp = True
    supports_cuda_graph = False  # FusedExperts groups tokens by expert with host-side counts
    attention_features = frozenset({LATENT_KV})
    version = "v3"

    def __init__(self, config: dict, tp: TPGroup | None = None) -> None:
        if self.version == "v2":
            config = {**config, "rope_interleave": True}  # V2 rotates adjacent pairs (as complex numbers)
        check_config(config, self.version, type(self).__name__)
        super().__init__(config, tp)
        tp = self.tp
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        self.embed_tokens = VocabEmbedding(vocab, hidden, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp, self.version) for i in range(self.num_layers))
        self.finish_stack(config.get("rms_norm_eps", 1e-6), int(config["qk_rope_head_dim"]))

    # The cache: one latent "KV head" of kv_lora_rank + qk_rope_head_dim channels, no separate V.
    @property
    def head_dim(self) -> int:
        return int(self.config["kv_lora_rank"]) + int(self.config["qk_rope_head_dim"])

    @property
    def kv_cache_dims(self) -> tuple[int, int]:
        return self.head_dim, 0

    @property
    def attention_v_dim(self) -> int:
        return int(self.config["kv_lora_rank"])

    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def local_kv_heads(self) -> int:
        return 1

    @property
    def attention_scale(self) -> float:
        c = self.config
        scale = (int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"])) ** -0.5
        params = _rope_params(c)
        if params.get("rope_type", params.get("type", "default")) not in (None, "default"):
            if params.get("mscale_all_dim"):  # YaRN's softmax correction, squared (q and k)
                m = _yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
                scale *= m * m
        return scale

    def weights_changed(self) -> None:
        super().weights_changed()
        for layer in self.layers:  # (after --quantization: from the quantized kv_b_proj)
            layer.self_attn.absorb()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = fp8_dequantized(weights, self.config)
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        skipped = 0
        for name, tensor in weights:
            name = name.removeprefix("model.")
            parts = name.split(".")
            if parts[0] == "layers" and int(parts[1]) >= self.num_layers:
                skipped += 1  # the multi-token-prediction layer(s) V3 ships after the last one
                continue
            if self.tie and name == "lm_head.weight":
                continue
            key = place_decoder_tensor(self, modules, params, name, tensor)
            if key is not None:
                loaded.add(key)
        if skipped:
            log.info("DeepSeek-V3: skipped %d tensors of layers past num_hidden_layers (MTP)", skipped)
        missing = []
        for mname, module in modules.items():
            if isinstance(module, FusedExperts):
                missing += [f"{mname}.{m}" for m in module.missing()]
            elif isinstance(module, Linear):
                missing += [
                    f"{mname}.weight" for p in range(len(module._row_map)) if f"{mname}.weight.{p}" not in loaded
                ]
            elif isinstance(module, RMSNorm) and f"{mname}.weight.0" not in loaded:
                missing.append(f"{mname}.weight")
            elif isinstance(module, MoE) and module.e_score_correction_bias is not None:
                if f"{mname}.e_score_correction_bias.0" not in loaded:
                    missing.append(f"{mname}.gate.e_score_correction_bias")
        if missing:
            raise KeyError(f"checkpoint is missing weights: {missing[:5]}")


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2 / V2-Lite: the same MLA (V2-Lite without a query LoRA), softmax routing
    ("greedy", or "group_limited_greedy" over groups ranked by their best expert), no correction
    bias, weights renormalised only when ``norm_topk_prob``."""

    version = "v2"
