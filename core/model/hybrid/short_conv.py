"""A gated short convolution (LFM2's ``conv`` blocks): ``in_proj`` yields B, C and x per token; a
causal depthwise convolution of kernel ``L`` runs over ``B * x`` with no activation after it, C
gates its output, and ``out_proj`` maps it back.

Its state per sequence is the convolution's last ``L - 1`` inputs (the ``B * x`` rows), read from
and written to ``ctx.states`` (a :class:`~llmkit.core.kvcache.state_pool.StateBatch`): no recurrent
matrix. One-token rows (decode steps) run together; a longer row (a prompt chunk) runs alone, from
the state its request has so far (none at position 0).
"""

from __future__ import annotations

import torch
from torch import nn

from llmkit.core.model.hot_module import HotModule
from llmkit.core.model.hybrid import causal_conv
from llmkit.core.model.hybrid.rows import split_rows
from llmkit.core.model.linear import Linear


class ShortConv(HotModule):
    """``state_id``: this layer's index among the model's state layers (its tensor in the pool)."""

    def __init__(self, hidden: int, kernel: int, bias: bool, state_id: int):
        super().__init__()
        self.state_id = state_id
        self.hidden, self.kernel = hidden, kernel
        # B, C and x as one product (the checkpoint stores them so)
        self.in_proj = Linear(hidden, 3 * hidden, bias=bias)
        self.conv_weight = nn.Parameter(torch.empty(hidden, kernel), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.zeros(hidden), requires_grad=False) if bias else None
        self.out_proj = Linear(hidden, hidden, bias=bias)

    def state_spec(self, dtype: torch.dtype):
        """The last ``L - 1`` convolution inputs, in the model's dtype (the inputs are)."""
        return [((self.hidden, self.kernel - 1), dtype)]

    def forward(self, x: torch.Tensor, rope, ctx) -> torch.Tensor:
        det = ctx.deterministic
        b, c, h = self.in_proj(x, det).chunk(3, dim=-1)
        return self.out_proj(c * self._conv(b * h, ctx), det)

    def _conv(self, bx: torch.Tensor, ctx) -> torch.Tensor:
        states, md = ctx.states, ctx.metadata
        (buf,) = states.pool.layers[self.state_id]
        w, bias = self.conv_weight, self.conv_bias
        q_lens = md.q_lens
        starts, ones, spans = split_rows(md)
        if len(ones) == len(q_lens):  # a decode step: every row at once, no gathers
            out, new = causal_conv.conv_step(bx, w, _read(buf, states.read, states.fresh), bias, silu=False)
            buf.index_copy_(0, states.write, new.to(buf.dtype))
            return out
        out = torch.empty_like(bx)
        if ones:
            idx = torch.tensor(ones, device=bx.device)
            rows = torch.tensor([starts[i] for i in ones], device=bx.device)
            fresh = [states.fresh[i] for i in ones]
            state = _read(buf, states.read.index_select(0, idx), fresh)
            o, new = causal_conv.conv_step(bx.index_select(0, rows), w, state, bias, silu=False)
            buf.index_copy_(0, states.write.index_select(0, idx), new.to(buf.dtype))
            out.index_copy_(0, rows, o)
        for i, a, e in spans:
            state = None if states.fresh[i] else buf[states.read[i]]
            out[a:e], new = causal_conv.conv_prefill(bx[a:e], w, state, bias, silu=False)
            buf.index_copy_(0, states.write[i : i + 1], new.unsqueeze(0).to(buf.dtype))
        return out


def _read(buf: torch.Tensor, slots: torch.Tensor, fresh: list[bool]) -> torch.Tensor:
    """The states in ``slots``, zeros for a sequence that starts here (a one-token prompt)."""
    state = buf.index_select(0, slots)
    if any(fresh):  # (a where, not a product: a slot never written may hold NaNs)
        keep = torch.tensor([not f for f in fresh], device=buf.device)
        state = torch.where(keep.view(-1, 1, 1), state, 0)
    return state
