"""``Qwen3NextForCausalLM`` (Qwen3-Next-80B-A3B): the hybrid stack Qwen3.5 grew from, with MoE
feed-forwards (a gated shared expert) and the DeltaNet input projections fused per key head:
``in_proj_qkvz`` holds, for each key head, its query, key, its value heads' values and their
gates; ``in_proj_ba`` its value heads' betas then alphas. Loading regroups their rows into the
projection layout the layers read (all queries, all keys, all values; the gates; betas; alphas)."""

from __future__ import annotations

import torch

from llmkit.core.model.decoder.hybrid_stack import HybridLM
from llmkit.core.model.loader.source import materialize


class Qwen3NextForCausalLM(HybridLM):
    sparse_mlp = True
    supports_cuda_graph = False  # FusedExperts groups tokens by expert with host-side counts

    def convert(self, name, tensor):
        if not name.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight")):
            yield name, tensor
            return
        c = self.config
        nk, dk, dv = c["linear_num_key_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
        per_k = c["linear_num_value_heads"] // nk
        w = materialize(tensor)
        base = name.rsplit(".", 2)[0]
        if name.endswith("in_proj_qkvz.weight"):
            q, k, v, z = w.view(nk, -1, w.shape[-1]).split([dk, dk, per_k * dv, per_k * dv], dim=1)
            flat = lambda t: t.reshape(-1, w.shape[-1])  # noqa: E731
            yield f"{base}.in_proj_qkv.weight", torch.cat([flat(q), flat(k), flat(v)])
            yield f"{base}.in_proj_z.weight", flat(z)
        else:
            b, a = w.view(nk, 2 * per_k, w.shape[-1]).split([per_k, per_k], dim=1)
            yield f"{base}.in_proj_b.weight", b.reshape(-1, w.shape[-1])
            yield f"{base}.in_proj_a.weight", a.reshape(-1, w.shape[-1])
