"""LoRA deltas on CUDA in two Triton launches per projection for the whole batch (BGMV style).

Every row of a forward carries its adapter's slot (``row_slot [T]`` int32, ``-1``: no adapter),
built once per forward by :meth:`LoRAManager.activate`. Per layer, the adapters sit in a fixed set
of slots (:class:`~llmkit.core.lora.slot_pool.SlotPool`), each written once when its adapter
takes it:

- ``a [slots, R, in]``: each adapter's stacked A (``[blocks * r, in]``, one rank block per part of
  a fused layer it adapts), zero-padded to the slots' ``R`` (the layer's blocks x the largest rank);
- ``b [slots, out, r_max]``: each output row's *own* rank block of the block-diagonal B only
  (``b[s, n, j] = B[n, block(n) * r + j]``), so the expand reads ``out * r`` weights, not
  ``out * blocks * r``; ``lo / hi [slots, 3]`` give each rank block's output rows.

``shrink``: ``t[row, :blocks * r] = x[row] @ A_slot^T`` (fp32), grid (rows, rank tiles).
``expand``: ``y[row, n] += t[row, block(n) * r : +r] . b[slot, n]``, grid (rows, output tiles),
in place on the base layer's output; columns of parts the adapter leaves out are not touched.

Why per row (BGMV) and not per segment (SGMV): a decode batch has one row per sequence and any mix
of adapters, and a row picks its weights by its own slot with no sorting, no segment table and no
host-side count; a row's result does not depend on its batch-mates (the deterministic mode holds).
A long prefill re-reads its adapter's A and B per row (from L2: they are small); a segmented
kernel with ``tl.dot`` over row blocks is the follow-up for prefill-heavy loads.

Import this module only after the interpreter choice is made (``TRITON_INTERPRET=1`` for Triton's
CPU interpreter): ``@triton.jit`` decides between the compiled and the interpreted kernel at import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmkit.core.lora.slot_pool import MAX_BLOCKS, Stack


@triton.jit
def _shrink_kernel(
    X,  # [T, K] activations
    A,  # [slots, R, K] stacked A per slot, zero-padded rows past a slot's R
    Tmp,  # [T, R] fp32 out
    row_slot,  # [T] int32 slot of each row; -1: no adapter
    r_total,  # [slots] int32 rows of each slot's A (0: the slot does not adapt this layer)
    K,
    stride_xm,
    stride_as,
    stride_ar,
    stride_tm,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pid_r = tl.program_id(1)
    slot = tl.load(row_slot + row).to(tl.int64)
    if slot < 0:
        return
    rt = tl.load(r_total + slot)
    if pid_r * BLOCK_R >= rt:
        return
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rt
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + row * stride_xm + offs_k
    a_ptrs = A + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :]
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        xv = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        av = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    tl.store(Tmp + row * stride_tm + offs_r, acc, mask=r_mask)


@triton.jit
def _expand_kernel(
    Tmp,  # [T, R] fp32 from the shrink
    B,  # [slots, N, R_MAX] each output row's own rank block of B (scaled)
    Y,  # [T, N] base output, added to in place
    row_slot,  # [T] int32
    rank,  # [slots] int32 rank of each slot's adapter at this layer (0: not adapted)
    lo,  # [slots, MAX_BLOCKS] int32 first output row of each rank block
    hi,  # [slots, MAX_BLOCKS] int32 end output row of each rank block (lo = hi: no block)
    N,
    R_MAX,
    stride_tm,
    stride_bs,
    stride_bn,
    stride_ym,
    MAX_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    slot = tl.load(row_slot + row).to(tl.int64)
    if slot < 0:
        return
    r = tl.load(rank + slot)
    if r == 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.full([BLOCK_N], -1, dtype=tl.int32)
    for p in tl.static_range(MAX_BLOCKS):
        p_lo = tl.load(lo + slot * MAX_BLOCKS + p)
        p_hi = tl.load(hi + slot * MAX_BLOCKS + p)
        blk = tl.where((offs_n >= p_lo) & (offs_n < p_hi), p, blk)
    n_mask = (offs_n < N) & (blk >= 0)
    t_base = Tmp + row * stride_tm + tl.where(blk >= 0, blk, 0) * r  # [BLOCK_N]: each column's rank block
    offs_j = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j0 in range(0, R_MAX, BLOCK_R):
        j = j0 + offs_j
        mask = n_mask[:, None] & (j < r)[None, :]
        tv = tl.load(t_base[:, None] + j[None, :], mask=mask, other=0.0)
        bv = tl.load(B + slot * stride_bs + offs_n[:, None] * stride_bn + j[None, :], mask=mask, other=0.0)
        acc += tl.sum(tv * bv.to(tl.float32), axis=1)
    y_ptrs = Y + row * stride_ym + offs_n
    y = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(Y.dtype.element_ty), mask=n_mask)


def is_interpreted() -> bool:
    """Whether the kernels were built for Triton's CPU interpreter (decided at import)."""
    return type(_shrink_kernel).__name__ == "InterpretedFunction"


def _blocks() -> tuple[int, int, int, int]:
    """(shrink BLOCK_R, shrink BLOCK_K, expand BLOCK_N, expand BLOCK_R)."""
    if is_interpreted():  # tiny blocks: several rank tiles, K steps and output tiles on test shapes
        return 8, 16, 16, 8
    return 16, 128, 128, 16


def shrink(x: torch.Tensor, stack: Stack, row_slot: torch.Tensor) -> torch.Tensor:
    """``t [T, R]`` fp32: row ``i``'s ``x[i] @ A_{slot(i)}^T`` (rows of no adapter: left unset)."""
    m, k = x.shape
    r_pad = stack.a.shape[1]
    t = torch.empty(m, r_pad, dtype=torch.float32, device=x.device)
    block_r, block_k, _, _ = _blocks()
    if m == 0:
        return t
    _shrink_kernel[(m, triton.cdiv(r_pad, block_r))](
        x,
        stack.a,
        t,
        row_slot,
        stack.r_total,
        k,
        x.stride(0),
        stack.a.stride(0),
        stack.a.stride(1),
        t.stride(0),
        BLOCK_R=block_r,
        BLOCK_K=block_k,
    )
    return t


def expand(y: torch.Tensor, t: torch.Tensor, stack: Stack, row_slot: torch.Tensor) -> None:
    """``y[i] += t[i] @ B_{slot(i)}^T`` in place, each output row through its own rank block."""
    m, n = y.shape
    if m == 0:
        return
    _, _, block_n, block_r = _blocks()
    _expand_kernel[(m, triton.cdiv(n, block_n))](
        t,
        stack.b,
        y,
        row_slot,
        stack.rank,
        stack.lo,
        stack.hi,
        n,
        stack.b.shape[2],
        t.stride(0),
        stack.b.stride(0),
        stack.b.stride(1),
        y.stride(0),
        MAX_BLOCKS=MAX_BLOCKS,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
    )


def add_lora(y: torch.Tensor, x: torch.Tensor, stack: Stack, row_slot: torch.Tensor) -> torch.Tensor:
    """``y`` (the base output ``[T, out]``) plus each row's adapter delta: two launches."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert y.stride(-1) == 1 and row_slot.dtype == torch.int32 and row_slot.shape[0] == x.shape[0] == y.shape[0]
    expand(y, shrink(x, stack, row_slot), stack, row_slot)
    return y
