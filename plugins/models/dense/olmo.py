"""``Olmo2ForCausalLM`` (OLMo 2) and ``Olmo3ForCausalLM`` (OLMo 3): norms after each branch instead of
before (``x + norm(attn(x))``, then ``x + norm(mlp(x))``), an RMSNorm over the whole Q and the
whole K projection before rotary; OLMo 3 adds sliding-window layers (``layer_types``) with a rope
of their own (``rope_parameters`` keyed by layer type: long-context checkpoints scale only the
full layers' rope)."""

from __future__ import annotations

from torch import nn

from llmkit.core.model.attention import SLIDING_WINDOW
from llmkit.core.model.decoder.stack import MLP, DecoderLM
from llmkit.core.model.decoder.variant_attention import VariantAttention, window_of
from llmkit.core.model.layers import RMSNorm, RotaryEmbedding

LAYER_TYPES = ("full_attention", "sliding_attention")


class PostNormLayer(nn.Module):
    def __init__(self, config: dict, layer_id: int, head_dim: int, tp, kind: str) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        window = window_of(config, kind == "sliding_attention")
        self.kind = kind
        self.self_attn = VariantAttention(
            config,
            layer_id,
            head_dim,
            tp,
            qkv_bias=bool(config.get("attention_bias", False)),
            qk_norm="full",
            sliding_window=window,
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, config["intermediate_size"], tp)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(self, x, residual, rope, ctx):
        # the stack's convention: (branch output, residual); the next layer (or the final norm) adds
        if residual is not None:
            x = x + residual
        x = x + self.post_attention_layernorm(self.self_attn(x, rope, ctx))
        return self.post_feedforward_layernorm(self.mlp(x, ctx.deterministic)), x


def layer_types(config: dict) -> list[str]:
    types = list(config.get("layer_types") or ["full_attention"] * int(config["num_hidden_layers"]))
    for i, kind in enumerate(types):
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] '{kind}' is not one of {', '.join(LAYER_TYPES)}")
    return types


class Olmo2ForCausalLM(DecoderLM):
    supports_tp = False  # the Q/K norms average over every head (VariantAttention's "full")
    supports_feature_capture = False  # its forward runs the layers with a rope per layer type
    attention_features = frozenset({SLIDING_WINDOW})

    def __init__(self, config: dict, tp=None) -> None:
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act '{config['hidden_act']}' is not supported; supported: silu")
        super().__init__(config, tp)
        mpe = int(config.get("max_position_embeddings", 4096))
        self.ropes = nn.ModuleDict(
            {kind: RotaryEmbedding(self.head_dim, mpe, cfg) for kind, cfg in self.rope_configs().items()}
        )
        self.rotary = self.ropes["full_attention"]  # (what a caller of rope_table gets: the full layers')

    def rope_configs(self) -> dict[str, dict]:
        """Per layer type, the config its :class:`RotaryEmbedding` reads."""
        c = self.config
        params = c.get("rope_parameters") or {}
        if not any(kind in params for kind in LAYER_TYPES):
            return {kind: c for kind in LAYER_TYPES}
        mpe = c.get("max_position_embeddings", 4096)
        return {kind: {"rope_parameters": params[kind], "max_position_embeddings": mpe} for kind in LAYER_TYPES}

    def rotary_embedding(self, rotary_dim: int):
        return None  # (self.ropes, built below once the stack is)

    def build_layer(self, layer_id: int, qkv_bias: bool) -> nn.Module:
        return PostNormLayer(self.config, layer_id, self.head_dim, self.tp, layer_types(self.config)[layer_id])

    def forward(self, input_ids, positions, ctx):
        x, residual = self.embed(input_ids, ctx), None
        tables = {kind: rope.table(positions, x.dtype) for kind, rope in self.ropes.items()}
        for layer in self.layers:
            x, residual = layer(x, residual, tables[layer.kind], ctx)
        x, _ = self.norm(x, residual)
        return x


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    pass
