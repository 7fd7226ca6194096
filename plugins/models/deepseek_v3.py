"""``DeepseekV3ForCausalLM`` (DeepSeek-V3 / V3.1 / R1, Kimi-K2), ``DeepseekV2ForCausalLM`` (V2, V2-Lite)
and ``Glm4MoeLiteForCausalLM`` (GLM-4.7-Flash: V3's attention and routing, GLM's layer table).

Multi-head latent attention (MLA). Per token and layer the KV cache holds only the compressed
latent: ``kv_lora_rank`` normalised channels plus the ``qk_rope_head_dim`` rotated key channels
shared by every head (576 numbers for V3, against 128 heads x (192 + 128) for decompressed K/V).
Attention runs in the *absorbed* form: each head's key up-projection ``W_UK`` is folded into its
query (``q_nope @ W_UK`` lives in latent space) and its value up-projection ``W_UV`` is applied to
the attention output, so attention itself is multi-query attention over the latent cache, its
values the latent's first ``kv_lora_rank`` channels (the ``latent_kv`` backend feature). Prefill
uses the same form (exact, and it reuses a cached prefix's latents as they are); a decompressed
prefill kernel would be faster for long prompts and is not written yet.

The decoder block (MLA and the MoE) is :mod:`llmkit.core.model.decoder.deepseek`'s, shared with
the MTP draft layer (``--speculative-algorithm MTP``).
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from llmkit.core.model.attention import LATENT_KV
from llmkit.core.model.decoder.deepseek import DecoderLayer, MoE, check_config, fp8_dequantized, place_decoder_tensor
from llmkit.core.model.decoder.stack import StackedLM
from llmkit.core.model.layers import RMSNorm, _rope_params, _yarn_mscale
from llmkit.core.model.linear import Linear, VocabEmbedding
from llmkit.core.model.moe import FusedExperts
from llmkit.core.model.parallel import TPGroup

log = logging.getLogger("llmkit")


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


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's latent attention (value heads wider than the no-rope query
    part: 256 against 192) and its sigmoid group routing with a correction bias, each layer's MLP
    kind named by ``mlp_layer_types`` (dense first, then sparse)."""

    def __init__(self, config: dict, tp: TPGroup | None = None) -> None:
        n = int(config["num_hidden_layers"])
        kinds = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)  # (transformers' default)
        if len(kinds) != n or set(kinds) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must name 'dense' or 'sparse' for each of the {n} layers")
        super().__init__({**config, "mlp_layer_types": list(kinds)}, tp)
