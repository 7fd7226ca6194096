"""The decoder layer of an EAGLE-style draft head: Llama attention over the head's own K/V cache
(:class:`~llmkit.plugins.speculative.draft_cache.DraftKV`), then the gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.layers import RMSNorm, RotaryEmbedding
from llmkit.plugins.speculative.draft_cache import DraftAttention, DraftKV


class HeadLayer(nn.Module):
    """``in_features``: the attention's input width (EAGLE: the hidden size; EAGLE-3: twice it)."""

    def __init__(self, config: dict, in_features: int) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config["intermediate_size"])
        bias = bool(config.get("attention_bias", False))
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(in_features, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, float(config.get("rms_norm_eps", 1e-6)))
        self.rotary = RotaryEmbedding(head_dim, int(config.get("max_position_embeddings", 4096)), config)
        self.attention = DraftAttention(head_dim**-0.5)

    def forward(self, x, residual, positions, kv: DraftKV) -> torch.Tensor:
        """The layer's output (the residual stream after it) for rows ``x`` at ``positions``, their
        K/V appended to ``kv``; ``residual``: the stream the attention's output is added to."""
        t = x.shape[0]
        table = self.rotary.table(positions, x.dtype)
        q = RotaryEmbedding.rotate(self.q_proj(x).view(t, self.heads, self.head_dim), table)
        k = RotaryEmbedding.rotate(self.k_proj(x).view(t, self.kv_heads, self.head_dim), table)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        attn = self.o_proj(self.attention.forward(q, k, v, 0, kv).reshape(t, -1))
        h, residual = self.post_attention_layernorm(attn, residual)
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)) + residual


# the layer's tensors in a Llama checkpoint (``{prefix}self_attn.q_proj.weight``, ...) -> its parameters
def layer_names(prefix: str, ours: str) -> dict[str, str]:
    attn = {
        f"{prefix}self_attn.{p}.{w}": f"{ours}{p}.{w}"
        for p in ("q_proj", "k_proj", "v_proj")
        for w in ("weight", "bias")
    }
    mlp = {f"{prefix}mlp.{p}.weight": f"{ours}{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    return {
        **attn,
        f"{prefix}self_attn.o_proj.weight": f"{ours}o_proj.weight",
        **mlp,
        f"{prefix}post_attention_layernorm.weight": f"{ours}post_attention_layernorm.weight",
    }
