"""Llama attention with what the newer dense and MoE families vary (Mistral, Phi-3, SmolLM3, OLMo 2/3,
GLM-4.5, MiniMax-M2): rotary on the first ``rotary_dim`` channels of each head (partial rotary),
no rotary at all (NoPE layers), a sliding window, and Q/K RMSNorm over the whole projection
(``qk_norm="full"``) instead of per head.

A layer that needs none of these keeps :class:`~llmkit.core.model.decoder.stack.Attention` itself,
so it stays on the fused decode GEMVs and the C stack; these run through the backend's ``forward``.
"""

from __future__ import annotations

import torch

from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.model.decoder.stack import Attention
from llmkit.core.model.layers import RMSNorm, RotaryEmbedding
from llmkit.core.model.parallel import TPGroup

QK_NORMS = (None, "head", "full")


class VariantAttention(Attention):
    """``rotary_dim``: channels of each head rotated (None: all; 0: none, a NoPE layer);
    ``sliding_window``: the tokens a query sees (None: all); ``qk_norm``: None, ``"head"``
    (Qwen3's per-head norms) or ``"full"`` (one norm over the whole Q and K projections: on one
    rank only, its mean runs over every head); ``query_scale``: a function of the rows' positions
    giving a factor the rotated queries are multiplied by (Ministral 3; the model puts its
    positions in ``ctx.positions``)."""

    def __init__(
        self,
        config: dict,
        layer_id: int,
        head_dim: int,
        tp: TPGroup,
        *,
        qkv_bias: bool = False,
        qk_norm: str | None = None,
        rotary_dim: int | None = None,
        sliding_window: int | None = None,
        query_scale=None,
    ):
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm '{qk_norm}' is not one of {QK_NORMS}")
        super().__init__(config, layer_id, head_dim, qkv_bias, qk_norm == "head", tp)
        if qk_norm == "full":
            if self.qkv_proj.tp.size > 1:
                raise ValueError("a Q/K norm over the whole projection runs on one rank (no --tp-size)")
            eps = config.get("rms_norm_eps", 1e-6)
            self.q_norm, self.k_norm = RMSNorm(self.q_size, eps), RMSNorm(self.kv_size, eps)
        self.full_norm = qk_norm == "full"
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.sliding_window = sliding_window
        self.query_scale = query_scale  # positions -> a factor per row (reads ``ctx.positions``)

    def attend(self, qkv, rope, ctx: ForwardContext, bias=None) -> torch.Tensor:
        if bias is not None:
            qkv = qkv + bias
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.full_norm:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        d = self.head_dim
        q, k = q.reshape(-1, self.num_heads, d), k.reshape(-1, self.num_kv_heads, d)
        v = v.reshape(-1, self.num_kv_heads, d)
        if self.q_norm is not None and not self.full_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_dim:
            q, k = self._rotate(q, rope), self._rotate(k, rope)
        if self.query_scale is not None:
            q = q * self.query_scale(ctx.positions).to(q.dtype)[:, None, None]
        extra = {} if self.sliding_window is None else {"sliding_window": self.sliding_window}
        # (a window layer reads its own pages where they are kept apart: core/kvcache/window_pages.py)
        o = ctx.attn.forward(q, k, v, self.layer_id, ctx.kv_metadata(self.layer_id), **extra)
        return o.reshape(-1, self.q_size)

    def _rotate(self, x: torch.Tensor, rope) -> torch.Tensor:
        r = self.rotary_dim
        if r == self.head_dim:
            return RotaryEmbedding.rotate(x, rope)
        # rotate-half over the first r channels (Phi-3, GLM-4.5, MiniMax-M2), the rest pass
        return torch.cat((RotaryEmbedding.rotate(x[..., :r].contiguous(), rope), x[..., r:]), dim=-1)


def window_of(config: dict, sliding: bool = True) -> int | None:
    """The sliding window a layer runs with: None where the config has none, the layer is a full
    one, or the window is no shorter than the longest sequence (it would never slide)."""
    window = config.get("sliding_window")
    if not sliding or not window or int(window) >= int(config.get("max_position_embeddings") or 1 << 62):
        return None
    return int(window)
