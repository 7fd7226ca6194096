"""Fused row-wise kernels for CUDA (Triton): residual add + RMSNorm, SiLU-and-mul, rotary.

A decode step of a small model on a big GPU is launch-bound: the torch forms of these ops are 2-4
kernels each (an add, a norm; a silu, a mul; a roll, two muls, an add), ~150 of a Qwen2.5-0.5B
step's ~250 kernels. Each is one kernel here. Every program owns whole rows and reduces a row in
one order, so a row's result does not depend on the batch (deterministic mode needs nothing more).
Math is fp32; results are rounded to the input dtype once, where the torch forms round after every
op (differences of an ulp or two of bf16, inside the tests' bounds).

Import this module only after the interpreter choice is made (``TRITON_INTERPRET=1`` for Triton's
CPU interpreter): ``@triton.jit`` decides between the compiled and the interpreted kernel at import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, R, W, Y, S, stride_x, stride_r, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row: y = rms_norm(x [+ r]) * w; with a residual also s = x + r (rounded to
    # the input dtype first, as the unfused ``x + residual`` is, so the norm sees the same sum).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(
            X.dtype.element_ty
        )
        tl.store(S + row * N + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, (xf * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(GU, Y, stride_gu, INTER, BLOCK: tl.constexpr):
    # grid (row, column block): y = silu(gate) * up, gate and up the row's two halves
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + row * INTER + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_kernel(X, C, S, Y, stride_xt, stride_xh, H, HALF, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
    # grid (token, head block): rotate-half with the [cos, cos] / [-sin, sin] tables of layers.py:
    # y1 = x1 cos + x2 (-sin), y2 = x2 cos + x1 sin, for each head of the block
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK)
    mask = (heads[:, None] < H) & (cols[None, :] < HALF)
    src = X + t * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    c_mask = cols < HALF
    c1 = tl.load(C + t * 2 * HALF + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(C + t * 2 * HALF + HALF + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(S + t * 2 * HALF + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(S + t * 2 * HALF + HALF + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    dst = Y + (t * H + heads[:, None]) * 2 * HALF + cols[None, :]
    tl.store(dst, (x1 * c1 + x2 * s1).to(Y.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * c2 + x1 * s2).to(Y.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    return 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``rms_norm(x + residual) * weight`` over the last dim, rows of ``x [..., N]``; with
    ``residual`` also returns ``x + residual`` (both new, contiguous, in ``x``'s dtype)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = None
    r2 = x2
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            y,
            y if s is None else s,
            x2.stride(0),
            r2.stride(0),
            n,
            eps,
            HAS_RES=s is not None,
            BLOCK=block,
            num_warps=_warps(block),
        )
    return y if s is None else (y, s)


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2 * inter]`` (gate first) -> ``[T, inter]``."""
    gu = gate_up.reshape(-1, 2 * inter)
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    y = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0]:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(gu.shape[0], triton.cdiv(inter, block))](gu, y, gu.stride(0), inter, BLOCK=block, num_warps=4)
    return y


def rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [T, H, D]`` (last dim contiguous, any token/head strides) with the
    ``[T, 1, D]`` tables of :meth:`RotaryEmbedding.table` -> a new contiguous ``[T, H, D]``."""
    t, h, d = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    cos2, sin2 = cos2.reshape(t, d).contiguous(), sin2.reshape(t, d).contiguous()
    y = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    if t:
        block = triton.next_power_of_2(d // 2)
        block_h = min(triton.next_power_of_2(h), max(1, 2048 // block))
        _rotate_kernel[(t, triton.cdiv(h, block_h))](
            x, cos2, sin2, y, x.stride(0), x.stride(1), h, d // 2, BLOCK_H=block_h, BLOCK=block, num_warps=4
        )
    return y
