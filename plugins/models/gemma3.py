"""Gemma 3: ``Gemma3ForCausalLM`` (text, model_type ``gemma3_text``) and
``Gemma3ForConditionalGeneration`` (images in, text out, model_type ``gemma3``: ``gemma3_vl.py``).

The text stack differs from Llama's in:
- embeddings scaled by ``sqrt(hidden)`` (the scale cast to the model dtype first, as transformers);
- Gemma's RMSNorm ``norm(x) * (1 + w)`` computed in fp32, on Q and K per head too, and four norms a
  layer: input, post-attention (on the attention output, before the residual add), pre- and
  post-feedforward;
- a GELU-tanh gated MLP and the softmax scale ``query_pre_attn_scalar ** -0.5``;
- interleaved layers (``layer_types``): sliding-window ones rotate with the local rope base
  (``rope_local_base_freq``), full-attention ones with the global rope and its scaling.

The multimodal model puts a SigLIP vision tower and Gemma's projector (average pool to
``mm_tokens_per_image`` rows, soft-embedding RMSNorm, a projection) in front of that stack. Image
rows replace the (unscaled) embeddings of their pseudo-ids, and attend to their whole image both
ways (the ``bidirectional_spans`` attention feature).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.attention import SLIDING_WINDOW
from llmkit.core.model.causal_lm import CausalLM, ForwardContext
from llmkit.core.model.decoder.weight_placement import FUSED_PROJECTIONS, place_tensor
from llmkit.core.model.layers import RotaryEmbedding
from llmkit.core.model.linear import Linear, LMHead, VocabEmbedding
from llmkit.core.model.parallel import TPGroup

LAYER_TYPES = ("sliding_attention", "full_attention")

# transformers' Gemma3TextConfig defaults: published multimodal checkpoints spell out only a few
# fields of their text_config and rely on these for the rest
TEXT_DEFAULTS = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    sliding_window_pattern=6,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
    tie_word_embeddings=True,
)


# SiglipVisionConfig's defaults, with Gemma 3's (so400m at 896 px) where its configs omit them
def text_config(config: dict) -> dict:
    """The text stack's settings, defaults filled in (an explicit null too, where one would not run)."""
    c = {**TEXT_DEFAULTS, **config}
    for key in ("rope_theta", "rope_local_base_freq", "query_pre_attn_scalar", "rms_norm_eps"):
        if c[key] is None:
            c[key] = TEXT_DEFAULTS[key]
    c["num_key_value_heads"] = c["num_key_value_heads"] or c["num_attention_heads"]
    c["head_dim"] = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    c["max_position_embeddings"] = c["max_position_embeddings"] or TEXT_DEFAULTS["max_position_embeddings"]
    return c


def layer_types(config: dict) -> list[str]:
    n, pattern = int(config["num_hidden_layers"]), int(config.get("sliding_window_pattern") or 6)
    return list(config.get("layer_types") or [LAYER_TYPES[(i + 1) % pattern == 0] for i in range(n)])


def rope_configs(config: dict) -> dict[str, dict]:
    """Per layer type, a config :class:`RotaryEmbedding` reads: ``rope_parameters`` keyed by layer
    type (transformers 5's configs), else the global ``rope_theta`` with ``rope_scaling`` and the
    local ``rope_local_base_freq`` (the published checkpoints')."""
    params = config.get("rope_parameters") or {}
    full, local = params.get("full_attention"), params.get("sliding_attention")
    if full is None:
        full = {**(config.get("rope_scaling") or {}), "rope_theta": float(config["rope_theta"])}
    if local is None:
        local = {"rope_type": "default", "rope_theta": float(config["rope_local_base_freq"])}
    mpe = int(config["max_position_embeddings"])
    return {
        "full_attention": {"rope_parameters": full, "max_position_embeddings": mpe},
        "sliding_attention": {"rope_parameters": local, "max_position_embeddings": mpe},
    }


def check_text_config(config: dict) -> None:
    """Refuse variants this implementation does not run, naming the field."""
    if config.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported for Gemma 3 (Gemma 2's attention softcap)")
    if config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an embedding model) is not supported for generation")
    act = config.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation '{act}' is not supported for Gemma 3; supported: gelu_pytorch_tanh")
    for i, kind in enumerate(layer_types(config)):
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] '{kind}' is not one of {', '.join(LAYER_TYPES)}")


class GemmaRMSNorm(nn.Module):
    """``norm(x) * (1 + weight)`` in fp32, cast back to ``x``'s dtype (the weight is zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: dict, layer_id: int, tp: TPGroup):
        super().__init__()
        self.layer_id = layer_id
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        hidden, d = config["hidden_size"], config["head_dim"]
        q, kv = heads * d, kv_heads * d
        bias = bool(config.get("attention_bias", False))
        parts = [(q, heads), (kv, kv_heads), (kv, kv_heads)]
        self.qkv_proj = Linear(hidden, q + 2 * kv, bias=bias, parallel="column", parts=parts, tp=tp)
        self.o_proj = Linear(q, hidden, bias=bias, parallel="row", in_units=heads, tp=tp)
        self.head_dim = d
        self.num_heads = self.o_proj.local_in // d
        self.num_kv_heads = (self.qkv_proj.local_out - self.num_heads * d) // (2 * d)
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        eps = config["rms_norm_eps"]
        self.q_norm, self.k_norm = GemmaRMSNorm(d, eps), GemmaRMSNorm(d, eps)
        self.sliding = layer_types(config)[layer_id] == "sliding_attention"
        window = config.get("sliding_window")
        self.sliding_window = int(window) if self.sliding and window else None

    def forward(self, x, rope, ctx: ForwardContext):
        det = ctx.deterministic
        qkv = self.qkv_proj(x, det)
        d = self.head_dim
        q = self.q_norm(qkv[:, : self.q_size].reshape(-1, self.num_heads, d))
        k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, self.num_kv_heads, d))
        v = qkv[:, self.q_size + self.kv_size :].reshape(-1, self.num_kv_heads, d)
        q, k = RotaryEmbedding.rotate(q, rope), RotaryEmbedding.rotate(k, rope)
        md = ctx.kv_metadata(self.layer_id)  # (a window layer's own pages, where they are kept apart)
        if self.sliding_window is None:
            o = ctx.attn.forward(q, k, v, self.layer_id, md)
        else:
            o = ctx.attn.forward(q, k, v, self.layer_id, md, sliding_window=self.sliding_window)
        return self.o_proj(o.reshape(-1, self.q_size), det)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, parallel="column", parts=[(inter, inter)] * 2, tp=tp)
        self.down_proj = Linear(inter, hidden, parallel="row", tp=tp)
        self.inter = self.down_proj.local_in

    def forward(self, x, det: bool):
        gate, up = self.gate_up_proj(x, det).split(self.inter, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up, det)


class DecoderLayer(nn.Module):
    def __init__(self, config: dict, layer_id: int, tp: TPGroup):
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Attention(config, layer_id, tp)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = MLP(hidden, config["intermediate_size"], tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x, rope, ctx: ForwardContext):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, ctx))
        h = self.mlp(self.pre_feedforward_layernorm(x), ctx.deterministic)
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(CausalLM):
    supports_tp = True
    supports_cuda_graph = True
    attention_features = frozenset({SLIDING_WINDOW})

    def __init__(self, config: dict, tp: TPGroup | None = None) -> None:
        config = text_config(config)
        check_text_config(config)
        super().__init__(config, tp)
        tp = self.tp
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        self.embed_tokens = VocabEmbedding(vocab, hidden, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(self.num_layers))
        self.norm = GemmaRMSNorm(hidden, config["rms_norm_eps"])
        self.tie = bool(config.get("tie_word_embeddings", True))
        self.lm_head = LMHead(vocab, hidden, tp, tied=self.embed_tokens if self.tie else None)
        ropes = rope_configs(config)
        d, mpe = self.head_dim, int(config["max_position_embeddings"])
        self.rotary_global = RotaryEmbedding(d, mpe, ropes["full_attention"])
        self.rotary_local = RotaryEmbedding(d, mpe, ropes["sliding_attention"])
        self.embed_scale = float(hidden) ** 0.5
        self._scales: dict[torch.dtype, float] = {}
        self.softcap = config.get("final_logit_softcapping")

    @property
    def head_dim(self) -> int:
        return int(self.config["head_dim"])

    @property
    def attention_scale(self) -> float:
        return float(self.config["query_pre_attn_scalar"]) ** -0.5

    @property
    def kv_windows(self) -> list[int | None]:
        return [layer.self_attn.sliding_window for layer in self.layers]

    @property
    def local_heads(self) -> int:
        return self.layers[0].self_attn.num_heads

    @property
    def local_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings times ``sqrt(hidden)``, the scale rounded to the model dtype first (a
        Python number: no host-to-device copy in a captured CUDA graph; the product rounds as
        transformers' tensor product does, both factors being of the dtype)."""
        x = self.embed_tokens(input_ids)
        scale = self._scales.get(x.dtype)
        if scale is None:
            scale = self._scales[x.dtype] = torch.tensor(self.embed_scale).to(x.dtype).item()
        return x * scale

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ropes = {
            True: self.rotary_local.table(positions, x.dtype),
            False: self.rotary_global.table(positions, x.dtype),
        }
        for layer in self.layers:
            x = layer(x, ropes[layer.self_attn.sliding], ctx)
        return self.norm(x)

    def forward(self, input_ids, positions, ctx):
        return self.run_layers(self.embed(input_ids), positions, ctx)

    def compute_logits(self, hidden, deterministic=False):
        logits = self.lm_head(hidden, deterministic)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    _FUSED = FUSED_PROJECTIONS

    def load_tensor(self, modules: dict, params: dict, name: str, tensor) -> str:
        """One text-stack tensor (named as in ``Gemma3TextModel``, ``lm_head.weight`` aside) into
        place; returns the name of what it filled, for the missing-weights check."""
        return ".".join(map(str, place_tensor(self, modules, params, name, tensor, self._FUSED)))

    def expected_weights(self) -> set[str]:
        out = set()
        for mname, module in self.named_modules():
            if isinstance(module, Linear):
                out |= {f"{mname}.weight.{p}" for p in range(len(module._row_map))}
                if module.bias is not None:
                    out |= {f"{mname}.bias.{p}" for p in range(len(module._row_map))}
            elif isinstance(module, GemmaRMSNorm) or (
                isinstance(module, VocabEmbedding) and not mname.endswith(".proj")
            ):
                out.add(f"{mname}.weight.0")
            elif isinstance(module, LMHead) and module.tied is None:
                out.add(f"{mname}.weight.0")
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        modules, params = dict(self.named_modules()), dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if self.tie and name == "lm_head.weight":
                continue
            loaded.add(self.load_tensor(modules, params, name, tensor))
        missing = sorted(self.expected_weights() - loaded)
        if missing:
            raise KeyError(f"checkpoint is missing weights: {missing[:5]}")


# --- the vision tower (SigLIP) and the projector --------------------------------------------------
