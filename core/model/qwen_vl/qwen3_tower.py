"""Qwen3-VL's vision tower (Qwen3.5 uses it without DeepStack): 16x16 patches with a learned
position table resampled bilinearly to each image's grid, LayerNorm blocks with a GELU MLP
attending over the whole image, and DeepStack mergers on chosen blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.qwen_vl.vision_ops import activation, rotate_half, segment_groups


class _PatchEmbed(nn.Module):
    def __init__(self, dim: int, in_shape: tuple[int, ...]):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(dim, *in_shape), requires_grad=False)
        self.proj.bias = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, pixels):
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x, rope, groups):
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = rotate_half(q, rope), rotate_half(k, rope)
        out = torch.empty_like(q)
        for idx in groups:
            qs, ks, vs = (t[idx].transpose(1, 2) for t in (q, k, v))
            out[idx] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return self.proj(out.reshape(n, -1))


class _MLP(nn.Module):
    def __init__(self, dim: int, inter: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, inter, bias=True)
        self.linear_fc2 = nn.Linear(inter, dim, bias=True)
        self.act = activation(act)

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, vc: dict):
        super().__init__()
        dim = int(vc["hidden_size"])
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = _Attention(dim, int(vc["num_heads"]))
        self.mlp = _MLP(dim, int(vc["intermediate_size"]), vc.get("hidden_act", "gelu_pytorch_tanh"))

    def forward(self, x, rope, groups):
        x = x + self.attn(self.norm1(x), rope, groups)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    """2x2 patches -> one row; ``post``: the LayerNorm over the concatenated four (DeepStack's)."""

    def __init__(self, dim: int, out_dim: int, merge: int, post: bool):
        super().__init__()
        self.width, self.post = dim * merge * merge, post
        self.norm = nn.LayerNorm(self.width if post else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, out_dim)

    def forward(self, x):
        x = self.norm(x.reshape(-1, self.width)) if self.post else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    """Patches -> rows ``[merged, deepstack level 0, level 1, ...]`` concatenated."""

    def __init__(self, vc: dict):
        super().__init__()
        self.patch = int(vc.get("patch_size", 16))
        self.merge = int(vc.get("spatial_merge_size", 2))
        dim, heads, out = int(vc["hidden_size"]), int(vc["num_heads"]), int(vc["out_hidden_size"])
        shape = (int(vc.get("in_channels", 3)), int(vc.get("temporal_patch_size", 2)), self.patch, self.patch)
        self.patch_embed = _PatchEmbed(dim, shape)
        n_pos = int(vc["num_position_embeddings"])
        self.side = int(n_pos**0.5)
        self.pos_embed = nn.Embedding(n_pos, dim)
        self.blocks = nn.ModuleList(_Block(vc) for _ in range(int(vc["depth"])))
        self.merger = _Merger(dim, out, self.merge, post=False)
        self.deepstack_indexes = [int(i) for i in vc.get("deepstack_visual_indexes") or ()]
        self.deepstack_merger_list = nn.ModuleList(
            _Merger(dim, out, self.merge, post=True) for _ in self.deepstack_indexes
        )
        theta = float((vc.get("rope_parameters") or {}).get("rope_theta", vc.get("rope_theta", 10000.0)))
        half = dim // heads // 2
        inv = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float) / half)
        self.register_buffer("inv_freq", inv, persistent=False)

    def _layout(self, grids, device):
        """Per patch (block-major order) its row, column, image height and width, and frame."""
        m = self.merge
        rows, cols, hs, ws, frames = [], [], [], [], []
        frame = 0
        for t, h, w in grids:
            lh, lw = h // m, w // m
            r = torch.arange(lh).view(lh, 1, 1, 1) * m + torch.arange(m).view(1, 1, m, 1)
            c = torch.arange(lw).view(1, lw, 1, 1) * m + torch.arange(m).view(1, 1, 1, m)
            r, c = r.expand(lh, lw, m, m).reshape(-1), c.expand(lh, lw, m, m).reshape(-1)
            for _ in range(t):
                rows.append(r), cols.append(c), hs.append(torch.full_like(r, h)), ws.append(torch.full_like(r, w))
                frames.append(torch.full_like(r, frame))
                frame += 1
        return tuple(torch.cat(xs).to(device) for xs in (rows, cols, hs, ws, frames))

    def _taps(self, index, size):
        """Bilinear (align_corners) taps of the learned table's axis for ``index`` of ``size``."""
        src = index.float() * (self.side - 1) / (size - 1).clamp(min=1).float()
        lo = src.floor()
        frac = src - lo
        lo = lo.long().clamp(0, self.side - 1)
        hi = (lo + 1).clamp(0, self.side - 1)
        return (lo, hi), (1 - frac, frac)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        device = self.inv_freq.device
        x = self.patch_embed(pixels.to(device))
        rows, cols, hs, ws, frames = self._layout(grids, device)
        (r0, r1), (wr0, wr1) = self._taps(rows, hs)
        (c0, c1), (wc0, wc1) = self._taps(cols, ws)
        table = self.pos_embed.weight
        pos = 0
        for r, wr in ((r0, wr0), (r1, wr1)):
            for c, wc in ((c0, wc0), (c1, wc1)):
                pos = pos + table[r * self.side + c] * (wr * wc)[:, None]
        x = x + pos.to(x.dtype)
        freqs = torch.cat((rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq), dim=-1)
        cos, sin = freqs.cos(), freqs.sin()
        rope = (torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None])
        groups = segment_groups(frames)
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, groups)
            if i in self.deepstack_indexes:
                deep.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        return torch.cat([self.merger(x), *deep], dim=-1)
