"""The ``torch`` attention backend: the CPU reference every other backend is tested against.

Prefill and mixed batches run SDPA per sequence over the gathered context. Pure decode batches
gather every context into one padded tensor and run a single masked attention, which on CPU is far
cheaper than a Python loop over sequences. In deterministic mode every sequence is computed on its
own, so its result cannot depend on the padding its batch-mates impose.

Sliding windows and attention sinks stay on the fused SDPA kernel: the window is part of the
additive mask, and a sink is one extra key whose value is zero and whose logit (the mask's bias on
that column) is the head's sink, so it takes its share of the softmax and contributes nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmkit.core.model.attention import LATENT_KV, SINKS, SLIDING_WINDOW, AttentionBackend, AttentionMetadata


def _with_sink(bias: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Append the sink column to an additive mask: ``[L, S]`` and ``sinks [H]`` give
    ``[H, L, S+1]``; ``[B, 1, 1, S]`` and ``sinks [Hkv, G]`` (decode: a KV head's query group in
    the query dim) give ``[B, Hkv, G, S+1]``."""
    sinks = sinks.to(bias.dtype)
    if bias.dim() == 2:
        h, (q_len, kv_len) = sinks.shape[0], bias.shape
        return torch.cat([bias.expand(h, q_len, kv_len), sinks.view(h, 1, 1).expand(h, q_len, 1)], dim=-1)
    b, hkv, g = bias.shape[0], *sinks.shape
    full = bias.expand(b, hkv, g, bias.shape[-1])
    return torch.cat([full, sinks.view(1, hkv, g, 1).expand(b, hkv, g, 1)], dim=-1)


def _zero_key(x: torch.Tensor) -> torch.Tensor:
    """Append one zero key/value along the sequence dim (-2) of ``[..., S, D]``."""
    return torch.cat([x, x.new_zeros(*x.shape[:-2], 1, x.shape[-1])], dim=-2)


class TorchAttentionBackend(AttentionBackend):
    features = frozenset({SLIDING_WINDOW, SINKS, LATENT_KV})

    def prepare_metadata(self, md: AttentionMetadata) -> AttentionMetadata:
        if md.is_decode and not md.deterministic:
            max_len = max(md.kv_lens)
            rows = md.req_to_token[md.req_pool_indices, :max_len]
            bias = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
            if min(md.kv_lens) == max_len:  # no padding (always so for one sequence)
                md.extra["torch_slots"] = rows.view(-1)
            else:
                pos = torch.arange(max_len, device=rows.device)
                valid = pos.unsqueeze(0) < md.kv_lens_t.unsqueeze(1)
                md.extra["torch_slots"] = torch.where(valid, rows, torch.zeros_like(rows)).view(-1)
                bias.masked_fill_(~valid, float("-inf"))
            md.extra["torch_bias"] = bias[:, None, None, :]
        else:
            seqs = []
            starts = md.q_starts or md.q_start_loc.tolist()
            rows = md.req_rows or md.req_pool_indices.tolist()
            for i in range(md.num_seqs):
                row = rows[i]
                kv_len, q_len = md.kv_lens[i], md.q_lens[i]
                slots = md.req_to_token[row, :kv_len]
                mask = None
                if q_len > 1 and kv_len > q_len:  # causal with a cached prefix: bottom-right aligned
                    qpos = torch.arange(kv_len - q_len, kv_len, device=slots.device)
                    mask = qpos[:, None] >= torch.arange(kv_len, device=slots.device)[None, :]
                seqs.append((starts[i], starts[i] + q_len, slots, mask, q_len > 1 and mask is None))
            md.extra["torch_seqs"] = seqs
        return md

    def forward(self, q, k, v, layer_id, md, *, sliding_window=None, sinks=None):
        # (dtype checks in Python: a no-op .to() is still an op dispatch, twice per layer)
        kbuf = self.pool.k_buffers[layer_id]
        kbuf.index_copy_(0, md.out_slots, k if k.dtype == kbuf.dtype else k.to(kbuf.dtype))
        vbuf = None  # latent KV: the values are the keys' first v_head_dim channels
        if v is not None:
            vbuf = self.pool.v_buffers[layer_id]
            vbuf.index_copy_(0, md.out_slots, v if v.dtype == vbuf.dtype else v.to(vbuf.dtype))
        if "torch_slots" in md.extra:
            return self._decode(q, kbuf, vbuf, md, sliding_window, sinks)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        group = self.num_heads // self.num_kv_heads
        for i, (start, end, slots, mask, causal) in enumerate(md.extra["torch_seqs"]):
            qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]: 4-D for the fused kernel
            ks = kbuf.index_select(0, slots).to(q.dtype)
            vs = ks[..., : self.v_head_dim] if vbuf is None else vbuf.index_select(0, slots).to(q.dtype)
            if group > 1:
                # Expanding K/V heads keeps SDPA on its fused CPU kernel; enable_gqa=True would
                # send it to the unfused math path (3x slower for a 512-token prefill).
                ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
            ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
            if sliding_window or sinks is not None:
                mask, causal = self._seq_bias(md, i, end - start, sliding_window, q.dtype), False
                if sinks is not None:
                    mask = _with_sink(mask, sinks)
                    ks, vs = _zero_key(ks), _zero_key(vs)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal, scale=self.scale)
            out[start:end] = o[0].transpose(0, 1)
        return out

    def _seq_bias(self, md, i: int, q_len: int, window: int | None, dtype) -> torch.Tensor:
        """The additive causal (and sliding-window) mask ``[L, S]`` of sequence ``i``, built once
        per forward and window, shared by the layers."""
        key = ("torch_seq_bias", i, window)
        if key not in md.extra:
            kv_len = md.kv_lens[i]
            qpos = torch.arange(kv_len - q_len, kv_len, device=self.device)[:, None]
            kpos = torch.arange(kv_len, device=self.device)[None, :]
            allowed = qpos >= kpos
            if window:
                allowed &= kpos > qpos - window
            md.extra[key] = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill_(
                ~allowed, float("-inf")
            )
        return md.extra[key]

    def _decode(self, q, kbuf, vbuf, md, window=None, sinks=None):
        flat, bias = md.extra["torch_slots"], md.extra["torch_bias"]  # slots [B * L], flattened
        b, hkv, d = bias.shape[0], self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        # index_select gathers ~4x faster than advanced indexing on CPU
        ks = kbuf.index_select(0, flat).view(b, -1, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
        if vbuf is None:
            vs = ks[..., : self.v_head_dim]
        else:
            vs = vbuf.index_select(0, flat).view(b, -1, hkv, self.v_head_dim).transpose(1, 2)
        if ks.dtype != q.dtype:
            ks, vs = ks.to(q.dtype), vs.to(q.dtype)
        if window:
            key = ("torch_window_bias", window)
            if key not in md.extra:  # keys older than the window are masked like the padding
                pos = torch.arange(bias.shape[-1], device=bias.device)
                old = pos[None, :] <= (md.kv_lens_t[:, None] - 1 - window)
                md.extra[key] = bias.masked_fill(old[:, None, None, :], float("-inf"))
            bias = md.extra[key]
        if sinks is not None:
            bias = _with_sink(bias.to(q.dtype), sinks.view(hkv, group))
            ks, vs = _zero_key(ks), _zero_key(vs)
        # A query head group attends like a short query sequence to its shared KV head, so one
        # fused SDPA call covers GQA without copying K/V per query head.
        o = F.scaled_dot_product_attention(q.view(b, hkv, group, d), ks, vs, attn_mask=bias, scale=self.scale)
        return o.reshape(b, self.num_heads, self.v_head_dim)
