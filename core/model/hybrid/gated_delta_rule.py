"""The gated delta rule (Gated DeltaNet, arXiv:2412.06464) in torch: the reference every faster
kernel is compared with, and the path where none applies.

Per value head, a state ``S [Dk, Dv]`` (fp32) evolves token by token::

    S <- exp(g) * S                      (decay, g <= 0)
    u  = beta * (v - S^T k)              (the delta: what S does not yet predict)
    S <- S + k u^T
    o  = S^T q

with ``q`` and ``k`` L2-normalised and ``q`` scaled by ``Dk ** -0.5``. :func:`recurrent` applies it
one token at a time (a decode step); :func:`chunked` computes the same over chunks of ``CHUNK``
tokens with matrix products: within a chunk, with ``G`` the cumulative decay from the chunk's start
and ``S0`` the state before it, the deltas solve one unit lower-triangular system
``(I + L) U = beta V - beta e^G K S0`` where ``L[j, i] = beta_j e^(G_j - G_i) k_j.k_i`` (i < j), and
``O = e^G Q S0 + (e^(G_t - G_j) q_t.k_j)_{j<=t} U``, ``S_end = e^G_end S0 + (e^(G_end - G) K)^T U``.
"""

from __future__ import annotations

import torch

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, num_v_heads):
    """fp32 ``[H, T, D]`` queries (normalised, scaled) and keys (normalised), values, and
    ``[H, T]`` decays and betas, the key heads repeated to the value heads they serve."""
    rep = num_v_heads // q.shape[1]
    q, k = l2norm(q.float()), l2norm(k.float())
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q = q * q.shape[-1] ** -0.5
    return q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1), g.float().t(), beta.float().t()


def chunked(q, k, v, g, beta, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: ``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``, ``g, beta [T, Hv]``, ``state
    [Hv, Dk, Dv]`` fp32 or None (zeros). Returns the outputs ``[T, Hv, Dv]`` (fp32) and the state
    after the last token."""
    T, Hv, Dv = v.shape
    q, k, v, g, beta = _prepare(q, k, v, g, beta, Hv)
    S = torch.zeros(Hv, q.shape[-1], Dv, dtype=torch.float32, device=v.device) if state is None else state.float()
    out = torch.empty(Hv, T, Dv, dtype=torch.float32, device=v.device)
    for a in range(0, T, CHUNK):
        b = min(a + CHUNK, T)
        qc, kc, vc, bc = q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b]
        G = g[:, a:b].cumsum(-1)  # [H, C]
        n = b - a
        # e^(G_t - G_j) for j <= t (0 above the diagonal; masked before exp, so nothing overflows)
        diff = G.unsqueeze(-1) - G.unsqueeze(-2)
        causal = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        decay = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()
        kk = kc @ kc.transpose(-1, -2)
        lower = (bc.unsqueeze(-1) * kk * decay).tril(-1)  # L
        eye = torch.eye(n, dtype=torch.float32, device=v.device)
        rhs = torch.cat([bc.unsqueeze(-1) * vc, (bc * G.exp()).unsqueeze(-1) * kc], dim=-1)
        solved = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
        u = solved[..., :Dv] - solved[..., Dv:] @ S  # the deltas U
        out[:, a:b] = (qc * G.exp().unsqueeze(-1)) @ S + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        end = G[:, -1:]
        S = end.exp().unsqueeze(-1) * S + (kc * (end - G).exp().unsqueeze(-1)).transpose(-1, -2) @ u
    return out.transpose(0, 1), S


def recurrent(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: ``q, k [B, Hk, Dk]``, ``v [B, Hv, Dv]``, ``g, beta [B, Hv]``,
    ``state [B, Hv, Dk, Dv]`` fp32. Returns the outputs ``[B, Hv, Dv]`` and the new states."""
    Hv = v.shape[1]
    rep = Hv // q.shape[1]
    q, k = l2norm(q.float()), l2norm(k.float())
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q = q * q.shape[-1] ** -0.5
    S = state.float() * g.float().exp()[..., None, None]
    pred = (S * k.unsqueeze(-1)).sum(-2)  # S^T k: [B, H, Dv]
    u = (v.float() - pred) * beta.float().unsqueeze(-1)
    S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
    return (S * q.unsqueeze(-1)).sum(-2), S
