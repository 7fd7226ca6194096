"""``GptOssForCausalLM`` (gpt-oss-20b, gpt-oss-120b).

- Attention: Q/K/V/O with biases, YaRN rope, a learned sink logit per head, and layers alternating
  between a sliding window (``sliding_window``, 128) and full attention (``layer_types``).
- MoE on every layer: a router with bias, top-k of the logits then a softmax over the k chosen,
  experts with biases and the clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha * g)``,
  ``g = min(gate, limit)``. Checkpoints interleave gate and up channels (even/odd); they are split
  into the batched experts' gate-then-up layout at load.
- The published checkpoints store the experts in MXFP4 (``*_blocks`` / ``*_scales``); without an
  MXFP4 kernel they are dequantized at load to the compute dtype (logged).
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from llmkit.core.model.attention import SINKS, SLIDING_WINDOW
from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.model.decoder.stack import PreNormBlock, StackedLM
from llmkit.core.model.layers import RMSNorm, RotaryEmbedding
from llmkit.core.model.linear import Linear, LMHead, VocabEmbedding
from llmkit.core.model.loader.source import materialize
from llmkit.core.model.moe import DOWN, GATE, UP, FusedExperts
from llmkit.core.model.parallel import TPGroup
from llmkit.core.model.quant.mxfp4 import dequantize_mxfp4

log = logging.getLogger("llmkit")

QUANT_METHODS = ("mxfp4",)
_PROJ = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}
LAYER_TYPES = ("sliding_attention", "full_attention")


def check_config(config: dict) -> None:
    """Refuse variants this implementation does not run, naming the field."""
    quant = config.get("quantization_config") or {}
    method = quant.get("quant_method")
    if quant and method not in QUANT_METHODS:
        raise ValueError(
            f"quantization_config.quant_method '{method}' is not supported for GptOssForCausalLM; "
            f"supported: {', '.join(QUANT_METHODS)} (or an unquantized checkpoint)"
        )
    for i, kind in enumerate(layer_types(config)):
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] '{kind}' is not one of {', '.join(LAYER_TYPES)}")


def layer_types(config: dict) -> list[str]:
    n = int(config["num_hidden_layers"])
    return list(config.get("layer_types") or [LAYER_TYPES[(i + 1) % 2 == 0] for i in range(n)])


class ClampedSwiGLU:
    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class Attention(nn.Module):
    def __init__(self, config: dict, layer_id: int, head_dim: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer_id = layer_id
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        hidden = config["hidden_size"]
        q, kv = heads * head_dim, kv_heads * head_dim
        self.qkv_proj = Linear(
            hidden, q + 2 * kv, bias=True, parallel="column", parts=[(q, heads), (kv, kv_heads), (kv, kv_heads)], tp=tp
        )
        self.o_proj = Linear(q, hidden, bias=True, parallel="row", in_units=heads, tp=tp)
        self.head_dim = head_dim
        self.num_heads = self.o_proj.local_in // head_dim
        self.num_kv_heads = (self.qkv_proj.local_out - self.num_heads * head_dim) // (2 * head_dim)
        self.first_head = self.o_proj._cols.start // head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        # fp32 whatever the compute dtype: a sink is a logit beside fp32 softmax statistics
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        sliding = layer_types(config)[layer_id] == "sliding_attention"
        self.sliding_window = int(config["sliding_window"]) if sliding and config.get("sliding_window") else None

    def load_sinks(self, tensor: torch.Tensor) -> None:
        self.sinks.data.copy_(tensor[self.first_head : self.first_head + self.num_heads])

    def forward(self, x, rope, ctx: ForwardContext):
        det = ctx.deterministic
        qkv = self.qkv_proj(x, det)
        heads = self.num_heads + self.num_kv_heads
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        qk = RotaryEmbedding.rotate(qkv[:, : self.q_size + self.kv_size].view(-1, heads, self.head_dim), rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        o = ctx.attn.forward(
            q.contiguous(),
            k,
            v,
            self.layer_id,
            ctx.kv_metadata(self.layer_id),  # (a window layer's own pages, where they are kept apart)
            sliding_window=self.sliding_window,
            sinks=self.sinks,
        )
        return self.o_proj(o.reshape(-1, self.q_size), det)


class MoE(nn.Module):
    def __init__(self, config: dict, tp: TPGroup) -> None:
        super().__init__()
        hidden, e = config["hidden_size"], int(config["num_local_experts"])
        self.top_k = int(config["num_experts_per_tok"])
        if not 0 < self.top_k <= e:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and num_local_experts ({e})")
        self.router = Linear(hidden, e, bias=True)
        act = ClampedSwiGLU(float(config.get("swiglu_alpha", 1.702)), float(config.get("swiglu_limit", 7.0)))
        self.experts = FusedExperts(e, hidden, int(config["intermediate_size"]), bias=True, tp=tp, activation=act)

    def forward(self, x: torch.Tensor, det: bool) -> torch.Tensor:
        top, ids = torch.topk(self.router(x, det), self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=torch.float32)
        return self.experts(x, weights, ids, det)


class DecoderLayer(PreNormBlock):
    def __init__(self, config: dict, layer_id: int, head_dim: int, tp: TPGroup) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-5)
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.self_attn = Attention(config, layer_id, head_dim, tp)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)
        self.mlp = MoE(config, tp)


class GptOssForCausalLM(StackedLM):
    reads_own_quantization = True  # MXFP4 experts, checked by check_config
    supports_tp = True
    supports_cuda_graph = False  # FusedExperts groups tokens by expert with host-side counts
    attention_features = frozenset({SINKS, SLIDING_WINDOW})

    def __init__(self, config: dict, tp: TPGroup | None = None) -> None:
        check_config(config)
        super().__init__(config, tp)
        tp = self.tp
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        self.embed_tokens = VocabEmbedding(vocab, hidden, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.head_dim, tp) for i in range(self.num_layers))
        self.finish_stack(config.get("rms_norm_eps", 1e-5), self.head_dim)

    @property
    def kv_windows(self) -> list[int | None]:
        return [layer.self_attn.sliding_window for layer in self.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        modules = dict(self.named_modules())
        qkv = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
        loaded: set[str] = set()
        packed: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 halves waiting for their partner
        dequantized = 0
        for name, tensor in weights:
            name = name.removeprefix("model.")
            parts = name.split(".")
            owner, leaf = ".".join(parts[:-1]), parts[-1]
            if self.tie and name == "lm_head.weight":
                continue
            if len(parts) >= 2 and parts[-2] in qkv:
                owner = ".".join(parts[:-2] + ["qkv_proj"])
                modules[owner].load(tensor, qkv[parts[-2]])
            elif leaf == "sinks" and isinstance(modules.get(owner), Attention):
                modules[owner].load_sinks(tensor)
            elif len(parts) > 3 and parts[-4] == "experts" and parts[-2] in _PROJ:
                # per-expert tensors [out, in] (the GGUF conversion's layout): experts.E.gate_proj.weight
                owner = ".".join(parts[:-3])
                modules[owner].load(tensor, int(parts[-3]), _PROJ[parts[-2]])
            elif isinstance(modules.get(owner), FusedExperts):
                tensor = materialize(tensor)  # stacked experts are read whole (lazily loaded under TP)
                if leaf.endswith(("_blocks", "_scales")):
                    base, kind = leaf.rsplit("_", 1)
                    halves = packed.setdefault(f"{owner}.{base}", {})
                    halves[kind] = tensor
                    if len(halves) < 2:
                        continue
                    del packed[f"{owner}.{base}"]
                    # [E, out, in] after dequantization: transpose to the bf16 checkpoints' [E, in, out]
                    tensor = dequantize_mxfp4(halves["blocks"], halves["scales"]).transpose(1, 2)
                    leaf, dequantized = base, dequantized + 1
                self._load_experts(modules[owner], leaf, tensor)
            elif isinstance(modules.get(owner), Linear) and leaf in ("weight", "bias"):
                modules[owner].load(tensor)
            elif isinstance(modules.get(owner), (VocabEmbedding, LMHead)) and leaf == "weight":
                modules[owner].load(tensor)
            elif isinstance(modules.get(owner), RMSNorm) and leaf == "weight":
                modules[owner].weight.data.copy_(materialize(tensor))
            else:
                raise KeyError(f"unexpected weight '{name}' for {type(self).__name__}")
            loaded.add(owner)
        if packed:
            raise KeyError(f"MXFP4 tensors without their blocks/scales partner: {sorted(packed)[:5]}")
        if dequantized:
            log.info("gpt-oss: %d MXFP4 expert tensors dequantized at load (no MXFP4 kernel here)", dequantized)
        missing = [m for m, mod in modules.items() if isinstance(mod, FusedExperts) and mod.missing()]
        missing += [
            m for m, mod in modules.items() if isinstance(mod, (Linear, RMSNorm, Attention)) and m not in loaded
        ]
        if missing:
            raise KeyError(f"checkpoint is missing weights: {missing[:5]}")

    @staticmethod
    def _load_experts(experts: FusedExperts, leaf: str, tensor: torch.Tensor) -> None:
        # checkpoint layout: gate_up_proj [E, H, 2I] (gate/up interleaved), down_proj [E, I, H]
        for e in range(experts.num_experts):
            t = tensor[e]
            if leaf == "gate_up_proj":
                experts.load(t[:, 0::2].t(), e, GATE)
                experts.load(t[:, 1::2].t(), e, UP)
            elif leaf == "gate_up_proj_bias":
                experts.load(t[0::2], e, GATE)
                experts.load(t[1::2], e, UP)
            elif leaf == "down_proj":
                experts.load(t.t(), e, DOWN)
            elif leaf == "down_proj_bias":
                experts.load(t, e, DOWN)
            else:
                raise KeyError(f"unexpected expert tensor '{leaf}'")
