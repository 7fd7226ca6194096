"""Granite 4.0-H (``GraniteMoeHybridForCausalLM``, IBM): Mamba2 layers (``core/model/hybrid/mamba2.py``)
and grouped-query attention layers (unrotated, or rotary with ``position_embedding_type: rope``), in
the order ``layer_types`` gives, each followed by a feed-forward: a routed SwiGLU MoE (softmax over
the top-k logits) plus a shared SwiGLU expert, or the shared one alone (``num_local_experts: 0``).
Granite's multipliers: the embeddings are scaled, each branch's output is scaled before its
residual add, the attention's softmax scale is ``attention_multiplier``, the logits are divided by
``logits_scaling``. Only attention layers have K/V in the paged pool; the Mamba2 layers keep their
state in the state pool (``core/kvcache/state_pool.py``)."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from llmkit.core.model.decoder.nope_attention import NoPEAttention
from llmkit.core.model.decoder.stack import MLP, Attention, StackedLM
from llmkit.core.model.decoder.weight_placement import FUSED_PROJECTIONS, check_loaded, place_tensor
from llmkit.core.model.hot_module import HotModule
from llmkit.core.model.hybrid.mamba2 import Mamba2, time_step_limit
from llmkit.core.model.layers import RMSNorm
from llmkit.core.model.linear import Linear, VocabEmbedding
from llmkit.core.model.loader.source import materialize
from llmkit.core.model.moe import DOWN, GATE, UP, FusedExperts, softmax_topk

MAMBA, ATTENTION = "mamba", "attention"
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}


def granite_hybrid_config(config: dict) -> dict:
    """``config`` as transformers' ``GraniteMoeHybridConfig`` reads it: the layer kinds (IBM's
    ``mamba`` / ``attention`` or transformers' names; every layer Mamba2 without them), the Mamba2
    head size (``auto``: the expanded width over the heads)."""
    c = dict(config)
    n = int(c["num_hidden_layers"])
    types = c.get("layer_types") or c.get("layers_block_type") or ["mamba"] * n
    if len(types) != n or set(types) - set(_KINDS):
        raise ValueError(f"layer_types must name {n} layers, each one of {sorted(_KINDS)}: {types}")
    c["layer_types"] = [_KINDS[t] for t in types]
    inner = int(c.get("mamba_expand", 2)) * int(c["hidden_size"])
    if c.get("mamba_d_head", "auto") == "auto":
        c["mamba_d_head"] = inner // int(c["mamba_n_heads"])
    if int(c["mamba_d_head"]) * int(c["mamba_n_heads"]) != inner:
        raise ValueError("Granite 4.0-H: mamba_n_heads x mamba_d_head must be mamba_expand x hidden_size")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Granite 4.0-H: hidden_act {c['hidden_act']!r} is not served (silu is)")
    return c


class GraniteFeedForward(HotModule):
    """The routed SwiGLU experts (top-k of the router's logits, softmax over those k) plus the
    shared SwiGLU expert; the shared one alone without experts."""

    def __init__(self, c: dict):
        super().__init__()
        hidden, e = c["hidden_size"], int(c.get("num_local_experts") or 0)
        self.top_k = int(c.get("num_experts_per_tok", 2))
        self.router = Linear(hidden, e) if e else None
        self.experts = FusedExperts(e, hidden, int(c["intermediate_size"])) if e else None
        self.shared_mlp = MLP(hidden, int(c["shared_intermediate_size"]), None)

    def forward(self, x, det: bool):
        out = self.shared_mlp(x, det)
        if self.experts is not None:
            weights, ids = softmax_topk(self.router(x, det), self.top_k, renormalize=True)
            out = out + self.experts(x, weights, ids, det)
        return out


class GraniteHybridBlock(HotModule):
    """``x + m * mixer(norm(x))``, then ``x + m * ffn(norm(x))`` (``m``: ``residual_multiplier``),
    the residual sums fused into the norms."""

    def __init__(self, c: dict, mixer: nn.Module):
        super().__init__()
        hidden, eps = c["hidden_size"], c.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.mixer = mixer
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.feed_forward = GraniteFeedForward(c)
        self.scale = float(c.get("residual_multiplier", 1.0))

    def forward(self, x, residual, rope, ctx):
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.mixer(h, rope, ctx) * self.scale, residual)
        return self.feed_forward(h, ctx.deterministic) * self.scale, residual


# the checkpoint's names inside ``layers.N.`` and ours
_RENAMES = {
    "mamba.": "mixer.",
    "self_attn.": "mixer.",
    "block_sparse_moe.router.layer.": "feed_forward.router.",
    "shared_mlp.input_linear.": "feed_forward.shared_mlp.input_linear.",  # (split at load)
    "shared_mlp.output_linear.": "feed_forward.shared_mlp.down_proj.",
    "shared_mlp.": "feed_forward.shared_mlp.",  # (a GGUF's gate_proj / up_proj / down_proj)
}
_FUSED = FUSED_PROJECTIONS
_EXPERT_PROJ = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}


class GraniteMoeHybridForCausalLM(StackedLM):
    supports_feature_capture = False

    def __init__(self, config: dict, tp=None) -> None:
        config = granite_hybrid_config(config)
        super().__init__(config, tp)
        self.types = config["layer_types"]
        self.rotary_on = config.get("position_embedding_type") == "rope"
        hidden, c = config["hidden_size"], config
        self.embed_tokens = VocabEmbedding(config["vocab_size"], hidden, self.tp)
        blocks, kv_id, state_id = [], 0, 0
        for kind in self.types:
            if kind == ATTENTION:  # kv_id / state_id: its index among the layers of its kind
                if self.rotary_on:
                    mixer = Attention(c, kv_id, self.head_dim, bool(c.get("attention_bias", False)), False, self.tp)
                else:
                    mixer = NoPEAttention(c, kv_id, self.head_dim)
                kv_id += 1
            else:
                mixer = Mamba2(
                    hidden,
                    heads=int(c["mamba_n_heads"]),
                    head_dim=int(c["mamba_d_head"]),
                    state_size=int(c.get("mamba_d_state", 256)),
                    groups=int(c.get("mamba_n_groups", 1)),
                    kernel=int(c.get("mamba_d_conv", 4)),
                    conv_bias=bool(c.get("mamba_conv_bias", True)),
                    proj_bias=bool(c.get("mamba_proj_bias", False)),
                    eps=float(c.get("rms_norm_eps", 1e-6)),
                    state_id=state_id,
                    chunk=int(c.get("mamba_chunk_size", 256)),
                    dt_limit=time_step_limit(c),
                )
                state_id += 1
            blocks.append(GraniteHybridBlock(c, mixer))
        self.layers = nn.ModuleList(blocks)
        if int(c.get("num_local_experts") or 0):
            self.supports_cuda_graph = False  # FusedExperts groups tokens by expert with host-side counts
        self.finish_stack(float(c.get("rms_norm_eps", 1e-6)), self.head_dim)

    @property
    def num_kv_layers(self) -> int:
        return self.types.count(ATTENTION)

    @property
    def local_kv_heads(self) -> int:
        return int(self.config["num_key_value_heads"])

    @property
    def local_heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def attention_scale(self) -> float | None:
        return float(self.config.get("attention_multiplier", self.head_dim**-0.5))

    def state_specs(self, dtype: torch.dtype):
        return [layer.mixer.state_spec(dtype) for layer in self.layers if isinstance(layer.mixer, Mamba2)]

    def embed(self, input_ids, ctx):
        return self.embed_tokens(input_ids) * float(self.config.get("embedding_multiplier", 1.0))

    def forward(self, input_ids, positions, ctx):
        x, residual = self.embed(input_ids, ctx), None
        rope = self.rope_table(positions, ctx, x.dtype) if self.rotary_on else None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden, deterministic=False):
        return self.lm_head(hidden, deterministic) / float(self.config.get("logits_scaling", 1.0))

    # -- weights -----------------------------------------------------------------------------
    def _our_name(self, name: str) -> str:
        """A checkpoint name (``model.`` removed) as ours; a layer's mixer weight of the other kind
        than its ``layer_types`` entry is an error naming the layer."""
        if not name.startswith("layers."):
            return name
        _, idx, rest = name.split(".", 2)
        if int(idx) >= len(self.types):
            raise ValueError(f"the checkpoint has weights of layer {idx}, the config {len(self.types)} layers")
        kind = self.types[int(idx)]
        found = MAMBA if rest.startswith("mamba.") else ATTENTION if rest.startswith("self_attn.") else None
        if found is not None and found != kind:
            raise ValueError(
                f"layer {idx} is '{kind}' in the config's layer_types, but the checkpoint has the "
                f"'{found}' weight 'model.{name}': the config and the weights disagree"
            )
        for old, new in _RENAMES.items():
            if rest.startswith(old):
                rest = new + rest.removeprefix(old)
                break
        if rest == "mixer.conv1d.weight":
            rest = "mixer.conv_weight"
        elif rest == "mixer.conv1d.bias":
            rest = "mixer.conv_bias"
        return f"layers.{idx}.{rest}"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded = set()
        for raw, tensor in weights:
            name = raw.removeprefix("model.")
            if self.tie and name == "lm_head.weight":
                continue
            name = self._our_name(name)
            if ".block_sparse_moe." in name and ".router." not in name:
                self._load_experts(modules, name, tensor)
                continue
            if name.endswith(".shared_mlp.input_linear.weight"):  # [gate rows; up rows], one tensor
                t = materialize(tensor)
                owner = name.removesuffix(".input_linear.weight") + ".gate_up_proj"
                for part, rows in enumerate(t.chunk(2)):
                    modules[owner].load(rows, part)
                    loaded.add((f"{owner}.weight", part))
                continue
            if name.endswith("mixer.conv_weight"):  # [C, 1, K]
                t = materialize(tensor)
                tensor = t.reshape(t.shape[0], t.shape[-1])
            owner, leaf, part = place_tensor(self, modules, params, name, tensor, _FUSED)
            loaded.add((f"{owner}.{leaf}", part))
        check_loaded(self, loaded)

    def _load_experts(self, modules: dict, name: str, tensor) -> None:
        """``block_sparse_moe.input_linear.weight`` (``[E, 2I, H]``: each expert's gate rows, then its
        up rows) and ``...output_linear.weight`` (``[E, H, I]``), or a GGUF's per expert
        ``block_sparse_moe.experts.{e}.gate_proj.weight`` (``up_proj``, ``down_proj``)."""
        head, rest = name.split(".block_sparse_moe.", 1)
        owner = modules.get(head + ".feed_forward.experts")
        if not isinstance(owner, FusedExperts):
            raise KeyError(f"unexpected weight '{name}' for {type(self).__name__} (a dense config)")
        parts = rest.split(".")
        if len(parts) == 4 and parts[0] == "experts" and parts[2] in _EXPERT_PROJ:
            owner.load(tensor, int(parts[1]), _EXPERT_PROJ[parts[2]])
            return
        t = materialize(tensor)
        if name.endswith("output_linear.weight"):
            owner.load_stacked(t, DOWN)
            return
        inter = t.shape[1] // 2
        owner.load_stacked(t[:, :inter], GATE)
        owner.load_stacked(t[:, inter:], UP)
