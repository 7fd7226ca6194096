"""The ``torch`` attention backend: the CPU reference every other backend is tested against.

Prefill and mixed batches run SDPA per sequence over the gathered context. Pure decode batches
gather every context into one padded tensor and run a single masked attention, which on CPU is far
cheaper than a Python loop over sequences. In deterministic mode every sequence is computed on its
own, so its result cannot depend on the padding its batch-mates impose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmkit.core.attention import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    def prepare_metadata(self, md: AttentionMetadata) -> AttentionMetadata:
        if md.is_decode and not md.deterministic:
            max_len = max(md.kv_lens)
            rows = md.req_to_token[md.req_pool_indices, :max_len]
            pos = torch.arange(max_len, device=rows.device)
            valid = pos.unsqueeze(0) < md.kv_lens_t.unsqueeze(1)
            md.extra["torch_slots"] = torch.where(valid, rows, torch.zeros_like(rows))
            bias = torch.zeros(valid.shape, dtype=torch.float32, device=rows.device)
            md.extra["torch_bias"] = bias.masked_fill_(~valid, float("-inf"))[:, None, None, :]
        else:
            seqs = []
            starts = md.q_start_loc.tolist()
            for i in range(md.num_seqs):
                row = int(md.req_pool_indices[i])
                kv_len, q_len = md.kv_lens[i], md.q_lens[i]
                slots = md.req_to_token[row, :kv_len]
                mask = None
                if q_len > 1 and kv_len > q_len:  # causal with a cached prefix: bottom-right aligned
                    qpos = torch.arange(kv_len - q_len, kv_len, device=slots.device)
                    mask = qpos[:, None] >= torch.arange(kv_len, device=slots.device)[None, :]
                seqs.append((starts[i], starts[i] + q_len, slots, mask, q_len > 1 and mask is None))
            md.extra["torch_seqs"] = seqs
        return md

    def forward(self, q, k, v, layer_id, md):
        kbuf, vbuf = self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id]
        kbuf.index_copy_(0, md.out_slots, k.to(kbuf.dtype))
        vbuf.index_copy_(0, md.out_slots, v.to(vbuf.dtype))
        if "torch_slots" in md.extra:
            return self._decode(q, kbuf, vbuf, md)
        out = torch.empty_like(q)
        for start, end, slots, mask, causal in md.extra["torch_seqs"]:
            qs = q[start:end].transpose(0, 1)  # [H, L, D]
            ks = kbuf[slots].transpose(0, 1).to(q.dtype)
            vs = vbuf[slots].transpose(0, 1).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=causal, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[start:end] = o.transpose(0, 1)
        return out

    def _decode(self, q, kbuf, vbuf, md):
        slots, bias = md.extra["torch_slots"], md.extra["torch_bias"]
        b, hkv, d = slots.shape[0], self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        ks = kbuf[slots].permute(0, 2, 3, 1).to(q.dtype)  # [B, Hkv, D, L]
        vs = vbuf[slots].permute(0, 2, 1, 3).to(q.dtype)  # [B, Hkv, L, D]
        qg = q.view(b, hkv, group, d)
        scores = torch.matmul(qg, ks).mul_(self.scale).add_(bias)  # [B, Hkv, G, L]
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, vs).view(b, self.num_heads, d)
