"""LFM2 (``Lfm2ForCausalLM``, Liquid AI): a hybrid of gated short-convolution blocks
(``core/model/hybrid/short_conv.py``, their state the convolution's last inputs) and grouped-query
attention blocks with per-head Q/K RMSNorms, in the order ``layer_types`` (or ``full_attn_idxs``)
gives. Every block is pre-norm with a SwiGLU feed-forward; plain RMSNorms (``weight * norm(x)``)
throughout, the final one named ``embedding_norm``. Only attention layers have K/V in the paged
pool; the convolutions keep their state in the state pool (``core/kvcache/state_pool.py``)."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from llmkit.core.model.decoder.hybrid_stack import HybridBlock
from llmkit.core.model.decoder.stack import MLP, Attention, StackedLM
from llmkit.core.model.decoder.weight_placement import FUSED_PROJECTIONS, expected_weights, place_tensor
from llmkit.core.model.hybrid.short_conv import ShortConv
from llmkit.core.model.linear import VocabEmbedding
from llmkit.core.model.loader.source import materialize

FULL, CONV = "full_attention", "conv"


def lfm2_config(config: dict) -> dict:
    """``config`` as transformers' ``Lfm2Config`` reads it, in the keys the shared layers read:
    the layer kinds (``layer_types``, else attention at ``full_attn_idxs``, else everywhere), the
    feed-forward width after its adjustment, ``norm_eps`` as ``rms_norm_eps``, the checkpoint's
    own aliases (``block_ff_dim``, ``tie_embedding``) and LFM2's default rotary base."""
    c = dict(config)
    n = int(c["num_hidden_layers"])
    types = c.get("layer_types")
    if types is None:
        full = c.get("full_attn_idxs")
        full = set(range(n) if full is None else full)
        types = [FULL if i in full else CONV for i in range(n)]
    if len(types) != n or set(types) - {FULL, CONV}:
        raise ValueError(f"layer_types must name {n} layers, each '{FULL}' or '{CONV}': {types}")
    c["layer_types"] = list(types)
    c["intermediate_size"] = feed_forward_width(c)
    c["block_auto_adjust_ff_dim"] = False  # (adjusted: reading this config again keeps the width)
    c.pop("block_ff_dim", None)
    c["rms_norm_eps"] = float(c.get("norm_eps", 1e-5))
    c["tie_word_embeddings"] = bool(c.get("tie_embedding", c.get("tie_word_embeddings", True)))
    if "rope_theta" not in (c.get("rope_parameters") or {}) and "rope_theta" not in c:
        c["rope_theta"] = 1000000.0
    return c


def feed_forward_width(c: dict) -> int:
    """transformers' Lfm2MLP width: two thirds of ``block_ff_dim``, then (only with a multiplier)
    scaled and rounded up to ``block_multiple_of``."""
    width = int(c["block_ff_dim"] if "block_ff_dim" in c else c.get("intermediate_size", 12288))
    if c.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = c.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            of = int(c.get("block_multiple_of", 256))
            width = of * ((int(multiplier * width) + of - 1) // of)
    return width


# the checkpoint's names inside ``layers.N.``: for every layer, then per layer kind
_COMMON = {
    "operator_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_BY_KIND = {
    FULL: {
        "self_attn.q_proj.weight": "mixer.q_proj.weight",
        "self_attn.k_proj.weight": "mixer.k_proj.weight",
        "self_attn.v_proj.weight": "mixer.v_proj.weight",
        "self_attn.out_proj.weight": "mixer.o_proj.weight",
        "self_attn.q_layernorm.weight": "mixer.q_norm.weight",
        "self_attn.k_layernorm.weight": "mixer.k_norm.weight",
    },
    CONV: {
        "conv.in_proj.weight": "mixer.in_proj.weight",
        "conv.in_proj.bias": "mixer.in_proj.bias",
        "conv.out_proj.weight": "mixer.out_proj.weight",
        "conv.out_proj.bias": "mixer.out_proj.bias",
        "conv.conv.weight": "mixer.conv_weight",
        "conv.conv.bias": "mixer.conv_bias",
    },
}
_FUSED = FUSED_PROJECTIONS


class Lfm2ForCausalLM(StackedLM):
    supports_feature_capture = False

    def __init__(self, config: dict, tp=None) -> None:
        config = lfm2_config(config)
        super().__init__(config, tp)
        self.types = config["layer_types"]
        hidden = config["hidden_size"]
        self.embed_tokens = VocabEmbedding(config["vocab_size"], hidden, self.tp)
        kernel, bias = int(config.get("conv_L_cache", 3)), bool(config.get("conv_bias", False))
        blocks, kv_id, state_id = [], 0, 0
        for kind in self.types:
            if kind == FULL:  # kv_id / state_id: its index among the layers of its kind
                mixer = Attention(config, kv_id, self.head_dim, False, True, self.tp)
                kv_id += 1
            else:
                mixer = ShortConv(hidden, kernel, bias, state_id)
                state_id += 1
            blocks.append(HybridBlock(config, mixer, MLP(hidden, config["intermediate_size"], self.tp)))
        self.layers = nn.ModuleList(blocks)
        self.finish_stack(config["rms_norm_eps"], self.head_dim)

    @property
    def num_kv_layers(self) -> int:
        return self.types.count(FULL)

    @property
    def local_kv_heads(self) -> int:
        return int(self.config["num_key_value_heads"])

    @property
    def local_heads(self) -> int:
        return int(self.config["num_attention_heads"])

    def state_specs(self, dtype: torch.dtype):
        return [layer.mixer.state_spec(dtype) for layer in self.layers if isinstance(layer.mixer, ShortConv)]

    # -- weights -----------------------------------------------------------------------------
    def _our_name(self, name: str) -> str:
        """A checkpoint name (``model.`` removed) as ours; a layer's weight of the other layer
        kind than its ``layer_types`` entry is an error naming the layer."""
        if name == "embedding_norm.weight":
            return "norm.weight"
        if not name.startswith("layers."):
            return name
        _, idx, rest = name.split(".", 2)
        if rest in _COMMON:
            return f"layers.{idx}.{_COMMON[rest]}"
        if int(idx) >= len(self.types):
            raise ValueError(f"the checkpoint has weights of layer {idx}, the config {len(self.types)} layers")
        kind = self.types[int(idx)]
        if rest in _BY_KIND[kind]:
            return f"layers.{idx}.{_BY_KIND[kind][rest]}"
        other = CONV if kind == FULL else FULL
        if rest in _BY_KIND[other]:
            raise ValueError(
                f"layer {idx} is '{kind}' in the config's layer table, but the checkpoint has the "
                f"'{other}' weight 'model.{name}': the config and the weights disagree"
            )
        return name  # (unknown: place_tensor names it)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._native_plan = False
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded = set()
        for raw, tensor in weights:
            name = raw.removeprefix("model.")
            if self.tie and name == "lm_head.weight":
                continue
            name = self._our_name(name)
            if name.endswith("mixer.conv_weight"):  # [C, 1, L] (a GGUF's squeezed: [C, L])
                t = materialize(tensor)
                tensor = t.reshape(t.shape[0], t.shape[-1])
            owner, leaf, part = place_tensor(self, modules, params, name, tensor, _FUSED)
            loaded.add((f"{owner}.{leaf}", part))
        missing = sorted({p for p, part in expected_weights(self) if (p, part) not in loaded})
        if missing:
            raise KeyError(f"checkpoint is missing weights: {missing[:5]}")
