"""``--speculative-algorithm EAGLE``: an EAGLE-1/EAGLE-2 draft head (``--speculative-draft-model-path``,
the directory its repository ships: a one-layer Llama ``config.json`` and the weights).

The head is ``fc`` over ``[embed(token), feature]`` (twice the hidden width, with a bias) and one
Llama decoder layer without its input norm; the target's LM head reads its output directly. Its first
feature is the target's output state (after the final norm) at the position before the token, then
its own output for each further draft token, as the EAGLE repository and SGLang run it. The
embedding is the target's unless the checkpoint carries its own. The bookkeeping (the states kept
per request, the head's K/V cut back to the target's tokens) is
:class:`~llmkit.plugins.speculative.hidden_draft.HiddenStateProposer`'s.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.layers import RMSNorm, RotaryEmbedding
from llmkit.plugins.speculative.draft_cache import DraftAttention, DraftKV
from llmkit.plugins.speculative.eagle3 import load_tensors
from llmkit.plugins.speculative.hidden_draft import HiddenStateProposer

log = logging.getLogger("llmkit")


class EagleHead(nn.Module):
    def __init__(self, config: dict, target, embed: nn.Module) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config["intermediate_size"])
        bias = bool(config.get("attention_bias", False))
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self._shared = (target, embed)  # the target's LM head (and embedding): not submodules
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, float(config.get("rms_norm_eps", 1e-6)))
        self.rotary = RotaryEmbedding(head_dim, int(config.get("max_position_embeddings", 4096)), config)
        self.attention = DraftAttention(head_dim**-0.5)

    def forward(self, hidden, tokens, positions, kv: DraftKV) -> tuple[torch.Tensor, torch.Tensor]:
        target, embed = self._shared
        t = tokens.shape[0]
        x = self.fc(torch.cat((embed(tokens), hidden), dim=-1))
        table = self.rotary.table(positions, x.dtype)
        q = RotaryEmbedding.rotate(self.q_proj(x).view(t, self.heads, self.head_dim), table)
        k = RotaryEmbedding.rotate(self.k_proj(x).view(t, self.kv_heads, self.head_dim), table)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        attn = self.o_proj(self.attention.forward(q, k, v, 0, kv).reshape(t, -1))
        h, residual = self.post_attention_layernorm(attn, x)
        out = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)) + residual
        return out, target.compute_logits(out).argmax(dim=-1)


_NAMES = {
    "fc.weight": "fc.weight",
    "fc.bias": "fc.bias",
    "layers.0.post_attention_layernorm.weight": "post_attention_layernorm.weight",
    **{f"layers.0.self_attn.{p}.{w}": f"{p}.{w}" for p in ("q_proj", "k_proj", "v_proj") for w in ("weight", "bias")},
    "layers.0.self_attn.o_proj.weight": "o_proj.weight",
    **{f"layers.0.mlp.{p}.weight": f"{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
}
# shipped by some heads and unused by the layer (EAGLE's first layer has no input norm)
_IGNORED = {"layers.0.input_layernorm.weight", "norm.weight", "lm_head.weight"}


class EagleProposer(HiddenStateProposer):
    def __init__(
        self,
        draft_model_path: str | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        target_model=None,
        **options,
    ) -> None:
        super().__init__(**options)
        if not draft_model_path:
            raise ValueError("EAGLE speculation needs --speculative-draft-model-path (the EAGLE head's directory)")
        path = Path(draft_model_path).expanduser()
        if not (path / "config.json").exists():
            raise ValueError(f"--speculative-draft-model-path {draft_model_path}: no config.json there")
        if target_model is None or not getattr(target_model, "supports_feature_capture", False):
            raise ValueError("EAGLE needs a target model whose hidden states can be captured (Llama-style models)")
        config = json.loads((path / "config.json").read_text())
        if int(config.get("hidden_size", -1)) != int(target_model.config["hidden_size"]):
            raise ValueError("EAGLE head: its hidden size differs from the target's")
        tensors = load_tensors(path, "EAGLE")
        self.device = torch.device(device)
        embed = target_model.embed_tokens
        if "embed_tokens.weight" not in tensors and target_model.tp.size > 1:
            raise ValueError(
                "EAGLE under --tp-size > 1 needs a head with its own embed_tokens.weight: the target's "
                "embedding is split over the ranks, and only rank 0 drafts"
            )
        if "embed_tokens.weight" in tensors:
            weight = tensors.pop("embed_tokens.weight").to(device=self.device, dtype=dtype)
            embed = nn.Embedding.from_pretrained(weight, freeze=True)
        self.target = target_model
        self.head = EagleHead(config, target_model, embed)
        params = dict(self.head.named_parameters())
        missing = {v for v in _NAMES.values() if v in params}
        for name, tensor in tensors.items():
            if name in _IGNORED:
                continue
            ours = _NAMES.get(name)
            if ours is None or ours not in params:
                raise ValueError(f"EAGLE head: unexpected tensor {name!r} (is this an EAGLE-1/2 checkpoint?)")
            if params[ours].shape != tensor.shape:
                raise ValueError(
                    f"EAGLE head: {name} is {tuple(tensor.shape)}, the config says {tuple(params[ours].shape)}"
                )
            with torch.no_grad():
                params[ours].copy_(tensor)
            missing.discard(ours)
        if missing:
            raise ValueError(f"EAGLE head: missing {', '.join(sorted(missing))}")
        self.head.to(device=self.device, dtype=dtype).eval()
        self.feature_layers = (target_model.num_layers,)  # the last layer's output, normed below
        self.max_position = int(config.get("max_position_embeddings", 1 << 30))
        log.info("EAGLE draft head: %s", path)

    def draft_layer(self, hidden, tokens, positions, kv, from_target: bool):
        if from_target:  # the captured state is the last layer's output before the final norm
            hidden = self.target.norm(hidden)
        return self.head(hidden, tokens, positions, kv)
