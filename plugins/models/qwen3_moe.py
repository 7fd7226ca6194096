"""``Qwen3MoeForCausalLM`` (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen3 attention
(per-head Q/K RMSNorm, no bias) with sparse MoE blocks.

A layer is sparse when it is not in ``mlp_only_layers`` and ``(layer + 1) % decoder_sparse_step ==
0``; the others keep the dense gated MLP. Routing is a softmax over all experts, top
``num_experts_per_tok``, renormalised when ``norm_topk_prob``. No shared experts.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from llmkit.core.model.decoder.stack import DecoderLM
from llmkit.core.model.linear import Linear
from llmkit.core.model.moe import DOWN, GATE, UP, FusedExperts, softmax_topk

_PROJ = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}


def num_experts(config: dict) -> int:
    # Qwen's config.json says num_experts; transformers >= 5 writes num_local_experts
    return int(config.get("num_experts", config.get("num_local_experts")) or 0)


def check_config(config: dict) -> None:
    """Refuse, naming the field, what this implementation does not run."""
    if num_experts(config) and not config.get("moe_intermediate_size"):
        raise ValueError("moe_intermediate_size is missing from config.json (Qwen3MoeForCausalLM's expert width)")
    if num_experts(config) and not config.get("num_experts_per_tok"):
        raise ValueError("num_experts_per_tok is missing from config.json (Qwen3MoeForCausalLM's top-k)")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act '{act}' is not supported for Qwen3MoeForCausalLM; supported: silu")
    quant = (config.get("quantization_config") or {}).get("quant_method")
    if quant:
        raise ValueError(
            f"quantization_config.quant_method '{quant}' is not supported for Qwen3MoeForCausalLM; "
            "supported: unquantized checkpoints"
        )


class SparseMoeBlock(nn.Module):
    def __init__(self, config: dict, tp) -> None:
        super().__init__()
        hidden, e = config["hidden_size"], num_experts(config)
        self.top_k = int(config["num_experts_per_tok"])
        if not 0 < self.top_k <= e:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the number of experts ({e})")
        self.renormalize = bool(config.get("norm_topk_prob", False))
        self.gate = Linear(hidden, e, tp=None)  # the router: every rank routes every token
        self.experts = FusedExperts(e, hidden, int(config["moe_intermediate_size"]), tp=tp)

    def forward(self, x: torch.Tensor, det: bool) -> torch.Tensor:
        weights, ids = softmax_topk(self.gate(x, det), self.top_k, self.renormalize)
        return self.experts(x, weights, ids, det)


class Qwen3MoeForCausalLM(DecoderLM):
    qkv_bias = False
    qk_norm = True
    supports_cuda_graph = False  # FusedExperts groups tokens by expert with host-side counts

    def __init__(self, config: dict, tp=None) -> None:
        check_config(config)
        super().__init__(config, tp)

    def build_mlp(self, layer_id: int) -> nn.Module | None:
        c = self.config
        step = int(c.get("decoder_sparse_step", 1) or 1)
        sparse = num_experts(c) > 0 and layer_id not in (c.get("mlp_only_layers") or []) and (layer_id + 1) % step == 0
        return SparseMoeBlock(c, self.tp) if sparse else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        modules = dict(self.named_modules())

        def dense(stream):
            # Expert tensors go to their layer's FusedExperts; everything else to the decoder's loader.
            for name, tensor in stream:
                parts = name.removeprefix("model.").split(".")
                if "experts" not in parts:
                    yield name, tensor
                    continue
                i = parts.index("experts")
                owner = modules.get(".".join(parts[: i + 1]))
                if not isinstance(owner, FusedExperts):
                    raise KeyError(f"unexpected weight '{name}' for {type(self).__name__}")
                rest = parts[i + 1 :]
                if len(rest) == 3 and rest[1] in _PROJ:  # experts.{e}.gate_proj.weight (HF checkpoints)
                    owner.load(tensor, int(rest[0]), _PROJ[rest[1]])
                elif rest == ["gate_up_proj"]:  # stacked [E, 2I, H] (transformers' in-memory layout)
                    inter = tensor.shape[1] // 2
                    owner.load_stacked(tensor[:, :inter], GATE)
                    owner.load_stacked(tensor[:, inter:], UP)
                elif rest == ["down_proj"]:
                    owner.load_stacked(tensor, DOWN)
                else:
                    raise KeyError(f"unexpected weight '{name}' for {type(self).__name__}")

        super().load_weights(dense(weights))
        for mname, module in modules.items():
            if isinstance(module, FusedExperts) and module.missing():
                raise KeyError(f"checkpoint is missing weights: {[f'{mname}.{m}' for m in module.missing()[:5]]}")
