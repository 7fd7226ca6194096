"""A sparse MoE block with a gated shared expert (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE): softmax
routing over all experts, top ``num_experts_per_tok`` renormalised (``norm_topk_prob``, on unless
the config says otherwise), plus a dense shared expert scaled by ``sigmoid(shared_expert_gate(x))``."""

from __future__ import annotations

import torch
from torch import nn

from llmkit.core.model.decoder.stack import MLP
from llmkit.core.model.linear import Linear
from llmkit.core.model.moe import FusedExperts, softmax_topk


class SharedExpertMoE(nn.Module):
    def __init__(self, config: dict, tp=None) -> None:
        super().__init__()
        hidden, e = config["hidden_size"], int(config["num_experts"])
        self.top_k = int(config["num_experts_per_tok"])
        if not 0 < self.top_k <= e:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the number of experts ({e})")
        self.renormalize = bool(config.get("norm_topk_prob", True))
        self.gate = Linear(hidden, e, tp=None)  # the router: every rank routes every token
        self.experts = FusedExperts(e, hidden, int(config["moe_intermediate_size"]), tp=tp)
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        self.shared_expert = MLP(hidden, shared, tp) if shared else None
        self.shared_expert_gate = Linear(hidden, 1, tp=None) if shared else None

    def forward(self, x: torch.Tensor, det: bool) -> torch.Tensor:
        weights, ids = softmax_topk(self.gate(x, det), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids, det)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x, det)) * self.shared_expert(x, det)
        return out
