"""Decode-shaped GEMMs on CUDA (a few rows times a weight), each one Triton kernel with the op
before it folded in.

A decode step of one sequence multiplies one row by each weight. cuBLAS runs such a product as a
split-K GEMM and often a separate reduce, and the ops before it (residual add + RMSNorm before QKV
and gate/up, SiLU-and-mul before down) are kernels of their own: a Llama-style layer is 10-12
launches. Here each program owns ``BLOCK_N`` output columns of every row and streams its weight rows
once over the whole K, computing its input on the fly from the op before:

- ``norm``: ``rms_norm(x [+ residual]) * weight``, rounded to the activations' dtype as
  ``triton_pointwise.rms_norm`` rounds it (the first program also writes ``x + residual``, the next
  residual);
- ``silu_mul``: ``silu(gate) * up`` of a fused gate/up output, rounded as ``silu_mul`` rounds it;

and, for a QKV product, its output handled on the spot (``rope``): the bias added, Q and K rotated,
K and V written into the KV pool, with ``triton_rope_store``'s roundings. A decoder layer is then
five launches: norm + QKV + rotate-and-store, attention, O, norm + gate/up, SiLU + down. A row's
result does not depend on the other rows (each row reduces in the same order whatever the row
count). Whether it beats cuBLAS depends on the GPU and the widths: ``gemv_choice.py`` times both
forms at start-up unless ``LLMKIT_TRITON_GEMV`` forces one (``layers.py``). It is interpreter-tested
and compiled for sm_80/sm_90 without spills here.

Import this module only after the interpreter choice is made (as ``triton_pointwise``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

#: the most rows a call takes (a decode step of a few sequences); more rows are GEMMs for cuBLAS
MAX_ROWS = 4

NONE, NORM, SILU_MUL = 0, 1, 2


@triton.jit
def _input_block(x_rows, r_rows, kk, mask, HAS_RES: tl.constexpr):
    # x [+ r] over columns kk, the sum rounded to the activations' dtype as the unfused x + residual
    h = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
    if HAS_RES:
        h = (h.to(tl.float32) + tl.load(r_rows + kk[None, :], mask=mask, other=0.0).to(tl.float32)).to(h.dtype)
    return h


@triton.jit
def _gemv_kernel(
    X,
    R,
    NW,
    W,
    Y,
    S,
    M,
    N,
    K,
    stride_x,
    stride_r,
    stride_w,
    stride_y,
    eps,
    # the rotate-and-store epilogue's (read only with ROPE)
    Bias,
    C,
    Sn,
    K_buf,
    V_buf,
    slots,
    stride_bs,
    stride_bh,
    stride_vbs,
    stride_vbh,
    PROLOGUE: tl.constexpr,  # 0: x as it is, 1: rms_norm(x [+ r]) * nw, 2: silu(x[:, :K]) * x[:, K:]
    HAS_RES: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    PAIR: tl.constexpr,  # with ROPE: the head's half, D / 2
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Grid: one program per BLOCK_N output columns, all rows. y[m, n] = sum_k in(x)[m, k] * W[n, k].
    # With ROPE a program's columns are a head's j.. and j + D/2.. (PAIR = D/2) interleaved, the
    # pairs that rotate into each other.
    pid = tl.program_id(0)
    if ROPE:
        first = pid * (BLOCK_N // 2)
        head = first // PAIR
        i = tl.arange(0, BLOCK_N)
        offs_n = head * 2 * PAIR + first % PAIR + i // 2 + (i % 2) * PAIR
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    m_mask = rows < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = X + rows[:, None].to(tl.int64) * stride_x
    r_rows = R + rows[:, None].to(tl.int64) * stride_r
    if PROLOGUE == 1:  # the norm needs each row's sum of squares first: one pass over the (small) rows
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            mask = m_mask[:, None] & (kk < K)[None, :]
            h = _input_block(x_rows, r_rows, kk, mask, HAS_RES)
            if HAS_RES and pid == 0:
                tl.store(S + rows[:, None].to(tl.int64) * K + kk[None, :], h, mask=mask)
            hf = h.to(tl.float32)
            ss += tl.sum(hf * hf, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    # Products summed lane by lane across the K loop and reduced across lanes once at the end: a
    # reduction per iteration would shuffle between threads every BLOCK_K.
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_w
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        mask = m_mask[:, None] & k_mask[None, :]
        x = _input_block(x_rows, r_rows, kk, mask, HAS_RES)  # (a residual comes only with the norm)
        if PROLOGUE == 1:
            nw = tl.load(NW + kk, mask=k_mask, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * rstd[:, None] * nw[None, :]).to(X.dtype.element_ty)
        if PROLOGUE == 2:
            g = x.to(tl.float32)
            u = tl.load(x_rows + K + kk[None, :], mask=mask, other=0.0).to(tl.float32)
            x = (g / (1.0 + tl.exp(-g)) * u).to(X.dtype.element_ty)
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2).to(X.dtype.element_ty)
    if ROPE:
        ya, yb = tl.split(tl.reshape(y, [BLOCK_M, BLOCK_N // 2, 2]))
        j = first % PAIR + tl.arange(0, BLOCK_N // 2)
        offs_a = head * 2 * PAIR + j
        # The two half-runs of one head (columns j and j + D/2): the bias added and rounded as the
        # projection's add rounds it; Q rotated into Y; K rotated and V as it is written into the
        # pool at the rows' slots; triton_rope_store's roundings (the numbers rope_store_kv gives).
        if HAS_BIAS:
            ya = (ya.to(tl.float32) + tl.load(Bias + offs_a).to(tl.float32)[None, :]).to(ya.dtype)
            yb = (yb.to(tl.float32) + tl.load(Bias + PAIR + offs_a).to(tl.float32)[None, :]).to(yb.dtype)
        mask = m_mask[:, None]
        slot = tl.load(slots + rows, mask=m_mask, other=0).to(tl.int64)[:, None]
        if head < NUM_HEADS + NUM_KV_HEADS:  # Q or K: rotate
            xa, xb = ya.to(tl.float32), yb.to(tl.float32)
            table = rows[:, None].to(tl.int64) * 2 * PAIR + j[None, :]
            c1 = tl.load(C + table, mask=mask, other=0.0).to(tl.float32)
            c2 = tl.load(C + PAIR + table, mask=mask, other=0.0).to(tl.float32)
            s1 = tl.load(Sn + table, mask=mask, other=0.0).to(tl.float32)
            s2 = tl.load(Sn + PAIR + table, mask=mask, other=0.0).to(tl.float32)
            ra = (xa * c1 + xb * s1).to(ya.dtype)
            rb = (xb * c2 + xa * s2).to(ya.dtype)
            if head < NUM_HEADS:
                out = Y + rows[:, None].to(tl.int64) * stride_y + offs_a[None, :]
                tl.store(out, ra, mask=mask)
                tl.store(out + PAIR, rb, mask=mask)
            else:
                dst = K_buf + slot * stride_bs + (head - NUM_HEADS) * stride_bh + j[None, :]
                tl.store(dst, ra.to(K_buf.dtype.element_ty), mask=mask)
                tl.store(dst + PAIR, rb.to(K_buf.dtype.element_ty), mask=mask)
        else:
            dst = V_buf + slot * stride_vbs + (head - NUM_HEADS - NUM_KV_HEADS) * stride_vbh + j[None, :]
            tl.store(dst, ya.to(V_buf.dtype.element_ty), mask=mask)
            tl.store(dst + PAIR, yb.to(V_buf.dtype.element_ty), mask=mask)
    else:
        out = Y + rows[:, None].to(tl.int64) * stride_y + offs_n[None, :]
        tl.store(out, y.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemv_config(rows: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): the rows in one block; column blocks narrow enough
    that a 0.5B model's smallest projection still spreads over ~100 programs; the K slice sized so
    that the [M, N, K] product stays at 4,096 fp32 values (32 registers a thread at 4 warps)."""
    block_m = triton.next_power_of_2(max(rows, 1))
    block_n = 16 if n >= 4096 else 8
    block_k = 4096 // (block_m * block_n)
    return block_m, block_n, block_k, 4


class RopeStore(NamedTuple):
    """The rotate-and-store epilogue of a QKV product ``[Q heads | K heads | V heads]`` (head size
    D): the rotary rows ``cos2, sin2 [M, 1, D]`` (``RotaryEmbedding.table``), the pool's layer
    buffers and the rows' slots, the query head count, and the projection's bias (or None)."""

    cos2: torch.Tensor
    sin2: torch.Tensor
    num_heads: int
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    slots: torch.Tensor
    bias: torch.Tensor | None


def rope_fits(head_dim: int, n: int) -> bool:
    """Whether a QKV product of width ``n`` can take the rotate-and-store epilogue: a program's half
    runs must stay inside one head's half."""
    return head_dim % 2 == 0 and (head_dim // 2) % (gemv_config(1, n)[1] // 2) == 0


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    rope: RopeStore | None = None,
    config: tuple[int, int, int, int] | None = None,
):
    """``in(x) @ weight.T`` for ``x [M <= MAX_ROWS, K]`` (``[M, 2K]`` with ``silu_mul``) and
    ``weight [N, K]``, in ``x``'s dtype. ``norm=(w, eps)``: ``in`` is ``rms_norm(x + residual) * w``,
    and with ``residual`` returns ``(y, x + residual)``; ``silu_mul``: ``in`` is ``silu(gate) * up``.
    ``rope``: ``y`` is a QKV product whose bias is added, Q and K rotated, and K and V written into
    the pool; what returns in ``y``'s place is the rotated ``q [M, H, D]`` (as
    ``triton_rope_store.rope_store_kv`` returns it from the product: the same numbers).
    ``config``: another (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) than :func:`gemv_config`'s (a probe's)."""
    rows = x.shape[0]
    k = weight.shape[1]
    assert rows <= MAX_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1
    assert x.shape[1] == (2 * k if silu_mul else k), (x.shape, weight.shape)
    assert residual is None or norm is not None, "a residual is summed in front of the norm only"
    n = weight.shape[0]
    block_m, block_n, block_k, warps = config or gemv_config(rows, n)
    if rope is None:
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        pair, ptrs, pool_strides, heads = 0, (y,) * 6, (0, 0, 0, 0), (0, 0)
    else:
        d = rope.k_buf.shape[-1]
        heads = (rope.num_heads, rope.k_buf.shape[1])
        assert n == (heads[0] + 2 * heads[1]) * d and rope.k_buf.stride(-1) == 1 and rope.v_buf.stride(-1) == 1
        pair = d // 2
        assert pair % (block_n // 2) == 0, "a program's columns must stay inside one head half (rope_fits)"
        y = torch.empty(rows, heads[0], d, dtype=x.dtype, device=x.device)
        cos2, sin2 = rope.cos2.reshape(rows, d).contiguous(), rope.sin2.reshape(rows, d).contiguous()
        bias = rope.bias if rope.bias is not None else y  # any pointer when HAS_BIAS is off: never read
        ptrs = (bias, cos2, sin2, rope.k_buf, rope.v_buf, rope.slots)
        pool_strides = (rope.k_buf.stride(0), rope.k_buf.stride(1), rope.v_buf.stride(0), rope.v_buf.stride(1))
    s = torch.empty(rows, k, dtype=x.dtype, device=x.device) if residual is not None else None
    r = residual if residual is not None else x
    assert r.stride(-1) == 1
    nw, eps = norm if norm is not None else (x, 0.0)
    if rows:
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x,
            r,
            nw,
            weight,
            y,
            y if s is None else s,
            rows,
            n,
            k,
            x.stride(0),
            r.stride(0),
            weight.stride(0),
            y.stride(0),
            eps,
            *ptrs,
            *pool_strides,
            PROLOGUE=NORM if norm is not None else SILU_MUL if silu_mul else NONE,
            HAS_RES=residual is not None,
            ROPE=rope is not None,
            HAS_BIAS=rope is not None and rope.bias is not None,
            NUM_HEADS=heads[0],
            NUM_KV_HEADS=heads[1],
            PAIR=pair,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=warps,
        )
    return y if s is None else (y, s)
