"""A Gated DeltaNet token mixer (Qwen3.5, Qwen3-Next): projections, the short convolution, the
gated delta rule over the layer's state slots, the gated RMSNorm and the output projection.

Its state per sequence is the convolution's last ``K - 1`` inputs and one ``[Dk, Dv]`` fp32 matrix
per value head, read from and written to ``ctx.states`` (a
:class:`~llmkit.core.kvcache.state_pool.StateBatch`). One-token rows (decode steps) run together
in the recurrent form; a longer row (a prompt chunk) runs alone in the chunked form, from the state
its request has so far (or none, at position 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.hot_module import HotModule
from llmkit.core.model.hybrid import causal_conv, gated_delta_cpu, gated_delta_rule
from llmkit.core.model.hybrid.rows import split_rows
from llmkit.core.model.layers import FUSED_ON_CUDA
from llmkit.core.model.linear import Linear


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * silu(z)``: the norm in fp32, scaled in ``x``'s dtype, gated in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(HotModule):
    """``state_id``: this layer's index among the model's state layers (its tensors in the pool)."""

    def __init__(self, config: dict, state_id: int, tp=None):
        super().__init__()
        self.state_id = state_id
        hidden = config["hidden_size"]
        nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
        self.head_k_dim = dk = config["linear_key_head_dim"]
        self.head_v_dim = dv = config["linear_value_head_dim"]
        self.kernel = config.get("linear_conv_kernel_dim", 4)
        # Under tensor parallelism each rank takes whole key heads with the value heads they serve
        # (grouped by key head in the checkpoint), in every projection, the convolution's channels,
        # the decays and the state; out_proj sums the ranks' parts.
        # in_proj_qkv (split into its q, k, v rows at load), in_proj_z, in_proj_b, in_proj_a: one product
        self.in_proj = Linear(
            hidden,
            2 * nk * dk + 2 * nv * dv + 2 * nv,
            parallel="column",
            parts=[(nk * dk, nk), (nk * dk, nk), (nv * dv, nv), (nv * dv, nv), (nv, nv), (nv, nv)],
            tp=tp,
        )
        self.out_proj = Linear(nv * dv, hidden, parallel="row", in_units=nv, tp=tp)
        self.num_v_heads = hv = self.out_proj.local_in // dv  # this rank's
        self.num_k_heads = nk * hv // nv
        self.key_dim, self.value_dim = self.num_k_heads * dk, hv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        # this rank's channels of the checkpoint's [q, k, v] convolution, and its value heads
        rank = 0 if tp is None else tp.rank
        k0, v0 = rank * self.key_dim, rank * self.value_dim
        full_key = nk * dk
        self._conv_rows = torch.cat(
            [
                torch.arange(k0, k0 + self.key_dim),
                torch.arange(full_key + k0, full_key + k0 + self.key_dim),
                torch.arange(2 * full_key + v0, 2 * full_key + v0 + self.value_dim),
            ]
        )
        self._heads = slice(rank * hv, (rank + 1) * hv)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(hv), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(hv), requires_grad=False)
        self.norm = GatedRMSNorm(dv, config.get("rms_norm_eps", 1e-6))

    def load_param(self, leaf: str, tensor: torch.Tensor) -> None:
        """The checkpoint's whole ``conv_weight`` ([channels, K] or [channels, 1, K]), ``dt_bias`` or
        ``A_log``: this rank's channels or heads of it."""
        if leaf == "conv_weight":
            t = tensor.reshape(tensor.shape[0], tensor.shape[-1])
            self.conv_weight.data.copy_(t.index_select(0, self._conv_rows))
        else:
            getattr(self, leaf).data.copy_(tensor[self._heads])

    def state_spec(self, dtype: torch.dtype):
        """The conv state in the model's dtype (the inputs it keeps are), the recurrent one in fp32."""
        return [
            ((self.conv_dim, self.kernel - 1), dtype),
            ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32),
        ]

    def forward(self, x: torch.Tensor, rope, ctx) -> torch.Tensor:
        det = ctx.deterministic
        proj = self.in_proj(x, det)
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        core = self._mix(mixed, g, beta, ctx)  # [T, Hv, Dv]
        out = self.norm(core.to(x.dtype).reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(x.shape[0], self.value_dim), det)

    def _split_heads(self, mixed: torch.Tensor):
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        n = mixed.shape[0]
        return (
            q.reshape(n, self.num_k_heads, self.head_k_dim),
            k.reshape(n, self.num_k_heads, self.head_k_dim),
            v.reshape(n, self.num_v_heads, self.head_v_dim),
        )

    #: the fused decode step (C on the CPU where it builds, Triton on CUDA); tests turn it off to
    #: compare with the torch forms
    native_step = True

    def _recurrent_rows(self, mixed, g, beta, conv_buf, rec_buf, r_slots, w_slots, fresh: list[bool]):
        """One token of each row: the conv and the recurrent rule from the read slots' states
        (none where ``fresh``) into the write slots; the outputs ``[B, Hv, Dv]`` (fp32)."""
        dk, dv = self.head_k_dim, self.head_v_dim
        if self.native_step and mixed.is_cuda and FUSED_ON_CUDA and dk & (dk - 1) == 0:
            from llmkit.core.model.hybrid import triton_gated_delta as tgd

            flags = torch.tensor(fresh, dtype=torch.uint8).to(mixed.device)
            conv_out = tgd.conv_step(mixed, self.conv_weight, conv_buf, r_slots, w_slots, flags)
            return tgd.gated_delta_step(
                conv_out,
                self.key_dim,
                g,
                beta,
                rec_buf,
                r_slots,
                w_slots,
                flags,
                self.num_k_heads,
                self.num_v_heads,
                dk,
                dv,
            )
        if self.native_step and gated_delta_cpu.usable(mixed, conv_buf, rec_buf, dk, dv, self.kernel):
            flags = torch.tensor(fresh, dtype=torch.uint8)
            conv_out = gated_delta_cpu.conv_step(mixed, self.conv_weight, conv_buf, r_slots, w_slots, flags)
            return gated_delta_cpu.gated_delta_step(
                conv_out,
                self.key_dim,
                g,
                beta,
                rec_buf,
                r_slots,
                w_slots,
                flags,
                self.num_k_heads,
                self.num_v_heads,
                dk,
                dv,
            )
        conv_state = conv_buf.index_select(0, r_slots)
        rec_state = rec_buf.index_select(0, r_slots)
        if any(fresh):  # a one-token prompt: no state before it (where, not a product: a slot
            # never written may hold NaN)
            keep = torch.tensor([not f for f in fresh], device=mixed.device)
            conv_state = torch.where(keep.view(-1, 1, 1), conv_state, 0.0)
            rec_state = torch.where(keep.view(-1, 1, 1, 1), rec_state, 0.0)
        conv_out, conv_new = causal_conv.conv_step(mixed, self.conv_weight, conv_state)
        q, k, v = self._split_heads(conv_out)
        o, rec_new = gated_delta_rule.recurrent(q, k, v, g, beta, rec_state)
        conv_buf.index_copy_(0, w_slots, conv_new.to(conv_buf.dtype))
        rec_buf.index_copy_(0, w_slots, rec_new)
        return o

    def _mix(self, mixed, g, beta, ctx) -> torch.Tensor:
        states, md = ctx.states, ctx.metadata
        conv_buf, rec_buf = states.pool.layers[self.state_id]
        q_lens = md.q_lens
        out = mixed.new_empty((mixed.shape[0], self.num_v_heads, self.head_v_dim), dtype=torch.float32)
        starts, ones, spans = split_rows(md)
        if ones:  # every one-token row in one recurrent step
            rows = torch.tensor([starts[i] for i in ones], device=mixed.device) if len(ones) < len(q_lens) else None
            sel = (lambda t: t.index_select(0, rows)) if rows is not None else (lambda t: t)
            idx = torch.tensor(ones, device=mixed.device) if rows is not None else None
            r_slots = states.read if idx is None else states.read.index_select(0, idx)
            w_slots = states.write if idx is None else states.write.index_select(0, idx)
            fresh = [states.fresh[i] for i in ones]
            o = self._recurrent_rows(sel(mixed), sel(g), sel(beta), conv_buf, rec_buf, r_slots, w_slots, fresh)
            if rows is None:
                return o
            out.index_copy_(0, rows, o)
        for i, a, b in spans:
            r, w = states.read[i : i + 1], states.write[i : i + 1]
            fresh = states.fresh[i]
            conv_state = None if fresh else conv_buf.index_select(0, r)[0]
            rec_state = None if fresh else rec_buf.index_select(0, r)[0]
            conv_out, conv_new = causal_conv.conv_prefill(mixed[a:b], self.conv_weight, conv_state)
            q, k, v = self._split_heads(conv_out)
            o, rec_new = gated_delta_rule.chunked(q, k, v, g[a:b], beta[a:b], rec_state)
            conv_buf.index_copy_(0, w, conv_new.unsqueeze(0).to(conv_buf.dtype))
            rec_buf.index_copy_(0, w, rec_new.unsqueeze(0))
            out[a:b] = o
        return out
