"""A draft's own K/V cache per request, for the draft models and heads that propose (STANDALONE,
EAGLE3): contiguous buffers grown by doubling, no pages (a draft keeps a few thousand tokens per
request at most), cut back to the tokens the target kept."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmkit.core.embedding.decoder import DenseCausalAttention


@dataclass
class DraftKV:
    """One request's draft K/V: per layer ``[capacity, kv_heads, head_dim]`` buffers, the first
    ``length`` rows valid; ``ids`` are the tokens they hold."""

    ids: list[int] = field(default_factory=list)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    length: int = 0
    deterministic: bool = False  # read by ForwardContext
    # The next forward's rows see these keys (bool ``[rows, length + rows]``) instead of every key
    # up to their own: a tree draft's rows see the target's rows and their own path only
    mask: torch.Tensor | None = None

    def cut(self, n: int) -> None:
        self.length = min(self.length, n)
        del self.ids[n:]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's K/V rows after the valid ones; all valid rows of the layer."""
        end = self.length + k.shape[0]
        buf_k, buf_v = self.keys.get(layer), self.values.get(layer)
        if buf_k is None or buf_k.shape[0] < end:
            cap = max(64, 2 * end)
            new_k, new_v = k.new_empty(cap, *k.shape[1:]), v.new_empty(cap, *v.shape[1:])
            if buf_k is not None:
                new_k[: self.length], new_v[: self.length] = buf_k[: self.length], buf_v[: self.length]
            self.keys[layer], self.values[layer] = buf_k, buf_v = new_k, new_v
        buf_k[self.length : end], buf_v[self.length : end] = k, v
        return buf_k[:end], buf_v[:end]


class DraftAttention(DenseCausalAttention):
    """The attention backend the draft model's layers call: causal attention of the new rows over
    the request's cached rows and themselves (no fast paths offered)."""

    def forward(self, q, k, v, layer_id, metadata: DraftKV, *, sliding_window=None, sinks=None):
        keys, values = metadata.append(layer_id, k, v)
        n, total = q.shape[0], keys.shape[0]
        mask = metadata.mask
        if mask is None:  # query i sits at position total - n + i and sees every key up to it
            mask = (
                torch.arange(total, device=q.device)[None, :]
                <= torch.arange(total - n, total, device=q.device)[:, None]
            )
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)
