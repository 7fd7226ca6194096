"""A Mamba2 token mixer (Nemotron-H, Granite 4.0-H): ``in_proj`` yields the gate ``z``, the
convolution's input (``x``, then the grouped ``B`` and ``C``) and the time step ``dt`` per head; a
causal depthwise convolution with SiLU runs over ``x, B, C``; the selective scan (``ssd.py``) maps
``x`` through the state; a gated RMSNorm over groups of channels and ``out_proj`` finish.

Its state per sequence is the convolution's last ``K - 1`` inputs (in the model's dtype) and one
``[head_dim, state_size]`` fp32 matrix per head, read from and written to ``ctx.states`` (a
:class:`~llmkit.core.kvcache.state_pool.StateBatch`). One-token rows (decode steps) run together in
the recurrent form; a longer row (a prompt chunk) runs alone in the chunked form, from the state its
request has so far (or none, at position 0).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.hot_module import HotModule
from llmkit.core.model.hybrid import causal_conv, mamba2_cpu, ssd
from llmkit.core.model.hybrid.rows import split_rows
from llmkit.core.model.linear import Linear


def time_step_limit(config: dict) -> tuple[float, float]:
    """The clamp of a Mamba2 layer's time steps: ``time_step_limit`` (a saved config writes infinity
    as ``{"__float__": "Infinity"}``), none when absent."""
    lo, hi = config.get("time_step_limit") or (0.0, math.inf)
    unwrap = lambda v: float(v["__float__"]) if isinstance(v, dict) else float(v)  # noqa: E731
    return unwrap(lo), unwrap(hi)


class GroupedGatedRMSNorm(nn.Module):
    """``weight * rmsnorm_per_group(x * silu(z))``: gated before the norm, each of ``groups`` equal
    slices of the channels normalised on its own, in fp32 (Mamba2's ``norm_before_gate=False``)."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.groups, self.eps = groups, eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * g.view(h.shape)


class Mamba2(HotModule):
    """``state_id``: this layer's index among the model's state layers (its tensors in the pool);
    ``dt_limit``: the range the time steps are clamped to; ``chunk``: the chunked scan's length."""

    def __init__(
        self,
        hidden: int,
        *,
        heads: int,
        head_dim: int,
        state_size: int,
        groups: int,
        kernel: int,
        conv_bias: bool,
        proj_bias: bool,
        eps: float,
        state_id: int,
        chunk: int = ssd.CHUNK,
        dt_limit: tuple[float, float] = (0.0, math.inf),
    ):
        super().__init__()
        if heads % groups:
            raise ValueError(f"Mamba2: {heads} heads do not split into {groups} groups")
        self.state_id = state_id
        self.heads, self.head_dim, self.state_size, self.groups = heads, head_dim, state_size, groups
        self.inner = heads * head_dim
        self.conv_dim = self.inner + 2 * groups * state_size
        self.kernel, self.chunk = kernel, chunk
        self.dt_min, self.dt_max = float(dt_limit[0]), float(dt_limit[1])
        # z, then x B C (the convolution's channels), then dt: as the checkpoint stores them, one product
        self.in_proj = Linear(hidden, self.inner + self.conv_dim + heads, bias=proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, kernel), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim), requires_grad=False) if conv_bias else None
        self.dt_bias = nn.Parameter(torch.zeros(heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(heads), requires_grad=False)
        self.norm = GroupedGatedRMSNorm(self.inner, groups, eps)
        self.out_proj = Linear(self.inner, hidden, bias=proj_bias)

    def state_spec(self, dtype: torch.dtype):
        """The conv state in the model's dtype (the inputs it keeps are), the SSM state in fp32."""
        return [
            ((self.conv_dim, self.kernel - 1), dtype),
            ((self.heads, self.head_dim, self.state_size), torch.float32),
        ]

    def forward(self, x: torch.Tensor, rope, ctx) -> torch.Tensor:
        det = ctx.deterministic
        z, xbc, dt = self.in_proj(x, det).split([self.inner, self.conv_dim, self.heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)
        y = self._mix(xbc, dt, ctx)  # [T, H, P] fp32
        out = self.norm(y.reshape(x.shape[0], self.inner), z)
        return self.out_proj(out.to(x.dtype), det)

    def _split(self, xbc: torch.Tensor):
        """The convolution's output as ``x [T, H, P]``, ``B, C [T, G, N]``."""
        n, gn = xbc.shape[0], self.groups * self.state_size
        x, b, c = xbc.split([self.inner, gn, gn], dim=-1)
        shape = (n, self.groups, self.state_size)
        return x.reshape(n, self.heads, self.head_dim), b.reshape(shape), c.reshape(shape)

    def _scan_args(self):
        return -self.A_log.float().exp(), self.D

    #: the C decode step where it builds (tests turn it off to compare with the torch forms)
    native_step = True

    def _recurrent_rows(self, xbc, dt, conv_buf, ssm_buf, r_slots, w_slots, fresh: list[bool]):
        """One token of each row: the conv and the recurrent scan from the read slots' states
        (none where ``fresh``) into the write slots; the outputs ``[R, H, P]`` (fp32)."""
        if self.native_step and mamba2_cpu.usable(xbc, conv_buf, ssm_buf, self.kernel):
            flags = torch.tensor(fresh, dtype=torch.uint8)
            conv_out = mamba2_cpu.conv_step(xbc, self.conv_weight, self.conv_bias, conv_buf, r_slots, w_slots, flags)
            A, D = self._scan_args()
            dims = (self.heads, self.head_dim, self.state_size, self.groups)
            return mamba2_cpu.ssd_step(conv_out, dt, A, D, ssm_buf, r_slots, w_slots, flags, *dims)
        conv_state = conv_buf.index_select(0, r_slots)
        ssm_state = ssm_buf.index_select(0, r_slots)
        if any(fresh):  # a one-token prompt: no state before it (where, not a product: a slot
            # never written may hold NaN)
            keep = torch.tensor([not f for f in fresh], device=xbc.device)
            conv_state = torch.where(keep.view(-1, 1, 1), conv_state, 0.0)
            ssm_state = torch.where(keep.view(-1, 1, 1, 1), ssm_state, 0.0)
        conv_out, conv_new = causal_conv.conv_step(xbc, self.conv_weight, conv_state, self.conv_bias)
        xs, B, C = self._split(conv_out)
        A, D = self._scan_args()
        y, ssm_new = ssd.recurrent(xs, dt, A, B, C, D, ssm_state)
        conv_buf.index_copy_(0, w_slots, conv_new.to(conv_buf.dtype))
        ssm_buf.index_copy_(0, w_slots, ssm_new)
        return y

    def _mix(self, xbc, dt, ctx) -> torch.Tensor:
        states, md = ctx.states, ctx.metadata
        conv_buf, ssm_buf = states.pool.layers[self.state_id]
        q_lens = md.q_lens
        out = xbc.new_empty((xbc.shape[0], self.heads, self.head_dim), dtype=torch.float32)
        starts, ones, spans = split_rows(md)
        if ones:  # every one-token row in one recurrent step
            every = len(ones) == len(q_lens)
            rows = None if every else torch.tensor([starts[i] for i in ones], device=xbc.device)
            idx = None if every else torch.tensor(ones, device=xbc.device)
            sel = (lambda t: t) if every else (lambda t: t.index_select(0, rows))
            r_slots = states.read if every else states.read.index_select(0, idx)
            w_slots = states.write if every else states.write.index_select(0, idx)
            fresh = [states.fresh[i] for i in ones]
            y = self._recurrent_rows(sel(xbc), sel(dt), conv_buf, ssm_buf, r_slots, w_slots, fresh)
            if every:
                return y
            out.index_copy_(0, rows, y)
        A, D = self._scan_args()
        for i, a, b in spans:
            r, w = states.read[i : i + 1], states.write[i : i + 1]
            fresh = states.fresh[i]
            conv_state = None if fresh else conv_buf.index_select(0, r)[0]
            ssm_state = None if fresh else ssm_buf.index_select(0, r)[0]
            conv_out, conv_new = causal_conv.conv_prefill(xbc[a:b], self.conv_weight, conv_state, self.conv_bias)
            xs, B, C = self._split(conv_out)
            y, ssm_new = ssd.chunked(xs, dt[a:b], A, B, C, D, ssm_state, self.chunk)
            conv_buf.index_copy_(0, w, conv_new.unsqueeze(0).to(conv_buf.dtype))
            ssm_buf.index_copy_(0, w, ssm_new.unsqueeze(0))
            out[a:b] = y
        return out
