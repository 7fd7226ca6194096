"""Gemma 3's image half: the SigLIP vision tower, Gemma's projector, the processor and
``Gemma3ForConditionalGeneration``, which puts them in front of the text stack (``core/model/gemma3/text.py``).
Image rows replace the (unscaled) embeddings of their pseudo-ids, and attend to their whole image
both ways (the ``bidirectional_spans`` attention feature)."""

from __future__ import annotations

import hashlib
import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.attention import BIDIRECTIONAL_SPANS, SLIDING_WINDOW
from llmkit.core.model.causal_lm import CausalLM
from llmkit.core.model.gemma3.text import Gemma3TextModel, GemmaRMSNorm
from llmkit.core.model.loader.source import materialize
from llmkit.core.model.parallel import TPGroup
from llmkit.core.multimodal.items import ImageItem, MultimodalInputs
from llmkit.core.multimodal.model import VisionLanguageModel
from llmkit.core.multimodal.processor import MultimodalProcessor

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
        size = getattr(image_processor, "size", None) or {}
        self._size = (int(size.get("width") or 896), int(size.get("height") or 896))  # every image, resized
        self.max_pixels = self._size[0] * self._size[1]

    def target_size(self, width: int, height: int) -> tuple[int, int] | None:
        return self._size if getattr(self.image_processor, "do_resize", True) else None

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
        self.language_model = Gemma3TextModel(tc, self.tp)
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
    def kv_windows(self) -> list[int | None]:
        return self.language_model.kv_windows

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
