"""Gemma 3: ``Gemma3ForCausalLM`` (text, model_type ``gemma3_text``) and
``Gemma3ForConditionalGeneration`` (images in, text out, model_type ``gemma3``).

The text stack differs from Llama's in:
- embeddings scaled by ``sqrt(hidden)`` (the scale cast to the model dtype first, as transformers);
- Gemma's RMSNorm ``norm(x) * (1 + w)`` computed in fp32, on Q and K per head too, and four norms a
  layer: input, post-attention (on the attention output, before the residual add), pre- and
  post-feedforward;
- a GELU-tanh gated MLP and the softmax scale ``query_pre_attn_scalar ** -0.5``;
- interleaved layers (``layer_types``): sliding-window ones rotate with the local rope base
  (``rope_local_base_freq``), full-attention ones with the global rope and its scaling.

The multimodal model puts a SigLIP vision tower and Gemma's projector (average pool to
``mm_tokens_per_image`` rows, soft-embedding RMSNorm, a projection) in front of that stack. Image
rows replace the (unscaled) embeddings of their pseudo-ids, and attend to their whole image both
ways (the ``bidirectional_spans`` attention feature).
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.attention import BIDIRECTIONAL_SPANS, SLIDING_WINDOW
from llmkit.core.model.causal_lm import CausalLM, ForwardContext
from llmkit.core.model.layers import RotaryEmbedding
from llmkit.core.model.linear import Linear, LMHead, VocabEmbedding
from llmkit.core.model.loader.source import materialize
from llmkit.core.model.parallel import TPGroup
from llmkit.core.multimodal.items import ImageItem, MultimodalInputs
from llmkit.core.multimodal.model import VisionLanguageModel
from llmkit.core.multimodal.processor import MultimodalProcessor
from llmkit.plugins.models.decoder import place_tensor

LAYER_TYPES = ("sliding_attention", "full_attention")

# transformers' Gemma3TextConfig defaults: published multimodal checkpoints spell out only a few
# fields of their text_config and rely on these for the rest
TEXT_DEFAULTS = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    sliding_window_pattern=6,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
    tie_word_embeddings=True,
)
# SiglipVisionConfig's defaults, with Gemma 3's (so400m at 896 px) where its configs omit them
VISION_DEFAULTS = dict(
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_channels=3,
    image_size=896,
    patch_size=14,
    layer_norm_eps=1e-6,
    hidden_act="gelu_pytorch_tanh",
)


def text_config(config: dict) -> dict:
    """The text stack's settings, defaults filled in (an explicit null too, where one would not run)."""
    c = {**TEXT_DEFAULTS, **config}
    for key in ("rope_theta", "rope_local_base_freq", "query_pre_attn_scalar", "rms_norm_eps"):
        if c[key] is None:
            c[key] = TEXT_DEFAULTS[key]
    c["num_key_value_heads"] = c["num_key_value_heads"] or c["num_attention_heads"]
    c["head_dim"] = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    c["max_position_embeddings"] = c["max_position_embeddings"] or TEXT_DEFAULTS["max_position_embeddings"]
    return c


def layer_types(config: dict) -> list[str]:
    n, pattern = int(config["num_hidden_layers"]), int(config.get("sliding_window_pattern") or 6)
    return list(config.get("layer_types") or [LAYER_TYPES[(i + 1) % pattern == 0] for i in range(n)])


def rope_configs(config: dict) -> dict[str, dict]:
    """Per layer type, a config :class:`RotaryEmbedding` reads: ``rope_parameters`` keyed by layer
    type (transformers 5's configs), else the global ``rope_theta`` with ``rope_scaling`` and the
    local ``rope_local_base_freq`` (the published checkpoints')."""
    params = config.get("rope_parameters") or {}
    full, local = params.get("full_attention"), params.get("sliding_attention")
    if full is None:
        full = {**(config.get("rope_scaling") or {}), "rope_theta": float(config["rope_theta"])}
    if local is None:
        local = {"rope_type": "default", "rope_theta": float(config["rope_local_base_freq"])}
    mpe = int(config["max_position_embeddings"])
    return {
        "full_attention": {"rope_parameters": full, "max_position_embeddings": mpe},
        "sliding_attention": {"rope_parameters": local, "max_position_embeddings": mpe},
    }


def check_text_config(config: dict) -> None:
    """Refuse variants this implementation does not run, naming the field."""
    if config.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported for Gemma 3 (Gemma 2's attention softcap)")
    if config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an embedding model) is not supported for generation")
    act = config.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation '{act}' is not supported for Gemma 3; supported: gelu_pytorch_tanh")
    for i, kind in enumerate(layer_types(config)):
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] '{kind}' is not one of {', '.join(LAYER_TYPES)}")


class GemmaRMSNorm(nn.Module):
    """``norm(x) * (1 + weight)`` in fp32, cast back to ``x``'s dtype (the weight is zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: dict, layer_id: int, tp: TPGroup):
        super().__init__()
        self.layer_id = layer_id
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        hidden, d = config["hidden_size"], config["head_dim"]
        q, kv = heads * d, kv_heads * d
        bias = bool(config.get("attention_bias", False))
        parts = [(q, heads), (kv, kv_heads), (kv, kv_heads)]
        self.qkv_proj = Linear(hidden, q + 2 * kv, bias=bias, parallel="column", parts=parts, tp=tp)
        self.o_proj = Linear(q, hidden, bias=bias, parallel="row", in_units=heads, tp=tp)
        self.head_dim = d
        self.num_heads = self.o_proj.local_in // d
        self.num_kv_heads = (self.qkv_proj.local_out - self.num_heads * d) // (2 * d)
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        eps = config["rms_norm_eps"]
        self.q_norm, self.k_norm = GemmaRMSNorm(d, eps), GemmaRMSNorm(d, eps)
        self.sliding = layer_types(config)[layer_id] == "sliding_attention"
        window = config.get("sliding_window")
        self.sliding_window = int(window) if self.sliding and window else None

    def forward(self, x, rope, ctx: ForwardContext):
        det = ctx.deterministic
        qkv = self.qkv_proj(x, det)
        d = self.head_dim
        q = self.q_norm(qkv[:, : self.q_size].reshape(-1, self.num_heads, d))
        k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, self.num_kv_heads, d))
        v = qkv[:, self.q_size + self.kv_size :].reshape(-1, self.num_kv_heads, d)
        q, k = RotaryEmbedding.rotate(q, rope), RotaryEmbedding.rotate(k, rope)
        if self.sliding_window is None:
            o = ctx.attn.forward(q, k, v, self.layer_id, ctx.metadata)
        else:
            o = ctx.attn.forward(q, k, v, self.layer_id, ctx.metadata, sliding_window=self.sliding_window)
        return self.o_proj(o.reshape(-1, self.q_size), det)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, parallel="column", parts=[(inter, inter)] * 2, tp=tp)
        self.down_proj = Linear(inter, hidden, parallel="row", tp=tp)
        self.inter = self.down_proj.local_in

    def forward(self, x, det: bool):
        gate, up = self.gate_up_proj(x, det).split(self.inter, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up, det)


class DecoderLayer(nn.Module):
    def __init__(self, config: dict, layer_id: int, tp: TPGroup):
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Attention(config, layer_id, tp)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = MLP(hidden, config["intermediate_size"], tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x, rope, ctx: ForwardContext):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, ctx))
        h = self.mlp(self.pre_feedforward_layernorm(x), ctx.deterministic)
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(CausalLM):
    supports_tp = True
    supports_cuda_graph = True
    attention_features = frozenset({SLIDING_WINDOW})

    def __init__(self, config: dict, tp: TPGroup | None = None) -> None:
        config = text_config(config)
        check_text_config(config)
        super().__init__(config, tp)
        tp = self.tp
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        self.embed_tokens = VocabEmbedding(vocab, hidden, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(self.num_layers))
        self.norm = GemmaRMSNorm(hidden, config["rms_norm_eps"])
        self.tie = bool(config.get("tie_word_embeddings", True))
        self.lm_head = LMHead(vocab, hidden, tp, tied=self.embed_tokens if self.tie else None)
        ropes = rope_configs(config)
        d, mpe = self.head_dim, int(config["max_position_embeddings"])
        self.rotary_global = RotaryEmbedding(d, mpe, ropes["full_attention"])
        self.rotary_local = RotaryEmbedding(d, mpe, ropes["sliding_attention"])
        self.embed_scale = float(hidden) ** 0.5
        self._scales: dict[torch.dtype, float] = {}
        self.softcap = config.get("final_logit_softcapping")

    @property
    def head_dim(self) -> int:
        return int(self.config["head_dim"])

    @property
    def attention_scale(self) -> float:
        return float(self.config["query_pre_attn_scalar"]) ** -0.5

    @property
    def local_heads(self) -> int:
        return self.layers[0].self_attn.num_heads

    @property
    def local_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings times ``sqrt(hidden)``, the scale rounded to the model dtype first (a
        Python number: no host-to-device copy in a captured CUDA graph; the product rounds as
        transformers' tensor product does, both factors being of the dtype)."""
        x = self.embed_tokens(input_ids)
        scale = self._scales.get(x.dtype)
        if scale is None:
            scale = self._scales[x.dtype] = torch.tensor(self.embed_scale).to(x.dtype).item()
        return x * scale

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ropes = {
            True: self.rotary_local.table(positions, x.dtype),
            False: self.rotary_global.table(positions, x.dtype),
        }
        for layer in self.layers:
            x = layer(x, ropes[layer.self_attn.sliding], ctx)
        return self.norm(x)

    def forward(self, input_ids, positions, ctx):
        return self.run_layers(self.embed(input_ids), positions, ctx)

    def compute_logits(self, hidden, deterministic=False):
        logits = self.lm_head(hidden, deterministic)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def load_tensor(self, modules: dict, params: dict, name: str, tensor) -> str:
        """One text-stack tensor (named as in ``Gemma3TextModel``, ``lm_head.weight`` aside) into
        place; returns the name of what it filled, for the missing-weights check."""
        return ".".join(map(str, place_tensor(self, modules, params, name, tensor, self._FUSED)))

    def expected_weights(self) -> set[str]:
        out = set()
        for mname, module in self.named_modules():
            if isinstance(module, Linear):
                out |= {f"{mname}.weight.{p}" for p in range(len(module._row_map))}
                if module.bias is not None:
                    out |= {f"{mname}.bias.{p}" for p in range(len(module._row_map))}
            elif isinstance(module, GemmaRMSNorm) or (
                isinstance(module, VocabEmbedding) and not mname.endswith(".proj")
            ):
                out.add(f"{mname}.weight.0")
            elif isinstance(module, LMHead) and module.tied is None:
                out.add(f"{mname}.weight.0")
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        modules, params = dict(self.named_modules()), dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if self.tie and name == "lm_head.weight":
                continue
            loaded.add(self.load_tensor(modules, params, name, tensor))
        missing = sorted(self.expected_weights() - loaded)
        if missing:
            raise KeyError(f"checkpoint is missing weights: {missing[:5]}")


# --- the vision tower (SigLIP) and the projector --------------------------------------------------


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv_proj(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(o.transpose(1, 2).reshape(b, n, -1))


class VisionLayer(nn.Module):
    def __init__(self, vc: dict):
        super().__init__()
        hidden, eps = vc["hidden_size"], vc["layer_norm_eps"]
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = VisionAttention(hidden, vc["num_attention_heads"])
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.fc1 = nn.Linear(hidden, vc["intermediate_size"])
        self.fc2 = nn.Linear(vc["intermediate_size"], hidden)

    def forward(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class VisionTower(nn.Module):
    """SigLIP's vision transformer without its pooling head: patches (the stride-``patch`` conv as
    one linear layer over flattened patches), learned position embeddings, pre-LN layers, a final
    LayerNorm."""

    def __init__(self, vc: dict):
        super().__init__()
        hidden, self.patch = vc["hidden_size"], int(vc["patch_size"])
        self.channels = int(vc.get("num_channels") or 3)
        self.grid = int(vc["image_size"]) // self.patch
        self.patch_embedding = nn.Linear(self.channels * self.patch * self.patch, hidden)
        self.position_embedding = nn.Parameter(torch.zeros(self.grid * self.grid, hidden), requires_grad=False)
        self.layers = nn.ModuleList(VisionLayer(vc) for _ in range(int(vc["num_hidden_layers"])))
        self.post_layernorm = nn.LayerNorm(hidden, eps=vc["layer_norm_eps"])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels [N, C, H, W]`` (H = W = image_size) -> ``[N, patches, hidden]``, patches row-major."""
        b, c, p, g = pixels.shape[0], self.channels, self.patch, self.grid
        if tuple(pixels.shape[1:]) != (c, g * p, g * p):
            raise ValueError(f"pixel_values of shape {tuple(pixels.shape)}; expected [N, {c}, {g * p}, {g * p}]")
        patches = pixels.reshape(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * p * p)
        x = self.patch_embedding(patches) + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Projector(nn.Module):
    """``Gemma3MultiModalProjector``: average-pool the patch grid to ``mm_tokens_per_image`` rows,
    RMSNorm them (Gemma's), project to the text width."""

    def __init__(self, vc: dict, hidden: int, tokens: int):
        super().__init__()
        self.grid = int(vc["image_size"]) // int(vc["patch_size"])
        side = math.isqrt(tokens)
        if side * side != tokens or self.grid % side:
            raise ValueError(f"mm_tokens_per_image {tokens} does not pool a {self.grid}x{self.grid} patch grid")
        self.kernel = self.grid // side
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vc["hidden_size"], hidden), requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vc["hidden_size"], vc["layer_norm_eps"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h = x.shape
        grid = x.transpose(1, 2).reshape(b, h, self.grid, self.grid)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).to(x.dtype)


class Gemma3Processor(MultimodalProcessor):
    """Pixels by transformers' ``Gemma3ImageProcessor`` (PIL backend; pan-and-scan off); each
    ``<start_of_image>`` the chat template writes becomes what transformers' ``Gemma3Processor``
    writes: ``\\n\\n<start_of_image>`` + ``<image_soft_token>`` x ``mm_tokens_per_image`` +
    ``<end_of_image>\\n\\n``, the newlines merged with their neighbours as the whole text would
    tokenize (``\\n`` then ``\\n\\n`` is the single token ``\\n\\n\\n``)."""

    def __init__(self, image_processor, tokenizer, config: dict):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.num_tokens = int(config.get("mm_tokens_per_image") or 256)
        self.placeholder_id = int(config.get("boi_token_index", config.get("boi_token_id", 255_999)))
        self.eoi_id = int(config.get("eoi_token_index", config.get("eoi_token_id", 256_000)))
        self.soft_id = int(config.get("image_token_index", config.get("image_token_id", 262_144)))
        self.placeholder_text = tokenizer.convert_ids_to_tokens(self.placeholder_id)
        self._newline_ids: dict[int, int] = {}  # token id -> its number of newlines (tokens of only "\n")

    def preprocess(self, image) -> ImageItem:
        out = self.image_processor(images=[image.convert("RGB")], do_pan_and_scan=False, return_tensors="pt")
        pixels = out["pixel_values"].float().contiguous()
        digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
        return ImageItem(digest=digest, pixel_values=pixels, num_tokens=self.num_tokens, meta={})

    def _newlines(self, token_id: int) -> int:
        """How many newlines ``token_id`` is made of (0: not a newline-only token)."""
        if token_id not in self._newline_ids:
            text = self.tokenizer.decode([token_id])
            self._newline_ids[token_id] = len(text) if text and set(text) == {"\n"} else 0
        return self._newline_ids[token_id]

    def _encode_newlines(self, n: int) -> list[int]:
        return self.tokenizer.encode("\n" * n, add_special_tokens=False)

    def expand(self, ids: list[int], items: list[ImageItem]) -> tuple[list[int], MultimodalInputs]:
        found = sum(1 for t in ids if t == self.placeholder_id)
        if found != len(items):
            raise ValueError(f"the prompt has {found} image placeholders for {len(items)} images")
        out: list[int] = []
        spans: list[tuple[int, int]] = []
        i = 0
        while i < len(ids):
            if ids[i] != self.placeholder_id:
                out.append(ids[i])
                i += 1
                continue
            # "\n\n" before <start_of_image>, merged with the newline tokens just before it
            n = 2
            while out and self._newlines(out[-1]):
                n += self._newlines(out.pop())
            out += self._encode_newlines(n)
            out.append(self.placeholder_id)
            spans.append((len(out), self.num_tokens))
            out += [self.soft_id] * self.num_tokens
            out.append(self.eoi_id)
            # "\n\n" after <end_of_image>, merged with the newline tokens just after it
            i, n = i + 1, 2
            while i < len(ids) and ids[i] != self.placeholder_id and self._newlines(ids[i]):
                n += self._newlines(ids[i])
                i += 1
            out += self._encode_newlines(n)
        return out, MultimodalInputs(items=list(items), spans=spans, rope_positions=None, bidirectional=True)


class Gemma3ForConditionalGeneration(VisionLanguageModel, CausalLM):
    supports_tp = False  # the vision tower runs whole on every rank: not sharded yet
    supports_cuda_graph = True
    attention_features = frozenset({SLIDING_WINDOW, BIDIRECTIONAL_SPANS})

    def __init__(self, config: dict, tp: TPGroup | None = None) -> None:
        super().__init__(config, tp)
        tc = dict(config.get("text_config") or {})
        tc.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
        self.language_model = Gemma3ForCausalLM(tc, self.tp)
        self.text = self.language_model.config
        self.vision = {
            **VISION_DEFAULTS,
            **{k: v for k, v in (config.get("vision_config") or {}).items() if v is not None},
        }
        self.mm_tokens = int(config.get("mm_tokens_per_image") or 256)
        self.vision_tower = VisionTower(self.vision)
        self.multi_modal_projector = Projector(self.vision, self.text["hidden_size"], self.mm_tokens)

    @classmethod
    def processor(cls, model_dir: str, config: dict, tokenizer) -> MultimodalProcessor:
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        image_processor = Gemma3ImageProcessorPil.from_pretrained(str(model_dir))
        return Gemma3Processor(image_processor, tokenizer, config)

    # the KV cache and attention backend are the text stack's
    @property
    def num_layers(self) -> int:
        return self.language_model.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.language_model.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.language_model.head_dim

    @property
    def local_heads(self) -> int:
        return self.language_model.local_heads

    @property
    def local_kv_heads(self) -> int:
        return self.language_model.local_kv_heads

    @property
    def attention_scale(self) -> float:
        return self.language_model.attention_scale

    @property
    def vocab_size(self) -> int:
        return int(self.text["vocab_size"])

    def encode_images(self, items: list[ImageItem]) -> list[torch.Tensor]:
        if not items:
            return []
        param = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.cat([it.pixel_values.reshape(-1, *it.pixel_values.shape[-3:]) for it in items])
        with torch.inference_mode():
            rows = self.multi_modal_projector(self.vision_tower(pixels.to(param.device, param.dtype)))
        return list(rows.unbind(0))

    def forward(self, input_ids, positions, ctx):
        lm, mm = self.language_model, ctx.mm
        if mm is None:
            return lm.run_layers(lm.embed(input_ids), positions, ctx)
        mask = mm.mask.to(input_ids.device)
        # image rows carry pseudo-ids: look up id 0 there, then take the encoder's rows (unscaled)
        x = lm.embed(input_ids.masked_fill(mask, 0))
        x = x.index_put((mask,), mm.embeds.to(x.device, x.dtype))
        return lm.run_layers(x, positions, ctx)

    def compute_logits(self, hidden, deterministic=False):
        return self.language_model.compute_logits(hidden, deterministic)

    @staticmethod
    def _canonical(name: str) -> str:
        """transformers 5's names (``model.language_model.*``, ``model.vision_tower.*``) and the
        published checkpoints' (``language_model.model.*``, ``vision_tower.*``) to this module's."""
        name = name.removeprefix("model.")
        if name.startswith("language_model.model."):
            return "language_model." + name.removeprefix("language_model.model.")
        if name == "language_model.lm_head.weight":
            return "lm_head.weight"
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        lm = self.language_model
        lm_modules, lm_params = dict(lm.named_modules()), dict(lm.named_parameters())
        vision_params = {n: p for n, p in self.named_parameters() if not n.startswith("language_model.")}
        loaded, seen = set(), set()
        qkv: dict[str, dict[str, torch.Tensor]] = {}  # vision attention: q/k/v waiting for each other
        for name, tensor in weights:
            name = self._canonical(name)
            if name == "lm_head.weight":
                if not lm.tie:
                    loaded.add(lm.load_tensor(lm_modules, lm_params, name, tensor))
                continue
            if name.startswith("language_model."):
                loaded.add(lm.load_tensor(lm_modules, lm_params, name.removeprefix("language_model."), tensor))
                continue
            name = name.replace("vision_tower.vision_model.", "vision_tower.")
            name = name.replace("vision_tower.encoder.layers.", "vision_tower.layers.")
            name = name.replace("vision_tower.embeddings.", "vision_tower.")
            name = name.replace(".mlp.fc", ".fc")
            if name.startswith("vision_tower.head."):
                continue  # SigLIP's pooling head: Gemma 3 reads the patches before it
            tensor = materialize(tensor)
            parts = name.split(".")
            if parts[-2] in ("q_proj", "k_proj", "v_proj"):
                key = ".".join(parts[:-2]) + ".qkv_proj." + parts[-1]
                qkv.setdefault(key, {})[parts[-2]] = tensor
                if len(qkv[key]) < 3:
                    continue
                group = qkv.pop(key)
                name, tensor = key, torch.cat([group["q_proj"], group["k_proj"], group["v_proj"]])
            elif name == "vision_tower.patch_embedding.weight":
                tensor = tensor.reshape(tensor.shape[0], -1)
            elif name == "vision_tower.position_embedding.weight":
                name = "vision_tower.position_embedding"
            if name not in vision_params:
                raise KeyError(f"unexpected weight '{name}' for {type(self).__name__}")
            vision_params[name].data.copy_(tensor)
            seen.add(name)
        missing = sorted(lm.expected_weights() - loaded) + sorted(set(vision_params) - seen)
        if missing:
            raise KeyError(f"checkpoint is missing weights: {missing[:5]}")
