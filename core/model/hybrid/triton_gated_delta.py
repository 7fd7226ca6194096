"""The decode step of a Gated DeltaNet layer for CUDA (Triton): the short convolution with its
state and the gated delta rule's recurrent form, states read from their slots and written to the
other working slots, as ``cpu_gated_delta.c`` does on the CPU.

The rule is independent across a state's value columns (``S[:, j]`` is updated from ``k``, ``q``,
``v[j]`` and the decay alone), so a program owns one (sequence, value head, block of columns): it
reads that ``[Dk, BLOCK_V]`` slice once, keeps it in registers for both reductions and writes the
new slice. Math in fp32. The torch reference is ``gated_delta_rule.recurrent`` /
``causal_conv.conv_step``; tests run these kernels in Triton's interpreter against it.

Import this module only after the interpreter choice is made (``TRITON_INTERPRET=1`` for Triton's
CPU interpreter): ``@triton.jit`` decides between the compiled and the interpreted kernel at import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step_kernel(X, W, S, READ, WRITE, FRESH, OUT, x_row, C, K: tl.constexpr, BLOCK: tl.constexpr):
    # program (sequence b, block of channels): out = silu(sum_t w[c, t] * window[c, t]) over the
    # window (state[c, :K-1], x[c]); the new state is the window's last K-1 entries
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < C
    src = tl.load(READ + b) * C * (K - 1)
    dst = tl.load(WRITE + b) * C * (K - 1)
    keep = tl.load(FRESH + b) == 0
    x = tl.load(X + b * x_row + c, mask=mask, other=0.0).to(tl.float32)
    acc = x * tl.load(W + c * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    for t in tl.static_range(K - 1):
        s = tl.load(S + src + c * (K - 1) + t, mask=mask, other=0.0).to(tl.float32)
        s = tl.where(keep, s, 0.0)  # (a where: a slot never written may hold NaN)
        acc += s * tl.load(W + c * K + t, mask=mask, other=0.0).to(tl.float32)
        if t > 0:
            tl.store(S + dst + c * (K - 1) + t - 1, s.to(S.dtype.element_ty), mask=mask)
    tl.store(S + dst + c * (K - 1) + K - 2, x.to(S.dtype.element_ty), mask=mask)
    tl.store(OUT + b * C + c, acc / (1.0 + tl.exp(-acc)), mask=mask)


@triton.jit
def _gated_delta_step_kernel(
    QKV,
    G,
    BETA,
    S,
    READ,
    WRITE,
    FRESH,
    OUT,
    qkv_row,
    k_off,
    v_off,
    Hv,
    per_k,
    scale,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # program (sequence b * Hv + value head h, block of value columns)
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // Hv, bh % Hv
    j = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    i = tl.arange(0, DK)
    jmask = j < DV
    kh = h // per_k
    row = QKV + b * qkv_row
    q = tl.load(row + kh * DK + i).to(tl.float32)
    k = tl.load(row + k_off + kh * DK + i).to(tl.float32)
    q = q * scale / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(row + v_off + h * DV + j, mask=jmask, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(G + bh).to(tl.float32))
    beta = tl.load(BETA + bh).to(tl.float32)
    src = (tl.load(READ + b) * Hv + h) * DK * DV
    dst = (tl.load(WRITE + b) * Hv + h) * DK * DV
    keep = tl.load(FRESH + b) == 0
    offs = i[:, None] * DV + j[None, :]
    s = tl.load(S + src + offs, mask=jmask[None, :], other=0.0)  # [DK, BLOCK_V]
    s = tl.where(keep, s, 0.0) * decay
    pred = tl.sum(s * k[:, None], axis=0)
    u = (v - pred) * beta
    s = s + k[:, None] * u[None, :]
    tl.store(S + dst + offs, s, mask=jmask[None, :])
    tl.store(OUT + bh * DV + j, tl.sum(s * q[:, None], axis=0), mask=jmask)


def conv_step(mixed, weight, conv_buf, read, write, fresh):
    """``causal_conv.conv_step`` on rows ``mixed [B, C]``, states from slots ``read`` of ``conv_buf``
    into slots ``write``; returns fp32 ``[B, C]``."""
    b, c = mixed.shape
    k = weight.shape[1]
    out = torch.empty(b, c, dtype=torch.float32, device=mixed.device)
    if b:
        mixed = mixed if mixed.stride(-1) == 1 else mixed.contiguous()
        block = 256
        _conv_step_kernel[(b, triton.cdiv(c, block))](
            mixed, weight.contiguous(), conv_buf, read, write, fresh, out, mixed.stride(0), c, K=k, BLOCK=block
        )
    return out


def gated_delta_step(qkv, key_dim, g, beta, rec_buf, read, write, fresh, hk, hv, dk, dv):
    """``gated_delta_rule.recurrent`` on rows ``qkv [B, 2 key_dim + hv dv]`` (queries, keys,
    values), states from slots ``read`` of ``rec_buf`` into slots ``write``; returns ``[B, hv, dv]``."""
    b = qkv.shape[0]
    out = torch.empty(b, hv, dv, dtype=torch.float32, device=qkv.device)
    if b:
        qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
        block_v = min(32, triton.next_power_of_2(dv))
        _gated_delta_step_kernel[(b * hv, triton.cdiv(dv, block_v))](
            qkv,
            g.float().contiguous(),
            beta.float().contiguous(),
            rec_buf,
            read,
            write,
            fresh,
            out,
            qkv.stride(0),
            key_dim,
            2 * key_dim,
            hv,
            hv // hk,
            dk**-0.5,
            DK=dk,
            DV=dv,
            BLOCK_V=block_v,
        )
    return out
