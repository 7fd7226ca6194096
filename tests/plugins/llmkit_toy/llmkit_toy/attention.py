"""Plain (non-paged-kernel) attention written against llmkit's public interface only."""

import logging

import torch

from llmkit.core import AttentionBackend

log = logging.getLogger("llmkit")


class ToyAttention(AttentionBackend):
    calls = 0

    def forward(self, q, k, v, layer_id, md):
        if ToyAttention.calls == 0:
            log.info("toy attention backend in use")
        ToyAttention.calls += 1
        kbuf, vbuf = self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id]
        kbuf[md.out_slots] = k
        vbuf[md.out_slots] = v
        out = torch.empty_like(q)
        starts = md.q_start_loc.tolist()
        group = self.num_heads // self.num_kv_heads
        for i in range(md.num_seqs):
            row = int(md.req_pool_indices[i])
            n_kv, n_q = md.kv_lens[i], md.q_lens[i]
            slots = md.req_to_token[row, :n_kv]
            ks = kbuf[slots].repeat_interleave(group, dim=1).transpose(0, 1)
            vs = vbuf[slots].repeat_interleave(group, dim=1).transpose(0, 1)
            qs = q[starts[i] : starts[i] + n_q].transpose(0, 1)
            scores = qs @ ks.transpose(1, 2) * self.scale
            qpos = torch.arange(n_kv - n_q, n_kv)[:, None]
            scores = scores.masked_fill(torch.arange(n_kv)[None, :] > qpos, float("-inf"))
            out[starts[i] : starts[i] + n_q] = (scores.softmax(-1) @ vs).transpose(0, 1)
        return out
