"""Mamba2's selective state space scan (SSD, arXiv:2405.21060) in torch: the reference every faster
kernel is checked against. Per head ``h`` and token ``t``, with ``dt`` already through softplus and
``A = -exp(A_log)`` (negative):

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T        (S: [head_dim, state_size])
    y_t = S_t C_t + D x_t

B and C come in ``G`` groups, each shared by ``H / G`` consecutive heads. States are fp32.
"""

from __future__ import annotations

import torch

#: the chunk length of the chunked form (a checkpoint's ``chunk_size``; the result does not depend
#: on it but for rounding)
CHUNK = 128


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., G, N]`` groups as ``[..., H, N]`` (head ``h`` reads group ``h // (H / G)``)."""
    rep = heads // t.shape[-2]
    return t.repeat_interleave(rep, dim=-2) if rep > 1 else t


def chunked(x, dt, A, B, C, D, state: torch.Tensor | None, chunk: int = CHUNK):
    """One sequence: ``x [T, H, P]``, ``dt [T, H]``, ``A, D [H]``, ``B, C [T, G, N]``, ``state
    [H, P, N]`` fp32 or None (zeros). Returns the outputs ``[T, H, P]`` (fp32, the ``D`` skip
    included) and the state after the last token.

    Within a chunk the outputs are a masked product (``C B^T`` decayed by the cumulative
    ``dt A`` between the two positions); between chunks the state carries what came before."""
    T, H, P = x.shape
    xf = x.float().transpose(0, 1)  # [H, T, P]
    dt = dt.float().t()  # [H, T]
    Bh = _heads(B.float(), H).transpose(0, 1)  # [H, T, N]
    Ch = _heads(C.float(), H).transpose(0, 1)
    a = dt * A.float().unsqueeze(-1)  # log-decay per token [H, T]
    S = x.new_zeros(H, P, B.shape[-1], dtype=torch.float32) if state is None else state.float()
    out = torch.empty(H, T, P, dtype=torch.float32, device=x.device)
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        n = e - s
        G = a[:, s:e].cumsum(-1)  # [H, n]
        xdt = xf[:, s:e] * dt[:, s:e].unsqueeze(-1)  # [H, n, P]
        b, c = Bh[:, s:e], Ch[:, s:e]
        # exp(G_t - G_j) for j <= t (masked before exp: nothing above the diagonal overflows)
        diff = G.unsqueeze(-1) - G.unsqueeze(-2)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        decay = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()
        within = ((c @ b.transpose(-1, -2)) * decay) @ xdt  # [H, n, P]
        before = G.exp().unsqueeze(-1) * (c @ S.transpose(-1, -2))  # C_t S_prev, decayed
        out[:, s:e] = within + before
        end = G[:, -1:]
        S = end.exp().unsqueeze(-1) * S + (xdt * (end - G).exp().unsqueeze(-1)).transpose(-1, -2) @ b
    out = out + D.float().view(H, 1, 1) * xf
    return out.transpose(0, 1), S


def recurrent(x, dt, A, B, C, D, state: torch.Tensor):
    """One token of each of R sequences: ``x [R, H, P]``, ``dt [R, H]``, ``B, C [R, G, N]``,
    ``state [R, H, P, N]`` fp32. Returns the outputs ``[R, H, P]`` (fp32) and the new states."""
    R, H, P = x.shape
    N = B.shape[-1]
    xf, dt = x.float(), dt.float()
    Bh, Ch = _heads(B.float(), H), _heads(C.float(), H)  # [R, H, N]
    S = state.float() * (dt * A.float()).exp()[..., None, None]  # (a new tensor: the caller's stays)
    # the rank-one update in place and C as a product: a decode step is bound by passes over the states
    S.view(R * H, P, N).baddbmm_((dt.unsqueeze(-1) * xf).reshape(R * H, P, 1), Bh.reshape(R * H, 1, N))
    y = torch.matmul(S, Ch.unsqueeze(-1)).squeeze(-1) + D.float().view(1, H, 1) * xf
    return y, S
