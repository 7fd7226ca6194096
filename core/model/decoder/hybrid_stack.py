"""The Qwen hybrid decoder shared by Qwen3.5 (dense and MoE) and Qwen3-Next: Gated DeltaNet layers
(``core/model/hybrid/gated_deltanet.py``) and gated full-attention layers, in the order
``config.layer_types`` gives (else every ``full_attention_interval``-th layer is attention).

The attention layers are Qwen3's with a sigmoid output gate (``q_proj`` yields each head's query and
gate side by side) and rotary embeddings on the first ``partial_rotary_factor`` of each head
(M-RoPE's sections coincide for text). Every RMSNorm but the DeltaNet's gated one scales by
``1 + weight``: the ones are added at load, so the shared norm kernels run them. Only attention
layers have K/V in the paged pool; DeltaNet layers keep their state in the state pool
(``core/kvcache/state_pool.py``). A family plugin sets :attr:`HybridLM.sparse_mlp` and converts its
checkpoint's own tensor layouts in :meth:`HybridLM.convert`.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.model.decoder.shared_expert_moe import SharedExpertMoE
from llmkit.core.model.decoder.stack import MLP, StackedLM
from llmkit.core.model.decoder.weight_placement import place_tensor
from llmkit.core.model.hot_module import HotModule
from llmkit.core.model.hybrid.gated_deltanet import GatedDeltaNet
from llmkit.core.model.layers import RMSNorm, RotaryEmbedding
from llmkit.core.model.linear import Linear, VocabEmbedding
from llmkit.core.model.loader.source import materialize
from llmkit.core.model.moe import FusedExperts

FULL, LINEAR = "full_attention", "linear_attention"


def layer_types(config: dict) -> list[str]:
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        every = int(config.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]
    if len(types) != n or set(types) - {FULL, LINEAR}:
        raise ValueError(f"layer_types must name {n} layers, each '{FULL}' or '{LINEAR}': {types}")
    return list(types)


class GatedAttention(HotModule):
    """Full attention with per-head Q/K norms, partial rotary embeddings and a sigmoid output gate;
    ``kv_id``: its index among the model's attention layers (its K/V in the pool)."""

    def __init__(self, config: dict, kv_id: int, head_dim: int, rotary_dim: int, tp=None):
        super().__init__()
        self.kv_id = kv_id
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        hidden, bias = config["hidden_size"], bool(config.get("attention_bias", False))
        q, kv = heads * head_dim, kv_heads * head_dim
        self.qkv_proj = Linear(
            hidden,
            2 * q + 2 * kv,
            bias=bias,
            parallel="column",
            parts=[(2 * q, heads), (kv, kv_heads), (kv, kv_heads)],
            tp=tp,
        )
        self.o_proj = Linear(q, hidden, bias=bias, parallel="row", in_units=heads, tp=tp)
        # this rank's heads
        self.num_heads = heads * self.o_proj.local_in // q
        self.num_kv_heads = (self.qkv_proj.local_out - 2 * self.num_heads * head_dim) // (2 * head_dim)
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)

    def _rotate(self, x, rope):
        if self.rotary_dim == self.head_dim:
            return RotaryEmbedding.rotate(x, rope)
        r = self.rotary_dim
        return torch.cat([RotaryEmbedding.rotate(x[..., :r].contiguous(), rope), x[..., r:]], dim=-1)

    def forward(self, x, rope, ctx: ForwardContext):
        det = ctx.deterministic
        n, h, d, hkv = x.shape[0], self.num_heads, self.head_dim, self.num_kv_heads
        q_gate, k, v = self.qkv_proj(x, det).split([2 * h * d, hkv * d, hkv * d], dim=-1)
        q_gate = q_gate.view(n, h, 2 * d)
        q, gate = q_gate[..., :d], q_gate[..., d:].reshape(n, h * d)
        q = self._rotate(self.q_norm(q.contiguous()), rope)
        k = self._rotate(self.k_norm(k.reshape(n, hkv, d)), rope)
        o = ctx.attn.forward(q, k, v.reshape(n, hkv, d), self.kv_id, ctx.metadata)
        return self.o_proj(o.reshape(n, h * d) * torch.sigmoid(gate), det)


class HybridBlock(HotModule):
    """A pre-norm block whose token mixer (``self.mixer``) is attention or a Gated DeltaNet."""

    def __init__(self, config: dict, mixer: nn.Module, mlp: nn.Module):
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.mixer = mixer
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp

    def forward(self, x, residual, rope, ctx):
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.mixer(h, rope, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, ctx.deterministic), residual


_FUSED = {
    "in_proj_q": ("in_proj", 0),
    "in_proj_k": ("in_proj", 1),
    "in_proj_v": ("in_proj", 2),
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "in_proj_z": ("in_proj", 3),
    "in_proj_b": ("in_proj", 4),
    "in_proj_a": ("in_proj", 5),
}
_DELTANET_PARAMS = ("mixer.conv1d.weight", "mixer.dt_bias", "mixer.A_log")
_EXPERT_PROJ = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}  # (moe.GATE, UP, DOWN)


class HybridLM(StackedLM):
    supports_feature_capture = False
    supports_tp = True
    #: the feed-forward of a layer: False for every layer dense; True: sparse where the config's
    #: ``num_experts``, ``decoder_sparse_step`` and ``mlp_only_layers`` say (a shared-expert MoE)
    sparse_mlp = False
    #: checkpoint weights this text model does not use: a vision tower (an image-text checkpoint
    #: served as text; ``qwen3_5.py``'s image-text classes load it) and the multi-token-prediction head
    skipped = ("visual.", "mtp.")

    def __init__(self, config: dict, tp=None) -> None:
        super().__init__(config, tp)
        self.types = layer_types(config)
        hidden = config["hidden_size"]
        self.embed_tokens = VocabEmbedding(config["vocab_size"], hidden, self.tp)
        params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
        rotary = int(self.head_dim * float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1))))
        blocks, kv_id, state_id = [], 0, 0
        for i, kind in enumerate(self.types):
            if kind == FULL:
                mixer = GatedAttention(config, kv_id, self.head_dim, rotary, self.tp)
                kv_id += 1
            else:
                mixer = GatedDeltaNet(config, state_id, self.tp)
                state_id += 1
            blocks.append(HybridBlock(config, mixer, self.build_mlp(i)))
        self.layers = nn.ModuleList(blocks)
        self.finish_stack(config.get("rms_norm_eps", 1e-6), rotary)

    def build_mlp(self, layer_id: int) -> nn.Module:
        c = self.config
        experts = int(c.get("num_experts") or 0)
        step = int(c.get("decoder_sparse_step", 1) or 1)
        if (
            self.sparse_mlp
            and experts
            and layer_id not in (c.get("mlp_only_layers") or [])
            and (layer_id + 1) % step == 0
        ):
            return SharedExpertMoE(c, self.tp)
        return MLP(c["hidden_size"], c["intermediate_size"], self.tp)

    @property
    def num_kv_layers(self) -> int:
        return self.types.count(FULL)

    def _attention(self) -> GatedAttention:
        return next(layer.mixer for layer in self.layers if isinstance(layer.mixer, GatedAttention))

    @property
    def local_kv_heads(self) -> int:
        return self._attention().num_kv_heads

    @property
    def local_heads(self) -> int:
        return self._attention().num_heads

    def state_specs(self, dtype: torch.dtype):
        return [layer.mixer.state_spec(dtype) for layer in self.layers if isinstance(layer.mixer, GatedDeltaNet)]

    # -- weights -----------------------------------------------------------------------------
    def convert(self, name: str, tensor) -> Iterator[tuple[str, object]]:
        """A checkpoint tensor in this family's own layout as the tensors the layers load (by
        default itself); ``name`` has its ``model.`` prefixes removed."""
        yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._native_plan = False
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        # (the LM head's and the experts' parameters are their own: checked by name and by the experts)
        expected = {"lm_head.weight" if p.startswith("lm_head.") else p for p in params if ".experts." not in p}
        loaded = {"lm_head.weight"} if self.tie else set()
        for raw, tensor in weights:
            name = raw.removeprefix("model.").removeprefix("language_model.")
            if name.startswith(self.skipped) or (self.tie and name == "lm_head.weight"):
                continue
            name = name.replace(".self_attn.", ".mixer.").replace(".linear_attn.", ".mixer.")
            for name, tensor in _split_qkv(self.convert(name, tensor), self.config):
                if ".mlp.experts." in name:
                    self._load_expert(modules, name, tensor)
                    continue
                if name.endswith(_DELTANET_PARAMS):  # (this rank's channels or heads of them)
                    owner, leaf = name.removesuffix(".weight").rsplit(".", 1)
                    leaf = "conv_weight" if leaf == "conv1d" else leaf
                    if not isinstance(modules.get(owner), GatedDeltaNet):
                        raise KeyError(
                            f"unexpected weight '{raw}' for {type(self).__name__}: a DeltaNet's, on a layer the "
                            "config's layer_types makes full attention"
                        )
                    modules[owner].load_param(leaf, materialize(tensor))
                    loaded.add(f"{owner}.{leaf}")
                    continue
                if _zero_centred(name):
                    tensor = materialize(tensor).float() + 1.0
                owner, leaf, _ = place_tensor(self, modules, params, name, tensor, _FUSED)
                loaded.add(f"{owner}.{leaf}")
        missing = sorted(p for p in expected if p not in loaded)
        for mname, module in modules.items():
            if isinstance(module, FusedExperts):
                missing += [f"{mname}.{m}" for m in module.missing()]
        if missing:
            raise KeyError(f"checkpoint is missing weights: {missing[:5]}")

    def _load_expert(self, modules: dict, name: str, tensor) -> None:
        """``layers.N.mlp.experts.{e}.gate_proj.weight`` (per expert) or ``...experts.gate_up_proj``
        / ``...experts.down_proj`` (stacked ``[E, out, in]``, transformers' layout)."""
        head, rest = name.split(".experts.", 1)
        owner = modules.get(head + ".experts")
        if not isinstance(owner, FusedExperts):
            raise KeyError(f"unexpected weight '{name}' for {type(self).__name__}")
        parts = rest.split(".")
        if len(parts) == 3 and parts[1] in _EXPERT_PROJ:
            owner.load(tensor, int(parts[0]), _EXPERT_PROJ[parts[1]])
        elif parts == ["gate_up_proj"]:
            t = materialize(tensor)
            inter = t.shape[1] // 2
            owner.load_stacked(t[:, :inter], 0)
            owner.load_stacked(t[:, inter:], 1)
        elif parts == ["down_proj"]:
            owner.load_stacked(tensor, 2)
        else:
            raise KeyError(f"unexpected weight '{name}' for {type(self).__name__}")


def _split_qkv(tensors, config: dict):
    """A DeltaNet's ``in_proj_qkv`` as its query, key and value rows (three parts of the fused
    projection, each split by heads under tensor parallelism); the other tensors as they come."""
    for name, tensor in tensors:
        if not name.endswith("in_proj_qkv.weight"):
            yield name, tensor
            continue
        key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        t = materialize(tensor)
        base = name[: -len("in_proj_qkv.weight")]
        yield base + "in_proj_q.weight", t[:key]
        yield base + "in_proj_k.weight", t[key : 2 * key]
        yield base + "in_proj_v.weight", t[2 * key :]


def _zero_centred(name: str) -> bool:
    """The RMSNorms that scale by ``1 + weight`` (all but the DeltaNet's gated norm)."""
    return name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "norm.weight"
