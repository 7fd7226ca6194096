"""Triton kernel for batched decode attention over paged KV: split-K, merged in the same launch.

Decode has one query token per sequence, so a program per (sequence, head) would leave most of the
GPU idle on small batches with long contexts. The context is split into ``num_splits`` chunks, one
program each, which computes a partial softmax-weighted sum (all query heads of one KV head at
once, so GQA reads each K/V row once) and stores it with its log-sum-exp. The last program of a
(sequence, head block) to finish -- it counts the finished ones on an atomic counter -- merges
them, so decode attention is one launch a layer (a launch costs a few microseconds, even inside a
CUDA graph).

The grid depends only on the batch size, the head counts and ``num_splits`` -- never on the context
lengths, which the kernel reads from device memory -- so a captured CUDA graph stays valid as the
sequences grow. Chunk boundaries depend only on a sequence's own length and ``num_splits``.

A sliding window narrows the range the splits divide to the window's keys (the query sits at
position ``kv_len - 1``, so it sees positions ``>= kv_len - window``); attention sinks join the
softmax denominator in the merge, where each head's log-sum-exps meet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmkit.plugins.attention.triton_extend import LOG2E, dot_options, is_interpreted


@triton.jit
def _merge_splits(
    mo, ml, sinks, h_mask, hd_mask, stride_mos, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr
):
    """The softmax over all splits, ``[BLOCK_H, BLOCK_DV]`` fp32, from split 0's partials ``mo``
    ``[BLOCK_H, BLOCK_DV]`` and log-sum-exps ``ml`` ``[BLOCK_H]`` (pointers; the splits follow),
    a split at a time: a [heads, splits, DV] tile would not fit in registers with MLA's 512
    channels. The loads bypass L1, which other SMs' stores do not update."""
    offs_s = tl.arange(0, BLOCK_S)
    hs_mask = h_mask[:, None] & (offs_s[None, :] < NUM_SPLITS)
    lse = tl.load(ml[:, None] + offs_s[None, :], mask=hs_mask, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 1)  # finite for the group's heads: split 0 is never empty
    if HAS_SINKS:  # the sink's logit (base 2) joins the max and the denominator, with no value
        sink = tl.load(sinks, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(h_mask, m, 0.0)  # padding heads (past the group) have no splits: keep them NaN-free
    w = tl.exp2(lse - m[:, None])
    denom = tl.sum(w, 1)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    acc = tl.zeros(hd_mask.shape, dtype=tl.float32)
    for s in range(NUM_SPLITS):
        part = tl.load(mo + s * stride_mos, mask=hd_mask, other=0.0, cache_modifier=".cg")
        acc += part * tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), 1)[:, None]
    return acc / tl.where(h_mask, denom, 1.0)[:, None]


@triton.jit
def _decode_split_kernel(
    Q,
    K_buf,
    V_buf,
    req_to_token,
    req_pool_indices,
    kv_lens,
    Mid_O,
    Mid_LSE,
    O,
    Sinks,  # [H] fp32 per-head sink logits (read only with HAS_SINKS)
    Counter,  # int32, one per (sequence, program_id(1)): finished splits; zero between launches
    window,  # sliding window in tokens; 0 = none
    qk_scale,  # softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_bs,
    stride_bh,
    stride_vbs,
    stride_vbh,
    stride_r2t,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # Grid: (sequence, KV head x block of its query heads, split).
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens + b)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    # The keys the query sees: all of them, or the last ``window``.
    seq_lo = tl.where(window > 0, tl.maximum(kv_len - window, 0), 0)
    # Chunks are whole BLOCK_Ns so short contexts use few splits; trailing splits may be empty.
    chunk = tl.cdiv(tl.cdiv(kv_len - seq_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = seq_lo + split * chunk
    hi = tl.minimum(lo + chunk, kv_len)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # query heads within the KV head's group
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < HEAD_DV
    heads = kv_head * GROUP + offs_h
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:  # bf16 under the interpreter: its tl.dot on bf16 is wrong (triton #11584)
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs = start + offs_n
        n_mask = offs < hi
        slot = tl.load(req_to_token + row * stride_r2t + offs, mask=n_mask, other=0).to(tl.int64)
        k_off = slot[None, :] * stride_bs + kv_head * stride_bh + offs_d[:, None]  # [D, N]
        k_t = tl.load(K_buf + k_off, mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        s = tl.dot(q, k_t.to(q.dtype), input_precision=DOT_PREC, out_dtype=tl.float32) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every chunk that runs has a valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = slot[:, None] * stride_vbs + kv_head * stride_vbh + offs_dv[None, :]  # [N, DV]
        v = tl.load(V_buf + v_off, mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC, out_dtype=tl.float32
        )
        m_i = m_new

    # An empty split stores lse = -inf and a zero partial; the merge gives it weight 0.
    has = l_i > 0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    part = acc / tl.where(has, l_i, 1.0)[:, None]
    mo = Mid_O + b.to(tl.int64) * stride_mob + heads[:, None] * stride_moh + offs_dv[None, :]  # split 0's
    ml = Mid_LSE + b.to(tl.int64) * stride_lb + heads * stride_lh
    hd_mask = h_mask[:, None] & dv_mask[None, :]
    tl.store(mo + split * stride_mos, part, mask=hd_mask)
    tl.store(ml + split, lse, mask=h_mask)

    # The last of the (sequence, head block)'s split programs to finish merges them all. The barrier
    # has every thread's stores issued before the counter's release publishes them (one thread does
    # the atomic), and makes them visible to this program's other threads, which read them back.
    tl.debug_barrier()
    if NUM_SPLITS == 1:  # the only program: nothing to count
        last = True
    else:
        idx = b * tl.num_programs(1) + tl.program_id(1)
        last = tl.atomic_add(Counter + idx, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1
    if last:
        out = _merge_splits(mo, ml, Sinks + heads, h_mask, hd_mask, stride_mos, NUM_SPLITS, BLOCK_S, HAS_SINKS)
        o = O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
        tl.store(o, out.to(O.dtype.element_ty), mask=hd_mask)
        if NUM_SPLITS > 1:
            tl.store(Counter + idx, 0)  # nothing else touches it before the next launch


def decode_config(block_d: int, dtype: torch.dtype, interpreted: bool) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the decode kernel."""
    if interpreted:
        return 16, 4
    if block_d > 256:  # MLA's 576-channel latent (padded to 1024): keep the K/V tiles in shared memory
        return 16, 4
    return (64, 4) if block_d <= 128 and dtype.itemsize <= 2 else (32, 4)


def alloc_split_buffers(
    batch: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs ``[B, H, S, D]`` (D: the output's head size) and log-sum-exps
    ``[B, H, S]`` of the splits."""
    mid_o = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    mid_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
    return mid_o, mid_lse


def _block_h(group: int, head_dim: int) -> int:
    """Query heads a program takes (BLOCK_H). tl.dot needs at least 16 rows on tensor cores (unused
    head rows are masked). A KV head's whole query group goes in one program, unless the heads are
    wide (MLA: up to 128 query heads over one 576-channel latent), where blocks of 16 heads keep the
    tiles on chip."""
    return 16 if triton.next_power_of_2(head_dim) > 256 else max(16, triton.next_power_of_2(group))


def counter_count(batch: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """How many counters :func:`decode_attention` needs: one per (sequence, KV head, block of its
    query heads). ``head_dim``: the keys' head size (q's)."""
    group = num_heads // num_kv_heads
    return batch * num_kv_heads * triton.cdiv(group, _block_h(group, head_dim))


def alloc_counters(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 split counters; :func:`decode_attention` leaves them zeroed, so allocate once."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def decode_attention(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor | None,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    counters: torch.Tensor,
    num_splits: int,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attention of one query per sequence ``q`` ``[B, H, D]`` over its paged context into ``o``.

    The query (at position ``kv_len - 1``) sees only the last ``sliding_window`` keys when given;
    ``sinks`` (``[H]`` fp32) join each head's softmax denominator.

    ``v_buf`` None: latent KV, the values are the keys' first DV = ``o.shape[-1]`` channels.
    ``mid_o``/``mid_lse`` are scratch from :func:`alloc_split_buffers` with at least ``B`` rows and
    ``num_splits`` splits (views of larger static buffers are fine: strides are honoured).
    ``counters``: at least :func:`counter_count` zeroed int32 from :func:`alloc_counters`, zeroed again
    when the kernel ends; launches that may overlap (other streams) need their own.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    dv = o.shape[-1]
    if v_buf is None:
        v_buf = k_buf
    assert q.stride(-1) == 1 and o.stride(-1) == 1 and req_to_token.stride(-1) == 1
    assert mid_o.stride(-1) == 1 and mid_lse.stride(-1) == 1
    block_d = triton.next_power_of_2(head_dim)
    block_n, warps = decode_config(block_d, q.dtype, is_interpreted())
    upcast, prec = dot_options(q.dtype)
    block_h = _block_h(group, head_dim)
    head_blocks = triton.cdiv(group, block_h)
    assert counters.dtype == torch.int32 and counters.is_contiguous()
    assert counters.numel() >= counter_count(batch, num_heads, num_kv_heads, head_dim)
    _decode_split_kernel[(batch, num_kv_heads * head_blocks, num_splits)](
        q,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        kv_lens,
        mid_o,
        mid_lse,
        o,
        mid_lse if sinks is None else sinks,  # any pointer when HAS_SINKS is off: never read
        counters,
        int(sliding_window or 0),
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        o.stride(0),
        o.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DV=dv,
        NUM_SPLITS=num_splits,
        HEAD_BLOCKS=head_blocks,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=triton.next_power_of_2(dv),
        BLOCK_S=triton.next_power_of_2(num_splits),
        UPCAST=upcast,
        DOT_PREC=prec,
        HAS_SINKS=sinks is not None,
        num_warps=warps,
        num_stages=2,
    )
