"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) in the absorbed form over a latent KV cache.

Per token the cache holds the normalised ``kv_lora_rank`` latent and the ``qk_rope_head_dim``
rotated key channels shared by every head. Each head's key up-projection ``W_UK`` is folded into
its query (``q_nope @ W_UK`` lives in latent space) and its value up-projection ``W_UV`` is applied
to the attention output, so the backend runs multi-query attention over the latents, whose first
``kv_lora_rank`` channels are the values (the ``latent_kv`` feature).
"""

from __future__ import annotations

import torch
from torch import nn

from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.model.layers import RMSNorm, RotaryEmbedding
from llmkit.core.model.linear import Linear
from llmkit.core.model.parallel import TPGroup


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    # DeepSeek's rotary pairs are adjacent channels (x0, x1), (x2, x3)...; regrouping them as
    # [evens, odds] makes them the rotate-half layout (and keeps dot products between q and k).
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAttention(nn.Module):
    def __init__(self, config: dict, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer_id = layer_id
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        self.nope, self.rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
        self.v_dim, self.rank = int(config["v_head_dim"]), int(config["kv_lora_rank"])
        qk = self.nope + self.rope
        bias = bool(config.get("attention_bias", False))
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_lora_rank = config.get("q_lora_rank")
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps)
            self.q_b_proj = Linear(self.q_lora_rank, heads * qk, parallel="column", parts=[(heads * qk, heads)], tp=tp)
        else:  # V2-Lite style: one full-rank query projection
            self.q_proj = Linear(hidden, heads * qk, parallel="column", parts=[(heads * qk, heads)], tp=tp)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, eps)
        kv_out = heads * (self.nope + self.v_dim)
        self.kv_b_proj = Linear(self.rank, kv_out, parallel="column", parts=[(kv_out, heads)], tp=tp)
        self.o_proj = Linear(heads * self.v_dim, hidden, bias=bias, parallel="row", in_units=heads, tp=tp)
        self.num_heads = self.o_proj.local_in // self.v_dim
        self.interleaved = bool(config.get("rope_interleave", True))
        # filled by absorb() once the weights are loaded: W_UK [h, nope, rank], W_UV [h, v, rank]
        self.register_buffer("w_uk", torch.empty(self.num_heads, self.nope, self.rank), persistent=False)
        self.register_buffer("w_uv", torch.empty(self.num_heads, self.v_dim, self.rank), persistent=False)

    def absorb(self) -> None:
        w = self.kv_b_proj.format.dense_weight(self.kv_b_proj).detach()
        w = w.view(self.num_heads, self.nope + self.v_dim, self.rank)
        self.w_uk.copy_(w[:, : self.nope])
        self.w_uv.copy_(w[:, self.nope :])

    def forward(self, x: torch.Tensor, rope, ctx: ForwardContext) -> torch.Tensor:
        det = ctx.deterministic
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, det)), det)
        else:
            q = self.q_proj(x, det)
        q = q.view(-1, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x, det).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_pe = k_pe.reshape(-1, 1, self.rope)
        if self.interleaved:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = RotaryEmbedding.rotate(q_pe, rope), RotaryEmbedding.rotate(k_pe, rope)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)
        query = torch.cat([q_latent, q_pe], dim=-1)
        key = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)  # [T, 1, rank + rope]: the cached latent
        o = ctx.attn.forward(query, key, None, self.layer_id, ctx.metadata)  # [T, h, rank]
        o = torch.einsum("thr,hvr->thv", o, self.w_uv)
        return self.o_proj(o.reshape(-1, self.num_heads * self.v_dim), det)
