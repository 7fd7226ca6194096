"""Grouped-query attention with no positional embedding (NoPE): the hybrids whose Mamba2 layers
carry token order (Nemotron-H, Granite 4.0-H) leave their attention layers unrotated."""

from __future__ import annotations

from llmkit.core.model.hot_module import HotModule
from llmkit.core.model.linear import Linear


class NoPEAttention(HotModule):
    """Q/K/V in one product, attention through the backend, the output projection; ``kv_id``: its
    index among the model's attention layers (its K/V in the pool). The softmax scale is the
    model's (``CausalLM.attention_scale``)."""

    def __init__(self, config: dict, kv_id: int, head_dim: int):
        super().__init__()
        self.kv_id = kv_id
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        hidden, bias = config["hidden_size"], bool(config.get("attention_bias", False))
        q, kv = heads * head_dim, kv_heads * head_dim
        self.qkv_proj = Linear(hidden, q + 2 * kv, bias=bias, parts=[(q, heads), (kv, kv_heads), (kv, kv_heads)])
        self.o_proj = Linear(q, hidden, bias=bias)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim

    def forward(self, x, rope, ctx):
        n, h, d, hkv = x.shape[0], self.num_heads, self.head_dim, self.num_kv_heads
        q, k, v = self.qkv_proj(x, ctx.deterministic).split([h * d, hkv * d, hkv * d], dim=-1)
        o = ctx.attn.forward(q.reshape(n, h, d), k.reshape(n, hkv, d), v.reshape(n, hkv, d), self.kv_id, ctx.metadata)
        return self.o_proj(o.reshape(n, h * d), ctx.deterministic)
