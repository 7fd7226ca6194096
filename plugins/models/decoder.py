"""A Llama-style decoder shared by the Llama, Qwen2 and Qwen3 plugins.

The variants differ only in QKV bias (Qwen2) and per-head Q/K RMSNorm (Qwen3). Q/K/V and
gate/up projections are fused into single weights so a step runs two GEMMs per block instead of five.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.causal_lm import CausalLM, ForwardContext
from llmkit.core.model.layers import Linear, RMSNorm, RotaryEmbedding, linear


class Attention(nn.Module):
    def __init__(self, config: dict, layer_id: int, head_dim: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        hidden = config["hidden_size"]
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden)
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext):
        det = ctx.deterministic
        qkv = self.qkv_proj(x, det)
        heads = self.num_heads + self.num_kv_heads
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # Q and K are adjacent in the fused projection: rotate them in one pass.
            qk = RotaryEmbedding.rotate(qkv[:, : self.q_size + self.kv_size].view(-1, heads, self.head_dim), rope)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm(qkv[:, : self.q_size].reshape(-1, self.num_heads, self.head_dim))
            k = self.k_norm(
                qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, self.num_kv_heads, self.head_dim)
            )
            q, k = RotaryEmbedding.rotate(q, rope), RotaryEmbedding.rotate(k, rope)
        o = ctx.attn.forward(q, k, v, self.layer_id, ctx.metadata)
        return self.o_proj(o.reshape(-1, self.q_size), det)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.inter = inter
        self.gate_up_proj = Linear(hidden, 2 * inter)
        self.down_proj = Linear(inter, hidden)

    def forward(self, x, det: bool):
        gate, up = self.gate_up_proj(x, det).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up), det)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_id, head_dim, qkv_bias, qk_norm):
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.self_attn = Attention(config, layer_id, head_dim, qkv_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)
        self.mlp = MLP(config["hidden_size"], config["intermediate_size"])

    def forward(self, x, residual, rope, ctx):
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, ctx.deterministic), residual


class DecoderLM(CausalLM):
    qkv_bias = False
    qk_norm = False

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.embed_tokens.weight.requires_grad_(False)
        qkv_bias = bool(config.get("attention_bias", self.qkv_bias))
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.head_dim, qkv_bias, self.qk_norm) for i in range(self.num_layers)
        )
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6))
        self.tie = bool(config.get("tie_word_embeddings", False))
        self.lm_head = None if self.tie else Linear(hidden, vocab)
        self.rotary = RotaryEmbedding(self.head_dim, int(config.get("max_position_embeddings", 4096)), config)

    def forward(self, input_ids, positions, ctx):
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.table(positions, x.dtype)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden, deterministic=False):
        if not self.tie:
            return self.lm_head(hidden, deterministic).float()
        w = self.embed_tokens.weight
        return linear(hidden.to(w.dtype), w, None, deterministic, self._tied_q).float()

    _tied_q = None

    def quantize(self, method: str) -> None:
        super().quantize(method)
        if self.tie:  # the tied head is the embedding matrix: give it its own int8 copy
            from llmkit.core.model.layers import quantize_int8

            self._tied_q = quantize_int8(self.embed_tokens.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if self.tie and name == "lm_head.weight":
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, shard = fused[parts[-2]]
                pname = ".".join(parts[:-2] + [target, parts[-1]])
                param = params[pname]
                lo, hi = self._shard_range(target, shard)
                param.data[lo:hi].copy_(tensor)
                loaded.add(f"{pname}#{shard}")
                continue
            if name not in params:
                raise KeyError(f"unexpected weight '{name}' for {type(self).__name__}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = [n for n in params if n not in loaded and not any(k.startswith(n + "#") for k in loaded)]
        if missing:
            raise KeyError(f"checkpoint is missing weights: {missing[:5]}")

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        if target == "gate_up_proj":
            inter = self.config["intermediate_size"]
            return shard * inter, (shard + 1) * inter
        q = self.config["num_attention_heads"] * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
