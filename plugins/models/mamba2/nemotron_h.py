"""Nemotron-H (``NemotronHForCausalLM``, NVIDIA): a hybrid whose every block is one pre-norm mixer
with a residual around it, the mixer being, as the layer pattern says, Mamba2
(``core/model/hybrid/mamba2.py``, its state the convolution's last inputs and an SSM matrix per
head), grouped-query attention without positional embeddings, a ReLU² feed-forward, or a routed
MoE of ReLU² experts with a shared one. Only attention layers have K/V in the paged pool; the
Mamba2 layers keep their state in the state pool (``core/kvcache/state_pool.py``)."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.decoder.nope_attention import NoPEAttention
from llmkit.core.model.decoder.stack import StackedLM
from llmkit.core.model.decoder.weight_placement import check_loaded, place_tensor
from llmkit.core.model.hot_module import HotModule
from llmkit.core.model.hybrid.mamba2 import Mamba2, time_step_limit
from llmkit.core.model.layers import RMSNorm
from llmkit.core.model.linear import Linear, VocabEmbedding
from llmkit.core.model.loader.source import materialize
from llmkit.core.model.moe import DOWN, UP, FusedExperts, grouped_topk

MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
#: the layer kinds' names in ``layers_block_type`` (transformers' and NVIDIA's own) as pattern letters
_KIND_NAMES = {
    "linear_attention": MAMBA,
    "mamba": MAMBA,
    "full_attention": ATTENTION,
    "attention": ATTENTION,
    "mlp": MLP,
    "moe": MOE,
}
_KIND_WORDS = {MAMBA: "mamba", ATTENTION: "attention", MLP: "mlp", MOE: "moe"}


def nemotron_h_config(config: dict) -> dict:
    """``config`` as transformers' ``NemotronHConfig`` reads it, in the keys this plugin reads: the
    layer pattern (``hybrid_override_pattern``, or ``layers_block_type`` in either vocabulary) as
    letters, its length as ``num_hidden_layers``, the Mamba2 sizes under their current names (the
    older ``mamba_*`` aliases accepted), ``layer_norm_epsilon`` as ``rms_norm_eps``."""
    c = dict(config)
    types = c.get("layers_block_type") or c.get("layer_types")
    if types is not None:
        bad = [t for t in types if t not in _KIND_NAMES]
        if bad:
            raise ValueError(f"layers_block_type: unknown layer kinds {bad} (known: {sorted(_KIND_NAMES)})")
        pattern = "".join(_KIND_NAMES[t] for t in types)
    else:
        pattern = c.get("hybrid_override_pattern")
        if pattern is None:
            raise ValueError("a Nemotron-H config names its layers in hybrid_override_pattern or layers_block_type")
        if set(pattern) - set(_KIND_WORDS):
            raise ValueError(f"hybrid_override_pattern {pattern!r}: each layer is one of M * - E")
    c["hybrid_override_pattern"] = pattern
    c["num_hidden_layers"] = len(pattern)
    for old, new in (
        ("mamba_n_groups", "n_groups"),
        ("mamba_d_conv", "conv_kernel"),
        ("mamba_conv_bias", "use_conv_bias"),
        ("mamba_chunk_size", "chunk_size"),
        ("mamba_dt_limit", "time_step_limit"),
    ):
        if old in c and new not in c:
            c[new] = c.pop(old)
    c["rms_norm_eps"] = float(c.get("layer_norm_epsilon", c.get("rms_norm_eps", 1e-5)))
    c["head_dim"] = int(
        c.get("head_dim") or c.get("attention_head_dim") or c["hidden_size"] // c["num_attention_heads"]
    )
    for key, served in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if c.get(key, served) != served:
            raise ValueError(f"Nemotron-H: {key} {c[key]!r} is not served ({served} is)")
    return c


class ReluSquaredMLP(HotModule):
    """``down(relu(up(x))²)``: no gate."""

    def __init__(self, hidden: int, inter: int, bias: bool):
        super().__init__()
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)

    def forward(self, x, rope, ctx):
        det = ctx.deterministic
        return self.down_proj(relu_squared(self.up_proj(x, det)), det)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()


class Router(nn.Module):
    """The MoE router's weight and its selection bias (checkpoint names ``gate.weight``,
    ``gate.e_score_correction_bias``), fp32 whatever the model's dtype, as transformers keeps them:
    near ties between experts must route as they do there."""

    def __init__(self, experts: int, hidden: int):
        super().__init__()
        f32 = dict(dtype=torch.float32)
        self.weight = nn.Parameter(torch.zeros(experts, hidden, **f32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, **f32), requires_grad=False)


class NemotronHMoE(HotModule):
    """Routed ReLU² experts and a shared one: sigmoid scores, experts chosen by score plus the
    correction bias within the best ``topk_group`` of ``n_group`` groups (DeepSeek-V3's routing),
    weights renormalised (``norm_topk_prob``) and scaled by ``routed_scaling_factor``. With a
    ``moe_latent_size`` the routed experts work in a smaller space, projected in and out."""

    def __init__(self, c: dict):
        super().__init__()
        hidden, e = c["hidden_size"], int(c["n_routed_experts"])
        self.top_k = int(c["num_experts_per_tok"])
        self.n_group, self.topk_group = int(c.get("n_group", 1)), int(c.get("topk_group", 1))
        self.renormalize, self.scale = bool(c.get("norm_topk_prob", True)), float(c.get("routed_scaling_factor", 1.0))
        latent, bias = c.get("moe_latent_size"), bool(c.get("mlp_bias", False))
        inner = int(latent or hidden)
        self.gate = Router(e, hidden)
        self.experts = FusedExperts(e, inner, int(c["moe_intermediate_size"]), activation=relu_squared, gated=False)
        self.shared_experts = ReluSquaredMLP(hidden, int(c["moe_shared_expert_intermediate_size"]), bias)
        self.fc1_latent_proj = Linear(hidden, inner, bias=bias) if latent else None
        self.fc2_latent_proj = Linear(inner, hidden, bias=bias) if latent else None

    def forward(self, x, rope, ctx):
        det = ctx.deterministic
        logits = F.linear(x.float(), self.gate.weight)
        weights, ids = grouped_topk(
            logits,
            self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            renormalize=self.renormalize,
            correction_bias=self.gate.e_score_correction_bias,
            scale=self.scale,
        )
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x, det)
        out = self.experts(h, weights, ids, det)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out, det)
        return out + self.shared_experts(x, rope, ctx)


class NemotronHBlock(HotModule):
    """``x + mixer(norm(x))``, the residual sum fused into the next block's norm."""

    def __init__(self, hidden: int, eps: float, mixer: nn.Module):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.mixer = mixer

    def forward(self, x, residual, rope, ctx):
        if residual is None:
            residual, h = x, self.norm(x)
        else:
            h, residual = self.norm(x, residual)
        return self.mixer(h, rope, ctx), residual


_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
#: each kind's mixer weights (inside ``layers.N.mixer.``), to tell a checkpoint's layer kind
_MIXER_WEIGHTS = {
    MAMBA: ("in_proj.", "conv1d.", "dt_bias", "A_log", "D", "norm.", "out_proj."),
    ATTENTION: ("q_proj.", "k_proj.", "v_proj.", "o_proj."),
    MLP: ("up_proj.", "down_proj."),
    MOE: ("experts.", "gate.", "shared_experts.", "fc1_latent_proj.", "fc2_latent_proj."),
}


def _kind_of(leaf: str) -> str | None:
    for kind, names in _MIXER_WEIGHTS.items():
        if any(leaf == n or (n.endswith(".") and leaf.startswith(n)) for n in names):
            return kind
    return None


class NemotronHForCausalLM(StackedLM):
    supports_feature_capture = False

    def __init__(self, config: dict, tp=None) -> None:
        config = nemotron_h_config(config)
        super().__init__(config, tp)
        self.pattern = config["hybrid_override_pattern"]
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.embed_tokens = VocabEmbedding(config["vocab_size"], hidden, self.tp)
        blocks, kv_id, state_id = [], 0, 0
        for kind in self.pattern:
            if kind == ATTENTION:  # kv_id / state_id: its index among the layers of its kind
                mixer = NoPEAttention(config, kv_id, self.head_dim)
                kv_id += 1
            elif kind == MAMBA:
                mixer = self._mamba(config, state_id)
                state_id += 1
            elif kind == MLP:
                mixer = ReluSquaredMLP(hidden, config["intermediate_size"], bool(config.get("mlp_bias", False)))
            else:
                mixer = NemotronHMoE(config)
                self.supports_cuda_graph = False  # FusedExperts groups tokens by expert with host-side counts
            blocks.append(NemotronHBlock(hidden, eps, mixer))
        self.layers = nn.ModuleList(blocks)
        self.finish_stack(eps, self.head_dim)

    @staticmethod
    def _mamba(c: dict, state_id: int) -> Mamba2:
        return Mamba2(
            c["hidden_size"],
            heads=int(c["mamba_num_heads"]),
            head_dim=int(c["mamba_head_dim"]),
            state_size=int(c["ssm_state_size"]),
            groups=int(c.get("n_groups", 8)),
            kernel=int(c.get("conv_kernel", 4)),
            conv_bias=bool(c.get("use_conv_bias", True)),
            proj_bias=bool(c.get("mamba_proj_bias", c.get("use_bias", False))),
            eps=c["rms_norm_eps"],
            state_id=state_id,
            chunk=int(c.get("chunk_size", 128)),
            dt_limit=time_step_limit(c),
        )

    @property
    def num_kv_layers(self) -> int:
        return self.pattern.count(ATTENTION)

    @property
    def local_kv_heads(self) -> int:
        return int(self.config["num_key_value_heads"])

    @property
    def local_heads(self) -> int:
        return int(self.config["num_attention_heads"])

    def state_specs(self, dtype: torch.dtype):
        return [layer.mixer.state_spec(dtype) for layer in self.layers if isinstance(layer.mixer, Mamba2)]

    def forward(self, input_ids, positions, ctx):
        x, residual = self.embed(input_ids, ctx), None
        for layer in self.layers:  # (no rotary table: no layer rotates)
            x, residual = layer(x, residual, None, ctx)
        x, _ = self.norm(x, residual)
        return x

    # -- weights -----------------------------------------------------------------------------
    def _our_name(self, name: str) -> str:
        """A checkpoint name (``backbone.`` / ``model.`` removed) as ours; a layer's mixer weight of
        another kind than its pattern letter is an error naming the layer."""
        if name == "embeddings.weight":
            return "embed_tokens.weight"
        if name == "norm_f.weight":
            return "norm.weight"
        if not name.startswith("layers."):
            return name
        _, idx, rest = name.split(".", 2)
        if int(idx) >= len(self.pattern):
            raise ValueError(f"the checkpoint has weights of layer {idx}, the config {len(self.pattern)} layers")
        if not rest.startswith("mixer."):
            return name
        leaf = rest.removeprefix("mixer.")
        kind, found = self.pattern[int(idx)], _kind_of(leaf)
        if found is not None and found != kind:
            raise ValueError(
                f"layer {idx} is '{_KIND_WORDS[kind]}' in the config's layer pattern, but the checkpoint "
                f"has the '{_KIND_WORDS[found]}' weight '{name}': the config and the weights disagree"
            )
        if kind == MAMBA and leaf == "conv1d.weight":
            return f"layers.{idx}.mixer.conv_weight"
        if kind == MAMBA and leaf == "conv1d.bias":
            return f"layers.{idx}.mixer.conv_bias"
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded = set()
        for raw, tensor in weights:
            name = raw.removeprefix("backbone.").removeprefix("model.")
            if name.startswith("mtp.") or (self.tie and name == "lm_head.weight"):
                continue  # (the multi-token-prediction head is not served)
            name = self._our_name(name)
            if ".mixer.experts." in name:
                self._load_expert(modules, name, tensor)
                continue
            if name.endswith("mixer.conv_weight"):  # [C, 1, K] (a GGUF's squeezed: [C, K])
                t = materialize(tensor)
                tensor = t.reshape(t.shape[0], t.shape[-1])
            owner, leaf, part = place_tensor(self, modules, params, name, tensor, _FUSED)
            loaded.add((f"{owner}.{leaf}", part))
        check_loaded(self, loaded)

    def _load_expert(self, modules: dict, name: str, tensor) -> None:
        """``layers.N.mixer.experts.{e}.up_proj.weight`` / ``...down_proj.weight`` (per expert)."""
        head, rest = name.split(".experts.", 1)
        parts = rest.split(".")
        owner = modules.get(head + ".experts")
        projs = {"up_proj": UP, "down_proj": DOWN}
        if not isinstance(owner, FusedExperts) or len(parts) != 3 or parts[1] not in projs:
            raise KeyError(f"unexpected weight '{name}' for {type(self).__name__}")
        owner.load(tensor, int(parts[0]), projs[parts[1]])
