"""``GraniteForCausalLM`` (Granite 3.x, Granite 4.0 dense): Llama's block scaled by four multipliers:
the embeddings by ``embedding_multiplier``, each branch by ``residual_multiplier`` before its
residual add, the attention softmax by ``attention_multiplier`` (instead of ``1/sqrt(head_dim)``),
the logits divided by ``logits_scaling``."""

from __future__ import annotations

from llmkit.core.model.decoder.stack import DecoderLayer, DecoderLM


class GraniteLayer(DecoderLayer):
    def __init__(self, config: dict, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.residual_multiplier = float(config.get("residual_multiplier", 1.0))

    def forward(self, x, residual, rope, ctx):
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, ctx) * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, ctx.deterministic) * self.residual_multiplier, residual


class GraniteForCausalLM(DecoderLM):
    qkv_bias = False
    qk_norm = False

    def __init__(self, config: dict, tp=None) -> None:
        if config.get("mlp_bias"):
            raise ValueError("mlp_bias is not supported for GraniteForCausalLM")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act '{config['hidden_act']}' is not supported; supported: silu")
        super().__init__(config, tp)

    def build_layer(self, layer_id: int, qkv_bias: bool):
        mlp = self.build_mlp(layer_id)
        return GraniteLayer(self.config, layer_id, self.head_dim, qkv_bias, self.qk_norm, self.tp, mlp)

    @property
    def attention_scale(self) -> float:
        return float(self.config.get("attention_multiplier", self.head_dim**-0.5))

    def embed(self, input_ids, ctx):
        return self.embed_tokens(input_ids) * float(self.config.get("embedding_multiplier", 1.0))

    def compute_logits(self, hidden, deterministic=False):
        return self.lm_head(hidden, deterministic) / float(self.config.get("logits_scaling", 1.0))
