"""``Llama4ForCausalLM`` (Llama 4 Scout / Maverick text models) and the language model of
``Llama4ForConditionalGeneration``.

Against Llama 3: every ``interleave_moe_layer_step``-th layer (or those ``moe_layers`` names) is a
MoE of top-``k`` experts (1 in the released models) whose sigmoid router score scales the token
*before* its expert, plus a shared expert; the other layers a dense MLP of
``intermediate_size_mlp``. Layers with rope (``no_rope_layers[i] == 1``) rotate adjacent channel
pairs (complex-number rope: the checkpoint's Q/K rows are reordered at load so the usual
rotate-half applies, which leaves every dot product unchanged) and, with ``use_qk_norm``, divide
Q and K by their RMS (weightless; the norm commutes with the rotation). Layers without rope (NoPE,
every fourth) scale their queries by ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))``
where ``attn_temperature_tuning`` is on.

The rope layers attend within chunks of ``attention_chunk_size`` tokens (8,192): a query at p sees
the keys from ``floor(p / chunk) * chunk`` on. The attention backends do not mask by chunks yet,
so the model limits the context to one chunk (``context_limit``: within it, chunked attention is
causal attention), logged at start; longer contexts are not served rather than served wrong.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Iterable

import torch
from torch import nn

from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.model.decoder.routed_moe import load_expert
from llmkit.core.model.decoder.stack import MLP, Attention, DecoderLM
from llmkit.core.model.decoder.weight_placement import FUSED_PROJECTIONS, check_loaded, place_tensor
from llmkit.core.model.layers import RotaryEmbedding
from llmkit.core.model.linear import Linear
from llmkit.core.model.moe import DOWN, GATE, UP, FusedExperts

log = logging.getLogger("llmkit")


def text_config(config: dict) -> dict:
    """The text model's settings (``Llama4ForConditionalGeneration`` nests them under
    ``text_config``), tying decided by the outer config as transformers does."""
    if "text_config" not in config:
        return config
    text = dict(config["text_config"])
    text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return text


class Llama4Attention(Attention):
    """Llama 4's attention: interleaved rope with the weightless Q/K norm on rope layers, the
    position temperature on NoPE layers."""

    def __init__(self, config: dict, layer_id: int, head_dim: int, tp, use_rope: bool) -> None:
        super().__init__(config, layer_id, head_dim, bool(config.get("attention_bias")), False, tp)
        self.use_rope = use_rope
        self.norm_eps = float(config.get("rms_norm_eps", 1e-5)) if use_rope and config.get("use_qk_norm") else None
        tuning = not use_rope and config.get("attn_temperature_tuning")
        self.temperature = (float(config["floor_scale"]), float(config["attn_scale"])) if tuning else None

    def _l2(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.norm_eps)).to(x.dtype)

    def attend(self, qkv, rope, ctx: ForwardContext, bias=None) -> torch.Tensor:
        if bias is not None:
            qkv = qkv + bias
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        d = self.head_dim
        q, k = q.reshape(-1, self.num_heads, d), k.reshape(-1, self.num_kv_heads, d)
        v = v.reshape(-1, self.num_kv_heads, d)
        if self.use_rope:
            q, k = RotaryEmbedding.rotate(q, rope), RotaryEmbedding.rotate(k, rope)
        if self.norm_eps is not None:
            q, k = self._l2(q), self._l2(k)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scale = torch.log1p(torch.floor((ctx.positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scale[:, None, None]).to(q.dtype)
        o = ctx.attn.forward(q, k, v, self.layer_id, ctx.kv_metadata(self.layer_id))
        return o.reshape(-1, self.q_size)


class Llama4MoE(nn.Module):
    """Top-k experts, each fed the token scaled by its sigmoid router score, plus a shared expert."""

    def __init__(self, config: dict, tp) -> None:
        super().__init__()
        hidden, e = config["hidden_size"], int(config["num_local_experts"])
        self.top_k = int(config.get("num_experts_per_tok", 1))
        if self.top_k != 1:
            # (each selected expert would need its own scaled copy of the token)
            raise ValueError(f"num_experts_per_tok {self.top_k} is not supported for Llama 4; supported: 1")
        inter = int(config["intermediate_size"])
        self.router = Linear(hidden, e, tp=None)  # every rank routes every token
        self.experts = FusedExperts(e, hidden, inter, tp=tp)
        self.shared_expert = MLP(hidden, inter, tp)

    def forward(self, x: torch.Tensor, det: bool) -> torch.Tensor:
        top, ids = self.router(x, det).topk(self.top_k, dim=-1)
        score = torch.sigmoid(top.float()).to(x.dtype)
        routed = self.experts(x * score, torch.ones_like(score), ids, det)
        return self.shared_expert(x, det) + routed


class Llama4ForCausalLM(DecoderLM):
    supports_cuda_graph = False  # FusedExperts groups tokens by expert with host-side counts

    def __init__(self, config: dict, tp=None) -> None:
        config = text_config(config)
        n = int(config["num_hidden_layers"])
        step = int(config.get("interleave_moe_layer_step") or 1)
        moe = config.get("moe_layers")
        self.moe_layers = set(moe if moe is not None else range(step - 1, n, step))
        # transformers' default: a NoPE layer every fourth (no_rope_layer_interval)
        rope = config.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(n)]
        if len(rope) != n:
            raise ValueError(f"no_rope_layers has {len(rope)} entries for {n} layers")
        self.rope_layers = [bool(r) for r in rope]
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act '{act}' is not supported for Llama 4; supported: silu")
        super().__init__(config, tp)

    @property
    def context_limit(self) -> int | None:
        chunk = self.config.get("attention_chunk_size")
        return int(chunk) if chunk and any(self.rope_layers) else None

    def build_attention(self, layer_id: int):
        return Llama4Attention(self.config, layer_id, self.head_dim, self.tp, self.rope_layers[layer_id])

    def build_mlp(self, layer_id: int):
        if layer_id in self.moe_layers:
            return Llama4MoE(self.config, self.tp)
        return MLP(self.config["hidden_size"], int(self.config["intermediate_size_mlp"]), self.tp)

    def forward(self, input_ids, positions, ctx):
        return super().forward(input_ids, positions, replace(ctx, positions=positions))  # (NoPE temperature)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.weights_changed()
        modules, params = dict(self.named_modules()), dict(self.named_parameters())
        # pairs (2i, 2i + 1) to rows (i, i + d/2) of each head: rotate-half then rotates as the
        # checkpoint's complex rope does
        order = torch.cat((torch.arange(0, self.head_dim, 2), torch.arange(1, self.head_dim, 2)))
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("language_model.").removeprefix("model.").removeprefix("language_model.")
            if name.startswith(("vision_model.", "multi_modal_projector.")):
                continue  # images are not served: the language model alone
            name = name.replace(".feed_forward.", ".mlp.")
            if self.tie and name == "lm_head.weight":
                continue
            leaf = name.rsplit(".", 1)[-1]
            if ".mlp.experts." in name and leaf in ("gate_up_proj", "down_proj"):
                owner = modules[name.rsplit(".", 1)[0]]
                t = tensor.transpose(1, 2)  # [E, H, 2I] / [E, I, H] -> [E, 2I, H] / [E, H, I]
                if leaf == "gate_up_proj":
                    inter = t.shape[1] // 2
                    owner.load_stacked(t[:, :inter], GATE)
                    owner.load_stacked(t[:, inter:], UP)
                else:
                    owner.load_stacked(t, DOWN)
                continue
            if load_expert(modules, name, tensor):
                continue
            if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                rows = tensor.shape[0] // self.head_dim
                tensor = tensor.reshape(rows, self.head_dim, -1)[:, order].reshape(tensor.shape)
            owner, leaf, part = place_tensor(self, modules, params, name, tensor, FUSED_PROJECTIONS)
            loaded.add((f"{owner}.{leaf}", part))
        check_loaded(self, loaded)
