"""A routed MoE block without a shared expert: Mixtral's (softmax over every expert, the top k
renormalised) and MiniMax-M2's (sigmoid scores; the top k chosen on the scores plus a correction
bias, weighted by the unbiased scores, renormalised). Checkpoints name the experts Mixtral's way
(``block_sparse_moe.experts.{e}.w1/w2/w3``) or Qwen's (``gate_proj/up_proj/down_proj``)."""

from __future__ import annotations

import torch
from torch import nn

from llmkit.core.model.decoder.weight_placement import FUSED_PROJECTIONS, check_loaded, place_tensor
from llmkit.core.model.linear import Linear
from llmkit.core.model.moe import DOWN, GATE, UP, FusedExperts, grouped_topk, softmax_topk

EXPERT_PROJ = {"w1": GATE, "w3": UP, "w2": DOWN, "gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}
SCORINGS = ("softmax", "sigmoid")


class RoutedMoE(nn.Module):
    def __init__(self, config: dict, tp, scoring: str = "softmax") -> None:
        super().__init__()
        if scoring not in SCORINGS:
            raise ValueError(f"MoE scoring '{scoring}' is not one of {SCORINGS}")
        hidden = config["hidden_size"]
        e = int(config.get("num_local_experts") or config.get("num_experts") or 0)
        self.top_k = int(config["num_experts_per_tok"])
        if not 0 < self.top_k <= e:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the number of experts ({e})")
        inter = int(config.get("moe_intermediate_size") or config["intermediate_size"])
        self.scoring = scoring
        self.gate = Linear(hidden, e, tp=None)  # the router: every rank routes every token
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False) if scoring == "sigmoid" else None
        )
        self.experts = FusedExperts(e, hidden, inter, tp=tp)

    def forward(self, x: torch.Tensor, det: bool) -> torch.Tensor:
        logits = self.gate(x, det)
        if self.scoring == "softmax":
            weights, ids = softmax_topk(logits, self.top_k, True)
        else:
            weights, ids = grouped_topk(
                logits,
                self.top_k,
                n_group=1,
                topk_group=1,
                renormalize=True,
                correction_bias=self.e_score_correction_bias,
            )
        return self.experts(x, weights, ids, det)


def load_expert(modules: dict, name: str, tensor) -> bool:
    """Put ``name`` (``....experts.{e}.{proj}.weight``) into its :class:`FusedExperts`; False
    where ``name`` is not a routed expert's weight."""
    parts = name.split(".")
    if "experts" not in parts:
        return False
    i = parts.index("experts")
    owner = modules.get(".".join(parts[: i + 1]))
    rest = parts[i + 1 :]
    if not isinstance(owner, FusedExperts) or len(rest) != 3 or rest[1] not in EXPERT_PROJ or rest[2] != "weight":
        return False
    owner.load(tensor, int(rest[0]), EXPERT_PROJ[rest[1]])
    return True


def load_moe_decoder(model, weights) -> None:
    """Load a Llama-style decoder whose MoE layers keep their experts in :class:`FusedExperts`
    (Mixtral, GLM-4.5, MiniMax-M2): Q/K/V and gate/up fused, Mixtral's ``block_sparse_moe`` read as
    ``mlp``, a router's correction bias (``gate.e_score_correction_bias`` or beside the router)
    onto the block, layers past ``num_hidden_layers`` (GLM's multi-token-prediction layer) skipped.
    KeyError naming the first missing weights."""
    model.weights_changed()
    modules, params = dict(model.named_modules()), dict(model.named_parameters())
    fused = FUSED_PROJECTIONS
    loaded = set()
    for name, tensor in weights:
        name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
        parts = name.split(".")
        if "rotary_emb" in name or (model.tie and name == "lm_head.weight"):
            continue
        if parts[0] == "layers" and int(parts[1]) >= model.num_layers:
            continue
        if load_expert(modules, name, tensor):
            continue
        owner, leaf, part = place_tensor(model, modules, params, name, tensor, fused)
        loaded.add((f"{owner}.{leaf}", part))
    check_loaded(model, loaded)
