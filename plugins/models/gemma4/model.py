"""Gemma 4: ``Gemma4ForCausalLM`` (text, model_type ``gemma4_text``) and the text path of
``Gemma4ForConditionalGeneration`` (model_type ``gemma4``: its ``text_config``, weights under
``model.language_model.``; the vision and audio towers' weights are skipped, images and audio
refused).

What differs from Gemma 3 (``core/model/gemma4/``: ``layers.py`` has the layer, ``config.py`` the settings):
- RMSNorm ``norm(x) * w`` (not ``1 + w``), a weightless norm on the values, softmax scale 1 (the
  Q/K norms set the scale);
- 5:1 sliding/full layers whose K/V differ in shape: the full layers have ``global_head_dim``-wide
  heads (and, with ``attention_k_eq_v``, ``num_global_key_value_heads`` of them, K and V one
  projection), rotated by the ``proportional`` rope (a ``partial_rotary_factor`` of the channels).
  The model lists each K/V layer's shape (``kv_layer_shapes``); the pool and the backends follow it;
- K/V sharing: the last ``num_kv_shared_layers`` layers store no K/V and attend over the last
  earlier layer of their type's (``num_kv_layers`` counts the storing ones); with
  ``use_double_wide_mlp`` their MLPs are twice as wide;
- a MoE block beside the dense MLP (``enable_moe_block``), per-layer inputs (E2B/E4B:
  ``hidden_size_per_layer_input``), and a learned scalar on each layer's output.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from llmkit.core.model.attention import SLIDING_WINDOW
from llmkit.core.model.causal_lm import CausalLM, ForwardContext
from llmkit.core.model.decoder.weight_placement import FUSED_PROJECTIONS, check_loaded, place_tensor
from llmkit.core.model.gemma4 import config as cfg
from llmkit.core.model.gemma4.layers import DecoderLayer, Gemma4RMSNorm
from llmkit.core.model.layers import RotaryEmbedding
from llmkit.core.model.linear import Linear, LMHead, VocabEmbedding
from llmkit.core.model.loader.source import materialize
from llmkit.core.model.moe import DOWN, GATE, UP, FusedExperts
from llmkit.core.model.parallel import TPGroup


class Gemma4ForCausalLM(CausalLM):
    supports_tp = True
    supports_cuda_graph = False  # MoE groups tokens on the host; two K/V shapes: two backends
    attention_features = frozenset({SLIDING_WINDOW})

    def __init__(self, config: dict, tp: TPGroup | None = None) -> None:
        c = cfg.text_config(config)
        super().__init__(c, tp)
        tp = self.tp
        hidden, vocab, n = int(c["hidden_size"]), int(c["vocab_size"]), self.num_layers
        self.heads = cfg.layer_heads(c)
        self.sources = cfg.kv_sources(c)
        storing = [i for i in range(n) if self.sources[i] == i]
        kv_index = {layer: j for j, layer in enumerate(storing)}
        self.storing = storing
        self.embed_tokens = VocabEmbedding(vocab, hidden, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(c, i, self.heads[i], kv_index[self.sources[i]], self.sources[i], tp) for i in range(n)
        )
        self.norm = Gemma4RMSNorm(hidden, float(c["rms_norm_eps"]))
        self.tie = bool(c["tie_word_embeddings"])
        self.lm_head = LMHead(vocab, hidden, tp, tied=self.embed_tokens if self.tie else None)
        mpe = int(c["max_position_embeddings"])
        self.rotary = nn.ModuleDict()
        for i, kind in enumerate(c["layer_types"]):
            key = f"{kind}_{self.heads[i][1]}"
            if key not in self.rotary:
                self.rotary[key] = RotaryEmbedding(self.heads[i][1], mpe, cfg.rope_config(c, kind))
        self.rope_of_layer = [f"{kind}_{self.heads[i][1]}" for i, kind in enumerate(c["layer_types"])]
        self._scales: dict[tuple[torch.dtype, float], float] = {}
        self.softcap = c.get("final_logit_softcapping")
        self.ple = int(c.get("hidden_size_per_layer_input") or 0)
        if self.ple:
            self.embed_tokens_per_layer = VocabEmbedding(int(c["vocab_size_per_layer_input"]), n * self.ple, tp)
            self.per_layer_model_projection = Linear(hidden, n * self.ple, parallel="replicated")
            self.per_layer_projection_norm = Gemma4RMSNorm(self.ple, float(c["rms_norm_eps"]))

    # --- the contract ------------------------------------------------------------------------

    @property
    def num_kv_layers(self) -> int:
        return len(self.storing)

    @property
    def kv_layer_shapes(self) -> list[tuple[int, int, int]]:
        """This rank's K/V heads (shared where there are fewer than ranks) and head size, per
        storing layer."""
        attn = [self.layers[i].self_attn for i in self.storing]
        return [(a.num_kv_heads, a.head_dim, a.head_dim) for a in attn]

    @property
    def kv_windows(self) -> list[int | None]:
        """Per storing layer its window (a sharing layer reads its source's pages, same type)."""
        return [self.layers[i].self_attn.sliding_window for i in self.storing]

    @property
    def local_heads(self) -> int:
        return self.layers[0].self_attn.num_heads

    @property
    def local_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return int(self.config["head_dim"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.config["num_key_value_heads"])

    @property
    def attention_scale(self) -> float:
        return 1.0

    # --- forward -----------------------------------------------------------------------------

    def _scaled(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """``x * scale``, the scale rounded to ``x``'s dtype first, as transformers' scaled embeddings."""
        key = (x.dtype, scale)
        if key not in self._scales:
            self._scales[key] = torch.tensor(scale).to(x.dtype).item()
        return x * self._scales[key]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._scaled(self.embed_tokens(input_ids), float(self.config["hidden_size"]) ** 0.5)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """E2B/E4B's per-layer inputs ``[T, layers, ple]``: a token's own embedding row beside a
        projection of its embedding, each normed and scaled as transformers' ``Gemma4TextModel``."""
        n, p = self.num_layers, self.ple
        own = self._scaled(self.embed_tokens_per_layer(input_ids), float(p) ** 0.5).reshape(-1, n, p)
        proj = self.per_layer_model_projection(x) * float(self.config["hidden_size"]) ** -0.5
        proj = self.per_layer_projection_norm(proj.reshape(-1, n, p))
        return (proj + own) * 2.0**-0.5

    def run_layers(self, x, positions, ctx: ForwardContext, per_layer=None) -> torch.Tensor:
        ropes = {key: rope.table(positions, x.dtype) for key, rope in self.rotary.items()}
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, ropes[self.rope_of_layer[i]], ctx, shared, None if per_layer is None else per_layer[:, i])
        return self.norm(x)

    def forward(self, input_ids, positions, ctx):
        x = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, x) if self.ple else None
        return self.run_layers(x, positions, ctx, per_layer)

    def compute_logits(self, hidden, deterministic=False):
        logits = self.lm_head(hidden, deterministic)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    # --- loading -----------------------------------------------------------------------------

    _FUSED = FUSED_PROJECTIONS
    # the projections and norms a K/V-sharing layer has no use for (transformers ignores them too)
    _SHARER_UNUSED = ("self_attn.k_proj", "self_attn.v_proj", "self_attn.k_norm", "self_attn.v_norm")

    def load_tensor(self, modules: dict, params: dict, name: str, tensor) -> tuple | None:
        """One text-stack tensor (named as in ``Gemma4TextModel``) into place; what it filled, or
        None for a tensor with no use here."""
        parts = name.split(".")
        if parts[0] == "layers":
            layer = self.layers[int(parts[1])]
            attn = layer.self_attn
            rest = ".".join(parts[2:-1])
            if attn.shares and rest in self._SHARER_UNUSED:
                return None
            if rest == "self_attn.v_proj" and attn.k_eq_v:
                raise ValueError(f"layer {parts[1]}: a v_proj weight, but attention_k_eq_v says K and V are one")
            if rest == "experts" and isinstance(getattr(layer, "experts", None), FusedExperts):
                return self._load_experts(layer.experts, name, parts[-1], tensor)
        if name.endswith("layer_scalar"):  # a buffer in transformers, a parameter here
            params[name].data.copy_(materialize(tensor).reshape(1))
            return name, "", 0
        return place_tensor(self, modules, params, name, tensor, self._FUSED)

    @staticmethod
    def _load_experts(experts: FusedExperts, name: str, leaf: str, tensor):
        # transformers' layout: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I]
        t = materialize(tensor)
        if leaf == "gate_up_proj":
            inter = t.shape[1] // 2
            experts.load_stacked(t[:, :inter], GATE)
            experts.load_stacked(t[:, inter:], UP)
        elif leaf == "down_proj":
            experts.load_stacked(t, DOWN)
        else:
            raise KeyError(f"unexpected expert tensor '{name}'")
        return name, "", 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        modules, params = dict(self.named_modules()), dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if self.tie and name == "lm_head.weight":
                continue
            self.check_shape(name, tensor)
            filled = self.load_tensor(modules, params, name, tensor)
            if filled is not None:
                loaded.add((f"{filled[0]}.{filled[1]}".rstrip("."), filled[2]))
        loaded |= {(p, 0) for p in params if p.endswith("layer_scalar")}  # (older exports lack it: 1)
        check_loaded(self, loaded)

    def check_shape(self, name: str, tensor) -> None:
        """An attention tensor whose shape disagrees with the layer's heads and head size (the
        window / head table read from the config) fails here, naming the layer."""
        parts = name.split(".")
        if parts[0] != "layers" or len(parts) != 5 or parts[2] != "self_attn" or parts[-1] != "weight":
            return
        i, proj = int(parts[1]), parts[3]
        heads, d = self.heads[i]
        hidden, q = int(self.config["hidden_size"]), int(self.config["num_attention_heads"]) * d
        want = {
            "q_proj": (q, hidden),
            "k_proj": (heads * d, hidden),
            "v_proj": (heads * d, hidden),
            "o_proj": (hidden, q),
            "q_norm": (d,),
            "k_norm": (d,),
        }.get(proj)
        if want is not None and tuple(tensor.shape) != want:
            raise ValueError(
                f"layer {i} ({self.config['layer_types'][i]}): {proj} is {list(tensor.shape)}, but the config's "
                f"layer table gives {list(want)} ({heads} K/V heads of size {d})"
            )


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The multimodal checkpoint's language model (``text_config``; ``model.language_model.``
    weights). Its vision and audio towers are not built here: their weights are skipped."""

    _TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")

    def __init__(self, config: dict, tp: TPGroup | None = None) -> None:
        text = dict(config.get("text_config") or {})
        if "tie_word_embeddings" in config and "tie_word_embeddings" not in text:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        super().__init__(text, tp)
        self.full_config = config

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def text_weights():
            for name, tensor in weights:
                if name.startswith(self._TOWERS):
                    continue
                if name.startswith("model.language_model."):
                    yield "model." + name.removeprefix("model.language_model."), tensor
                elif name == "lm_head.weight":
                    yield name, tensor
                else:
                    raise KeyError(f"unexpected weight '{name}' for {type(self).__name__}")

        super().load_weights(text_weights())
