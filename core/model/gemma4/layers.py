"""Gemma 4's decoder layer: attention (per-layer head size, K = V on full layers, K/V read from an
earlier layer), the gated GELU MLP beside an optional MoE block, the per-layer input, and the
layer's scalar, in transformers' order (``Gemma4TextDecoderLayer``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.model.layers import RotaryEmbedding
from llmkit.core.model.linear import Linear
from llmkit.core.model.moe import FusedExperts
from llmkit.core.model.parallel import TPGroup


class Gemma4RMSNorm(nn.Module):
    """``x * (mean(x^2) + eps) ** -0.5 * weight`` in fp32 (the weight as stored, not ``1 + w`` as
    Gemma 3's); ``with_scale=False``: no weight (the value and router norms)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False) if with_scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.to(x.dtype)


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class Attention(nn.Module):
    """``kv_source`` != ``layer_id``: a K/V-sharing layer, with queries only; it attends over the
    source layer's K/V (handed over by the model in ``shared``) in the source's pool layer."""

    def __init__(self, c: dict, layer_id: int, heads_dim: tuple[int, int], kv_layer: int, kv_source: int, tp):
        super().__init__()
        self.layer_id, self.kv_layer, self.kv_source = layer_id, kv_layer, kv_source
        self.kind = c["layer_types"][layer_id]
        self.sliding_window = int(c["sliding_window"]) if self.kind == "sliding_attention" else None
        heads, hidden, eps = int(c["num_attention_heads"]), int(c["hidden_size"]), float(c["rms_norm_eps"])
        kv_heads, d = heads_dim
        self.head_dim, self.shares = d, kv_source != layer_id
        self.k_eq_v = bool(c["attention_k_eq_v"]) and self.kind == "full_attention"
        bias = bool(c["attention_bias"])
        q, kv = heads * d, kv_heads * d
        parts = [(q, heads)]
        if not self.shares:
            parts += [(kv, kv_heads)] * (1 if self.k_eq_v else 2)
        self.qkv_proj = Linear(hidden, sum(p[0] for p in parts), bias=bias, parallel="column", parts=parts, tp=tp)
        self.o_proj = Linear(q, hidden, bias=bias, parallel="row", in_units=heads, tp=tp)
        self.num_heads = self.o_proj.local_in // d
        self.q_size = self.num_heads * d
        self.num_kv_heads = 0 if self.shares else (self.qkv_proj.local_out - self.q_size) // (len(parts) - 1) // d
        self.q_norm = Gemma4RMSNorm(d, eps)
        if not self.shares:
            self.k_norm = Gemma4RMSNorm(d, eps)
            self.v_norm = Gemma4RMSNorm(d, eps, with_scale=False)

    def forward(self, x, rope, ctx: ForwardContext, shared: dict):
        det = ctx.deterministic
        qkv = self.qkv_proj(x, det)
        d = self.head_dim
        q = RotaryEmbedding.rotate(self.q_norm(qkv[:, : self.q_size].reshape(-1, self.num_heads, d)), rope)
        if self.shares:
            k, v = shared[self.kv_source]
        else:
            n = self.num_kv_heads * d
            k = qkv[:, self.q_size : self.q_size + n].reshape(-1, self.num_kv_heads, d)
            v = self.v_norm(k if self.k_eq_v else qkv[:, self.q_size + n :].reshape(-1, self.num_kv_heads, d))
            k = RotaryEmbedding.rotate(self.k_norm(k), rope)
            shared[self.layer_id] = (k, v)
        # (a sharing layer writes its source's K/V again, to the same slots: the same bytes, and
        # every backend's forward stays as it is)
        kw = {"sliding_window": self.sliding_window} if self.sliding_window else {}
        # (a window layer's own pages, where they are kept apart: core/kvcache/window_pages.py)
        o = ctx.attn.forward(q, k, v, self.kv_layer, ctx.kv_metadata(self.kv_layer), **kw)
        return self.o_proj(o.reshape(-1, self.q_size), det)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, parallel="column", parts=[(inter, inter)] * 2, tp=tp)
        self.down_proj = Linear(inter, hidden, parallel="row", tp=tp)

    def forward(self, x, det: bool):
        return self.down_proj(gelu_and_mul(self.gate_up_proj(x, det)), det)


class Router(nn.Module):
    """Softmax over the experts of the unit-normed input times ``scale / sqrt(hidden)``, top-k
    renormalised, each weight times its expert's ``per_expert_scale``."""

    def __init__(self, c: dict):
        super().__init__()
        hidden, e = int(c["hidden_size"]), int(c["num_experts"])
        self.norm = Gemma4RMSNorm(hidden, float(c["rms_norm_eps"]), with_scale=False)
        self.proj = Linear(hidden, e, parallel="replicated")
        self.scale = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(e), requires_grad=False)
        self.top_k, self.root = int(c["top_k_experts"]), hidden**-0.5

    def forward(self, x, det: bool):
        h = self.norm(x) * self.scale * self.root
        probs = torch.softmax(self.proj(h, det), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class DecoderLayer(nn.Module):
    def __init__(self, c: dict, layer_id: int, heads_dim, kv_layer: int, kv_source: int, tp: TPGroup):
        super().__init__()
        hidden, eps = int(c["hidden_size"]), float(c["rms_norm_eps"])
        self.self_attn = Attention(c, layer_id, heads_dim, kv_layer, kv_source, tp)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm"):
            setattr(self, name, Gemma4RMSNorm(hidden, eps))
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        wide = 2 if c["use_double_wide_mlp"] and self.self_attn.shares else 1
        self.mlp = MLP(hidden, int(c["intermediate_size"]) * wide, tp)
        self.moe = bool(c["enable_moe_block"])
        if self.moe:
            self.router = Router(c)
            self.experts = FusedExperts(
                int(c["num_experts"]), hidden, int(c["moe_intermediate_size"]), tp=tp, activation=gelu_and_mul
            )
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
        self.ple = int(c.get("hidden_size_per_layer_input") or 0)
        if self.ple:
            self.per_layer_input_gate = Linear(hidden, self.ple, parallel="replicated")
            self.per_layer_projection = Linear(self.ple, hidden, parallel="replicated")
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x, rope, ctx: ForwardContext, shared: dict, per_layer: torch.Tensor | None):
        det = ctx.deterministic
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, ctx, shared))
        h = self.mlp(self.pre_feedforward_layernorm(x), det)
        if self.moe:  # the experts read the layer's input to the MLP block, beside the dense MLP
            weights, ids = self.router(x, det)
            routed = self.experts(self.pre_feedforward_layernorm_2(x), weights.to(x.dtype), ids, det)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.ple:
            g = F.gelu(self.per_layer_input_gate(x, det), approximate="tanh") * per_layer
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g, det))
        return x * self.layer_scalar
