"""One Triton kernel for a decode step's attention input: from a fused projection
``qkv [T, (H + 2 Hkv) D]`` whose Q and K are not rotated yet, rotate Q into a tensor of its own,
rotate K and write K and V into the paged pool (adding the projection's bias first, where the
caller left it out). Separately that is a rotation, a K/V store and a bias add: two or three small
launches a layer, which a decode step pays once per layer.

Import this module only after the interpreter choice is made (as ``triton_extend``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_store_kernel(
    QKV,
    C,
    S,
    Q_out,
    K_buf,
    V_buf,
    slots,
    Bias,  # [(H + 2 Hkv) D] the projection's bias, not yet added (read only with HAS_BIAS)
    stride_qkv,
    stride_bs,
    stride_bh,
    stride_vbs,
    stride_vbh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # One program per new token of a fused projection [Q heads | K heads | V heads]: rotate its Q
    # into Q_out, rotate its K and write K and V into the pool slot. The rotation and roundings are
    # triton_pointwise._rotate_kernel's followed by _store_kv_kernel's (rotate in fp32, round to the
    # activations' dtype, then to the pool's), so the numbers equal rotate-then-store_kv's. A bias
    # is added first and rounded to the activations' dtype, as the projection's own add would.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    c_mask = cols < HALF
    c1 = tl.load(C + t * 2 * HALF + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(C + t * 2 * HALF + HALF + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(S + t * 2 * HALF + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(S + t * 2 * HALF + HALF + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    row = QKV + t * stride_qkv
    for h0 in range(0, NUM_HEADS, BLOCK_H):  # Q, a block of heads at a time (registers)
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < NUM_HEADS) & c_mask[None, :]
        src = row + heads[:, None] * 2 * HALF + cols[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = Bias + heads[:, None] * 2 * HALF + cols[None, :]
            x1 = (x1 + tl.load(b, mask=mask, other=0.0).to(tl.float32)).to(Q_out.dtype.element_ty).to(tl.float32)
            x2 = (x2 + tl.load(b + HALF, mask=mask, other=0.0).to(tl.float32)).to(Q_out.dtype.element_ty)
            x2 = x2.to(tl.float32)
        dst = Q_out + (t * NUM_HEADS + heads[:, None]) * 2 * HALF + cols[None, :]
        tl.store(dst, (x1 * c1 + x2 * s1).to(Q_out.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (x2 * c2 + x1 * s2).to(Q_out.dtype.element_ty), mask=mask)
    # K, rotated, and V, as they are
    kh = tl.arange(0, BLOCK_KH)
    kmask = (kh[:, None] < NUM_KV_HEADS) & c_mask[None, :]
    ksrc = row + (NUM_HEADS + kh[:, None]) * 2 * HALF + cols[None, :]
    k1 = tl.load(ksrc, mask=kmask, other=0.0).to(tl.float32)
    k2 = tl.load(ksrc + HALF, mask=kmask, other=0.0).to(tl.float32)
    v1 = tl.load(ksrc + NUM_KV_HEADS * 2 * HALF, mask=kmask, other=0.0)
    v2 = tl.load(ksrc + NUM_KV_HEADS * 2 * HALF + HALF, mask=kmask, other=0.0)
    if HAS_BIAS:
        kb = Bias + (NUM_HEADS + kh[:, None]) * 2 * HALF + cols[None, :]
        k1 = (k1 + tl.load(kb, mask=kmask, other=0.0).to(tl.float32)).to(Q_out.dtype.element_ty).to(tl.float32)
        k2 = (k2 + tl.load(kb + HALF, mask=kmask, other=0.0).to(tl.float32)).to(Q_out.dtype.element_ty)
        k2 = k2.to(tl.float32)
        vb = kb + NUM_KV_HEADS * 2 * HALF
        v1 = (v1.to(tl.float32) + tl.load(vb, mask=kmask, other=0.0).to(tl.float32)).to(Q_out.dtype.element_ty)
        v2 = (v2.to(tl.float32) + tl.load(vb + HALF, mask=kmask, other=0.0).to(tl.float32)).to(Q_out.dtype.element_ty)
    r1 = (k1 * c1 + k2 * s1).to(Q_out.dtype.element_ty).to(K_buf.dtype.element_ty)
    r2 = (k2 * c2 + k1 * s2).to(Q_out.dtype.element_ty).to(K_buf.dtype.element_ty)
    kdst = K_buf + slot * stride_bs + kh[:, None] * stride_bh + cols[None, :]
    tl.store(kdst, r1, mask=kmask)
    tl.store(kdst + HALF, r2, mask=kmask)
    vdst = V_buf + slot * stride_vbs + kh[:, None] * stride_vbh + cols[None, :]
    tl.store(vdst, v1.to(V_buf.dtype.element_ty), mask=kmask)
    tl.store(vdst + HALF, v2.to(V_buf.dtype.element_ty), mask=kmask)


def rope_store_kv(
    qkv: torch.Tensor,
    cos2: torch.Tensor,
    sin2: torch.Tensor,
    num_heads: int,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """From a fused projection ``qkv [T, (H + 2 Hkv) D]`` whose Q and K are not rotated yet, with
    the rotary tables ``cos2, sin2 [T, 1, D]``: write the rotated K and the V into the pool at
    ``slots`` and return the rotated ``q [T, H, D]``, in one kernel (rotating, then
    :func:`triton_extend.store_kv`, takes two). ``bias`` ``[(H + 2 Hkv) D]``: the projection's, added first (one
    kernel fewer again)."""
    t = qkv.shape[0]
    hkv, d = k_buf.shape[1], k_buf.shape[2]
    q = qkv.new_empty(t, num_heads, d)
    if t == 0:
        return q
    assert qkv.stride(1) == 1 and k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1 and d % 2 == 0
    cos2, sin2 = cos2.reshape(t, d).contiguous(), sin2.reshape(t, d).contiguous()
    block = triton.next_power_of_2(d // 2)
    _rope_store_kernel[(t,)](
        qkv,
        cos2,
        sin2,
        q,
        k_buf,
        v_buf,
        slots,
        qkv if bias is None else bias,  # any pointer when HAS_BIAS is off: never read
        qkv.stride(0),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=hkv,
        HALF=d // 2,
        BLOCK_H=min(triton.next_power_of_2(num_heads), max(1, 2048 // block)),
        BLOCK_KH=triton.next_power_of_2(hkv),
        BLOCK=block,
        HAS_BIAS=bias is not None,
        num_warps=4,
    )
    return q
