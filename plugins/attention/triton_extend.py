"""Triton kernels for writing new K/V into the paged pool and for "extend" attention.

Extend = the new tokens of each sequence (a prompt, or its uncached tail) attend to the sequence's
whole context: a cached prefix already in the pool plus the new tokens themselves, causally and
bottom-right aligned (new token i sits at position ``prefix_len + i``). The new K/V are written to
the pool first, so one loop over the sequence's slots (``req_to_token``) covers prefix and new
tokens alike; working on token slots rather than pages makes every page size work unchanged.

Optional, per layer: a sliding window (a query at position p sees keys at positions ``> p - window``;
the loop starts at the block's first visible key) and attention sinks (a per-head logit that joins
the softmax denominator without a value: the running max and sum start from it, as if it were a
key seen before the first block).

Import this module only after the interpreter choice is made: ``@triton.jit`` decides between the
compiled and the interpreted kernel when it runs (i.e. at import), from ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(
    K,
    V,
    K_buf,
    V_buf,
    slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_bs,
    stride_bh,
    stride_vbs,
    stride_vbh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_V: tl.constexpr,
):
    # One program per new token: copy its [heads, dim] K and V rows into the pool slot.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    dst = slot * stride_bs + offs_h[:, None] * stride_bh + offs_d[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(K_buf + dst, k.to(K_buf.dtype.element_ty), mask=mask)
    if HAS_V:  # latent KV keeps no V buffers; V's head size may differ from K's
        offs_dv = tl.arange(0, BLOCK_DV)
        vmask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_dv[None, :] < HEAD_DV)
        v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_dv[None, :], mask=vmask)
        vdst = slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_dv[None, :]
        tl.store(V_buf + vdst, v.to(V_buf.dtype.element_ty), mask=vmask)


@triton.jit
def _extend_kernel(
    Q,
    O,
    K_buf,
    V_buf,
    req_to_token,
    req_pool_indices,
    q_start_loc,
    q_lens,
    kv_lens,
    Sinks,  # [H] fp32 per-head sink logits (read only with HAS_SINKS)
    window,  # sliding window in tokens; 0 = none
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2 (exp2 is the fast path)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bs,
    stride_bh,
    stride_vbs,
    stride_vbh,
    stride_r2t,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # Grid: (sequence, query head, block of BLOCK_M new tokens).
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_blk = tl.program_id(2)
    q_len = tl.load(q_lens + b)
    if m_blk * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_start_loc + b)
    kv_len = tl.load(kv_lens + b)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    prefix_len = kv_len - q_len
    kv_head = h // GROUP

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < HEAD_DV
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:  # bf16 under the interpreter: its tl.dot on bf16 is wrong (triton #11584)
        q = q.to(tl.float32)
    q_pos = prefix_len + offs_m

    if HAS_SINKS:  # the sink as a first "key" with logit sink and no value: m = sink, l = 1
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # Causality bounds the keys this block can see: nothing past its last query's position, and
    # with a window nothing at or before its first query's position - window.
    end = tl.minimum(kv_len, prefix_len + (m_blk + 1) * BLOCK_M)
    lo = tl.where(window > 0, tl.maximum(prefix_len + m_blk * BLOCK_M - window + 1, 0), 0)
    for start in range(lo, end, BLOCK_N):
        offs = start + offs_n
        n_mask = offs < end
        slot = tl.load(req_to_token + row * stride_r2t + offs, mask=n_mask, other=0).to(tl.int64)
        k_off = slot[None, :] * stride_bs + kv_head * stride_bh + offs_d[:, None]  # [D, N]
        k_t = tl.load(K_buf + k_off, mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        k_t = k_t.to(q.dtype)
        s = tl.dot(q, k_t, input_precision=DOT_PREC, out_dtype=tl.float32) * qk_scale
        allowed = (offs[None, :] <= q_pos[:, None]) & n_mask[None, :]
        allowed = allowed & ((window <= 0) | (offs[None, :] > q_pos[:, None] - window))
        s = tl.where(allowed, s, float("-inf"))
        # A row may see no key of a block (before its window, or past its causal end) while its
        # running max is still -inf: shift by 0 then, so every exp2 is exp2(-inf) = 0, never NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = slot[:, None] * stride_vbs + kv_head * stride_vbh + offs_dv[None, :]  # [N, DV]
        v = tl.load(V_buf + v_off, mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PREC, out_dtype=tl.float32)
        m_i = m_new

    # Every real row saw at least its own key, so l_i > 0; padding rows (not stored) may not.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + offs_m).to(tl.int64)
    tl.store(
        O + o_rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=m_mask[:, None] & dv_mask[None, :],
    )


def is_interpreted() -> bool:
    """Whether these kernels were built for Triton's CPU interpreter (decided at import)."""
    # By name: triton.runtime.interpreter is not even imported when compiling.
    return type(_store_kv_kernel).__name__ == "InterpretedFunction"


def dot_options(dtype: torch.dtype) -> tuple[bool, str | None]:
    """(upcast to fp32 before tl.dot, tl.dot input precision) for activations of ``dtype``."""
    upcast = is_interpreted() and dtype == torch.bfloat16
    # fp32 asks for fp32 accuracy: the GPU default (tf32) would lose ~3 decimal digits.
    prec = "ieee" if (dtype == torch.float32 or upcast) else None
    return upcast, prec


def extend_config(block_d: int, dtype: torch.dtype, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the extend kernel."""
    if interpreted:  # small blocks: multi-block loops and tails even on tiny test shapes
        return 16, 16, 4
    if block_d > 256:  # MLA's 576-channel latent (padded to 1024)
        return 16, 16, 4
    if block_d <= 128 and dtype.itemsize <= 2:
        return 64, 64, 4
    return 32, 32, 4  # fp32 or wide heads: shared memory stays under ~100 KB (sm_86/89)


def store_kv(
    k: torch.Tensor, v: torch.Tensor | None, k_buf: torch.Tensor, v_buf: torch.Tensor | None, slots: torch.Tensor
) -> None:
    """Write ``k`` ``[T, Hkv, D]`` / ``v`` ``[T, Hkv, DV]`` into the pool buffers at ``slots``
    ``[T]`` (``v`` None: latent KV, keys only)."""
    t, hkv, d = k.shape
    if t == 0:
        return
    if v is None:
        v, v_buf = k, k_buf  # never read or written (HAS_V off)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1
    dv = v.shape[-1]
    _store_kv_kernel[(t,)](
        k,
        v,
        k_buf,
        v_buf,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        NUM_KV_HEADS=hkv,
        HEAD_DIM=d,
        HEAD_DV=dv,
        BLOCK_H=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_DV=triton.next_power_of_2(dv),
        HAS_V=v is not k,
    )


def extend_attention(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor | None,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    q_start_loc: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Causal attention of ragged new tokens ``q`` ``[T, H, D]`` over their paged context.

    Writes ``o`` ``[T, H, DV]``; ``k_buf``/``v_buf`` must already hold the new tokens' K/V
    (``v_buf`` None: latent KV, the values are the keys' first DV = ``o.shape[-1]`` channels). A query
    at position p sees keys at positions ``> p - sliding_window`` only; ``sinks`` (``[H]`` fp32)
    join each head's softmax denominator.
    """
    num_seqs = q_lens.shape[0]
    _, num_heads, head_dim = q.shape
    group = num_heads // k_buf.shape[1]
    dv = o.shape[-1]
    block_dv = triton.next_power_of_2(dv)
    if v_buf is None:
        v_buf = k_buf
        # Latent KV (the values are the keys' first channels, read through the same buffer): a value
        # block under 64 channels came out wrong compiled (Triton 3.6, sm_90: rows that saw keys past
        # the first 16 of a 64-key tile, MLA extend at page size 1, head 40 / latent 32) and right
        # under the interpreter; 64 was right in the same probe (benchmarks/gpu_check/mla_probe.py).
        block_dv = max(block_dv, 64)
    assert q.stride(-1) == 1 and o.stride(-1) == 1 and req_to_token.stride(-1) == 1
    block_d = triton.next_power_of_2(head_dim)
    block_m, block_n, warps = extend_config(block_d, q.dtype, is_interpreted())
    upcast, prec = dot_options(q.dtype)
    grid = (num_seqs, num_heads, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q,
        o,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        q_start_loc,
        q_lens,
        kv_lens,
        q if sinks is None else sinks,  # any pointer when HAS_SINKS is off: never read
        int(sliding_window or 0),
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        o.stride(0),
        o.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        req_to_token.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DV=dv,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        UPCAST=upcast,
        DOT_PREC=prec,
        HAS_SINKS=sinks is not None,
        num_warps=warps,
        num_stages=2,
    )
