"""Qwen2.5-VL's vision tower: 14x14 (x2 frames) patches, 2-D rotary over (row, column), blocks
attending within windows of merged cells except the ``fullatt_block_indexes`` ones that attend over
the whole image, RMSNorm and a SwiGLU MLP, then a merger folding each 2x2 block of patches into one
language-model token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.layers import RMSNorm
from llmkit.core.model.qwen_vl.vision_ops import activation, rotate_half, segment_groups


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
        q, k = rotate_half(q, rope), rotate_half(k, rope)
        out = torch.empty_like(q)
        for idx in groups:  # [B, s]: B segments (frames or windows) of s patches, attended together
            qs, ks, vs = (t[idx].transpose(1, 2) for t in (q, k, v))
            out[idx] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return self.proj(out.reshape(n, -1))


class _VisionMLP(nn.Module):
    def __init__(self, dim: int, inter: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=True)
        self.up_proj = nn.Linear(dim, inter, bias=True)
        self.down_proj = nn.Linear(inter, dim, bias=True)
        self.act = activation(act)

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
        full, windowed = segment_groups(frames), segment_groups(wins)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, full if i in self.full_blocks else windowed)
        return self.merger(x)
