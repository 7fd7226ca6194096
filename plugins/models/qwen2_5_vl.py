"""``Qwen2_5_VLForConditionalGeneration``: Qwen2.5-VL, images in, text out.

The language model is the Qwen2 decoder (Q/K/V biases) rotating by M-RoPE: every rotary frequency
band reads one of three position axes (``mrope_section`` splits the bands into temporal, height
and width), so an image's tokens sit on a 2-D grid while text tokens, whose three axes are equal,
rotate exactly as with plain rope. The engine hands the per-row (t, h, w) positions and the image
rows in ``ctx.mm``; the rope table built from them has the layout of the plain one, so the fused
and native CPU paths run unchanged.

The vision tower is Qwen2.5-VL's ViT: 14x14 (x2 frames) patches, 2-D rotary over (row, column),
blocks attending within windows of merged cells except the ``fullatt_block_indexes`` ones that
attend over the whole image, RMSNorm and a SwiGLU MLP, then a merger folding each 2x2 block of
patches into one language-model token. The processor's patch order already groups each 2x2 block
together; each attention gathers its frames or windows, batched by size (no reordering).

``QwenVLMixin`` (the image rows, the M-RoPE table, ``encode_images``, both checkpoint layouts) and
``QwenVLProcessor`` serve Qwen3-VL too (``qwen3_vl.py``).
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.model.layers import RMSNorm
from llmkit.core.model.parallel import TPGroup
from llmkit.core.multimodal.items import ImageItem, MultimodalInputs
from llmkit.core.multimodal.model import VisionLanguageModel
from llmkit.core.multimodal.processor import MultimodalProcessor
from llmkit.plugins.models.qwen2 import Qwen2ForCausalLM


def text_config(config: dict) -> dict:
    """The language model's settings at the top level (transformers 5 nests them under
    ``text_config``; older checkpoints keep them flat), with ``vision_config`` and the
    multimodal token ids alongside."""
    text = config.get("text_config") or {}
    out = {**{k: v for k, v in config.items() if k != "text_config"}, **text}
    for key in ("rope_scaling", "rope_parameters"):
        params = out.get(key)
        # transformers 4's checkpoints say {"type": "mrope", "mrope_section": ...}: default rope
        # frequencies, the section says which axis each reads
        if params and (params.get("rope_type") or params.get("type")) == "mrope":
            out[key] = {**{k: v for k, v in params.items() if k != "type"}, "rope_type": "default"}
    return out


def _mrope_section(config: dict) -> list[int]:
    for key in ("rope_parameters", "rope_scaling"):
        section = (config.get(key) or {}).get("mrope_section")
        if section:
            return [int(s) for s in section]
    raise ValueError("the config has no M-RoPE mrope_section (rope_parameters / rope_scaling)")


# ---------------------------------------------------------------------------------------------
# Vision tower


def _act(name: str):
    if name == "silu":
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    return F.gelu


class _PatchEmbed(nn.Module):
    """The (non-overlapping) Conv3d over one patch as one matrix product."""

    def __init__(self, dim: int, in_features_shape: tuple[int, ...]):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(dim, *in_features_shape), requires_grad=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1))


class _VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x, rope, groups: list[torch.Tensor]):
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = _rotate(q, rope), _rotate(k, rope)
        out = torch.empty_like(q)
        for idx in groups:  # [B, s]: B segments (frames or windows) of s patches, attended together
            qs, ks, vs = (t[idx].transpose(1, 2) for t in (q, k, v))
            out[idx] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return self.proj(out.reshape(n, -1))


def _segment_groups(segment: torch.Tensor) -> list[torch.Tensor]:
    """Patches grouped by ``segment`` (their frame's or window's number): per distinct segment
    size s, the ``[B, s]`` indices of the B segments that size, so each attends in one batch."""
    order = torch.argsort(segment, stable=True)
    _, counts = torch.unique_consecutive(segment[order], return_counts=True)
    starts = counts.cumsum(0) - counts
    groups = []
    for size in counts.unique().tolist():
        first = starts[counts == size]
        groups.append(order[first[:, None] + torch.arange(size, device=segment.device)])
    return groups


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half rotary in fp32 with a full-width ``(cos2, sin2 = [-sin, sin])`` table."""
    cos2, sin2 = rope
    xf = x.float()
    return (xf * cos2 + xf.roll(x.shape[-1] // 2, -1) * sin2).to(x.dtype)


class _VisionMLP(nn.Module):
    def __init__(self, dim: int, inter: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=True)
        self.up_proj = nn.Linear(dim, inter, bias=True)
        self.down_proj = nn.Linear(inter, dim, bias=True)
        self.act = _act(act)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _VisionBlock(nn.Module):
    def __init__(self, vc: dict):
        super().__init__()
        dim = int(vc["hidden_size"])
        self.norm1 = RMSNorm(dim, 1e-6)
        self.norm2 = RMSNorm(dim, 1e-6)
        self.attn = _VisionAttention(dim, int(vc["num_heads"]))
        self.mlp = _VisionMLP(dim, int(vc["intermediate_size"]), vc.get("hidden_act", "silu"))

    def forward(self, x, rope, groups):
        x = x + self.attn(self.norm1(x), rope, groups)
        return x + self.mlp(self.norm2(x))


class _PatchMerger(nn.Module):
    def __init__(self, dim: int, out_dim: int, merge: int):
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = RMSNorm(dim, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x):
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


class Qwen2_5_VisionTower(nn.Module):
    """Patches of one or more images (concatenated in the processor's order) -> one row per 2x2
    block of patches, of the language model's width."""

    def __init__(self, vc: dict):
        super().__init__()
        self.patch = int(vc.get("patch_size", 14))
        self.merge = int(vc.get("spatial_merge_size", 2))
        self.window = int(vc.get("window_size", 112))
        self.full_blocks = frozenset(int(i) for i in vc.get("fullatt_block_indexes") or ())
        dim, heads = int(vc["hidden_size"]), int(vc["num_heads"])
        shape = (int(vc.get("in_channels", 3)), int(vc.get("temporal_patch_size", 2)), self.patch, self.patch)
        self.patch_embed = _PatchEmbed(dim, shape)
        self.blocks = nn.ModuleList(_VisionBlock(vc) for _ in range(int(vc["depth"])))
        self.merger = _PatchMerger(dim, int(vc.get("out_hidden_size", dim)), self.merge)
        theta = float((vc.get("rope_parameters") or {}).get("rope_theta", vc.get("rope_theta", 10000.0)))
        half = dim // heads // 2  # each axis rotates half the head: head_dim / 4 frequencies
        inv = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float) / half)
        self.register_buffer("inv_freq", inv, persistent=False)

    def _layout(self, grids: list[tuple[int, int, int]], device):
        """Per patch its (row, column) in its image, its frame's number and its window's."""
        m, ws = self.merge, max(self.window // self.merge // self.patch, 1)
        rows, cols, frames, wins = [], [], [], []
        frame, win_base = 0, 0
        for t, h, w in grids:
            lh, lw = h // m, w // m
            # block-major order: merged cell (r, c), then its m x m patches
            r = torch.arange(lh).view(lh, 1, 1, 1) * m + torch.arange(m).view(1, 1, m, 1)
            c = torch.arange(lw).view(1, lw, 1, 1) * m + torch.arange(m).view(1, 1, 1, m)
            r, c = r.expand(lh, lw, m, m).reshape(-1), c.expand(lh, lw, m, m).reshape(-1)
            per_row = -(-lw // ws)  # windows of ws x ws merged cells, the last ones cut short
            win = (r // m // ws) * per_row + (c // m // ws)
            n_win = -(-lh // ws) * per_row
            for _ in range(t):
                rows.append(r), cols.append(c), wins.append(win + win_base)
                frames.append(torch.full_like(r, frame))
                frame, win_base = frame + 1, win_base + n_win
        return tuple(torch.cat(xs).to(device) for xs in (rows, cols, frames, wins))

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        device = self.inv_freq.device
        x = self.patch_embed(pixels.to(device))
        rows, cols, frames, wins = self._layout(grids, device)
        freqs = torch.cat((rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq), dim=-1)
        cos, sin = freqs.cos(), freqs.sin()
        rope = (torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None])
        full, windowed = _segment_groups(frames), _segment_groups(wins)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, full if i in self.full_blocks else windowed)
        return self.merger(x)


# ---------------------------------------------------------------------------------------------
# The model


def mrope_axis(section: list[int], rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """Per rotary column (cos2/sin2 are ``[cos, cos]`` wide) the position axis (0 t, 1 h, 2 w)
    its frequency reads: contiguous bands (Qwen2-VL, Qwen2.5-VL) or, ``interleaved`` (Qwen3-VL),
    t h w t h w ... over the first ``3 * section[1]`` / ``3 * section[2]`` frequencies.
    ``rotary_dim``: the rotated width (the head's, or its first part under partial rotary)."""
    half = rotary_dim // 2
    if sum(section) != half:
        raise ValueError(f"mrope_section {section} does not cover the rotary width / 2 = {half}")
    if interleaved:
        j = torch.arange(half)
        axis = torch.zeros(half, dtype=torch.long)
        axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    else:
        axis = torch.repeat_interleave(torch.arange(len(section)) % 3, torch.tensor(section))
    return torch.cat((axis, axis))


class QwenVLMixin(VisionLanguageModel):
    """What the Qwen vision-language models add to their text decoder: the image rows in the
    input embeddings, the M-RoPE table, the vision tower (``vision_tower``, built from
    ``vision_config``) and both checkpoint layouts. Listed before the decoder class."""

    vision_tower: type
    mrope_interleaved = False
    supports_tp = False  # the vision tower is not sharded (the decoder would be)

    def __init__(self, config: dict, tp: TPGroup | None = None) -> None:
        config = text_config(config)
        super().__init__(config, tp)
        self.visual = self.vision_tower(config["vision_config"])
        # the sections cover the rotated width: Qwen3.5 rotates only the first part of each head
        axis = mrope_axis(_mrope_section(config), self.rotary.cos2.shape[-1], self.mrope_interleaved)
        self.register_buffer("mrope_axis", axis, persistent=False)

    # --- language model -----------------------------------------------------------------------

    def embed(self, input_ids, ctx: ForwardContext):
        mm = ctx.mm
        if mm is None:
            return self.embed_tokens(input_ids)
        x = self.embed_tokens(input_ids.masked_fill(mm.mask, 0))  # pseudo-ids: never looked up
        if mm.embeds.shape[0]:
            x[mm.mask] = mm.embeds[:, : x.shape[1]].to(x.dtype)  # (wider rows: Qwen3-VL's deepstack)
        return x

    def rope_table(self, positions, ctx: ForwardContext, dtype):
        mm = ctx.mm
        if mm is None or mm.rope_positions is None:
            return self.rotary.table(positions, dtype)
        pos = mm.rope_positions.to(positions.device)  # [3, T]
        n, width = pos.shape[1], self.mrope_axis.shape[0]
        pick = self.mrope_axis.view(1, 1, width).expand(1, n, width)
        cos = self.rotary.cos2[pos].gather(0, pick)[0]
        sin = self.rotary.sin2[pos].gather(0, pick)[0]
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    # --- images -------------------------------------------------------------------------------

    @classmethod
    def processor(cls, model_dir: str, config: dict, tokenizer=None) -> "QwenVLProcessor":
        from transformers import AutoImageProcessor

        return QwenVLProcessor(AutoImageProcessor.from_pretrained(str(model_dir)), config, tokenizer)

    def encode_images(self, items: list[ImageItem]) -> list[torch.Tensor]:
        if not items:
            return []
        grids = [tuple(int(v) for v in item.meta["grid_thw"]) for item in items]
        pixels = torch.cat([item.pixel_values for item in items])
        with torch.inference_mode():
            rows = self.visual(pixels, grids).to(self.embed_tokens.weight.dtype)
        return list(rows.split([item.num_tokens for item in items]))

    # --- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision_params = {name for name, _ in self.visual.named_parameters()}
        seen: set[str] = set()

        def renamed():
            for name, tensor in weights:
                # transformers 5 in memory: model.language_model.* / model.visual.*; on disk (and
                # transformers 4): model.layers.* / visual.*
                if name.startswith("model.language_model."):
                    name = "model." + name.removeprefix("model.language_model.")
                elif name.startswith("model.visual."):
                    name = name.removeprefix("model.")
                if name.startswith("visual."):
                    seen.add(name.removeprefix("visual."))
                    name = "model." + name  # DecoderLM strips "model."
                yield name, tensor

        super().load_weights(renamed())
        missing = sorted(vision_params - seen)
        if missing:
            raise KeyError(f"checkpoint is missing vision weights: {missing[:5]}")


class Qwen2_5_VLForConditionalGeneration(QwenVLMixin, Qwen2ForCausalLM):
    vision_tower = Qwen2_5_VisionTower


# ---------------------------------------------------------------------------------------------
# The processor


class QwenVLProcessor(MultimodalProcessor):
    """Pixels by transformers' ``Qwen2VLImageProcessor`` (resized to multiples of 2 patches,
    flattened into patch x patch x 2-frame rows in 2x2-block order); one ``<|image_pad|>`` per
    merged 2x2 block; M-RoPE positions as transformers' ``get_rope_index`` lays them out for images
    (the same for Qwen2-VL, Qwen2.5-VL and Qwen3-VL)."""

    def __init__(self, image_processor, config: dict, tokenizer=None):
        config = text_config(config)
        self.image_processor = image_processor
        vc = config.get("vision_config") or {}
        self.merge = int(vc.get("spatial_merge_size", getattr(image_processor, "merge_size", 2)))
        self.placeholder_id = int(config["image_token_id"])
        text = None
        if tokenizer is not None:
            text = tokenizer.convert_ids_to_tokens(self.placeholder_id)
        self.placeholder_text = text or "<|image_pad|>"
        # transformers 5 keeps the pixel range in size (longest_edge: max_pixels), 4 as attributes
        size = getattr(image_processor, "size", None) or {}
        self._pixel_range = (
            int(size.get("shortest_edge") or getattr(image_processor, "min_pixels", 56 * 56)),
            int(size.get("longest_edge") or getattr(image_processor, "max_pixels", 28 * 28 * 1280)),
        )
        self.max_pixels = self._pixel_range[1]

    def target_size(self, width: int, height: int) -> tuple[int, int] | None:
        ip = self.image_processor
        if not getattr(ip, "do_resize", True):
            return None
        try:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
        except ImportError:  # transformers 4
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
        factor = int(getattr(ip, "patch_size", 14)) * int(getattr(ip, "merge_size", self.merge))
        try:
            h, w = smart_resize(height, width, factor, *self._pixel_range)
        except ValueError:  # an aspect ratio it refuses: preprocess says so
            return None
        return w, h

    def preprocess(self, image) -> ImageItem:
        out = self.image_processor(images=[image], return_tensors="pt")
        pixels = out["pixel_values"].contiguous()
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        digest = hashlib.sha256(pixels.numpy().tobytes() + f"|{t},{h},{w}".encode()).hexdigest()
        return ImageItem(digest, pixels, t * h * w // self.merge**2, {"grid_thw": (t, h, w)})

    def expand(self, ids: list[int], items: list[ImageItem]) -> tuple[list[int], MultimodalInputs]:
        where = [i for i, tok in enumerate(ids) if tok == self.placeholder_id]
        if len(where) != len(items):
            raise ValueError(f"the prompt has {len(where)} image placeholders for {len(items)} images")
        if not items:
            return list(ids), MultimodalInputs([], [])
        out: list[int] = []
        spans: list[tuple[int, int]] = []
        axes: list[list[int]] = [[], [], []]
        pos, prev = 0, 0  # the next text position; the end of the last placeholder in ``ids``

        def text(n: int) -> None:
            nonlocal pos
            for a in axes:
                a.extend(range(pos, pos + n))
            pos += n

        for at, item in zip(where, items):
            out.extend(ids[prev:at])
            text(at - prev)
            t, h, w = item.meta["grid_thw"]
            gh, gw = h // self.merge, w // self.merge
            spans.append((len(out), item.num_tokens))
            out.extend([self.placeholder_id] * item.num_tokens)
            for ti in range(t):
                for r in range(gh):
                    axes[0].extend([pos + ti] * gw)
                    axes[1].extend([pos + r] * gw)
                    axes[2].extend(range(pos, pos + gw))
            pos += max(gh, gw)  # as transformers: the text after an image continues past its grid
            prev = at + 1
        out.extend(ids[prev:])
        text(len(ids) - prev)
        delta = max(max(a) for a in axes) + 1 - len(out)
        return out, MultimodalInputs(list(items), spans, rope_positions=axes, rope_delta=delta)


Qwen2_5_VLProcessor = QwenVLProcessor
