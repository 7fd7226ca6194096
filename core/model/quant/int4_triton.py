"""int4 weights on CUDA: a Triton w4a16 GEMM, ``y[M, N] = x[M, K] @ W^T``, dequantizing in registers.

Layout (made by :func:`pack`, on the weight's device):

- ``qweight`` int32 ``[K/8, N]``: the 4-bit values ``q`` (0..15) packed eight to a word along the
  input dimension, value ``j`` of word ``[i, n]`` being ``q[n, 8i + j]`` in bits ``4j..4j+3`` (GPTQ's
  ``qweight`` layout). A tile of ``BLOCK_K/8`` word rows by ``BLOCK_N`` output columns is
  ``BLOCK_N`` contiguous words per row: loads coalesce along N at any ``BLOCK_K``.
- ``scale_zero`` ``[2, K/group, N]`` (scale, zero), or ``[1, K/group, N]`` (scale alone) when every
  zero is 0 (GGUF Q4_0, symmetric GPTQ): ``w = (q - 8) * scale + zero``, the
  :class:`~llmkit.core.model.int4_format.Int4Format` convention. fp16 when every value fits it
  (no overflow, no subnormal scale: 3 more mantissa bits than bf16, and GPTQ/AWQ/Q4_0 scales are
  fp16 to begin with), else bf16.

Kernel: a program computes one ``BLOCK_M x BLOCK_N`` tile of ``y``. Per ``BLOCK_K`` step it loads
the activations ``[BLOCK_M, BLOCK_K]``, the word tile ``[BLOCK_K/8, BLOCK_N]`` and one row of scales
(and zeros): ``BLOCK_K`` divides the group, so a step lies inside one group. The words are split
into nibbles (``[BLOCK_K/8, 8, BLOCK_N]`` shifts, reshaped to ``[BLOCK_K, BLOCK_N]``), dequantized in
fp32 (``q * scale + (zero - 8 scale)``), cast to the activation dtype and multiplied with ``tl.dot``
into an fp32 accumulator; the output is written in the activation dtype. Rows past ``M``, columns
past ``N`` and inputs past ``K`` are masked. fp32 activations multiply in full fp32 (``ieee``), not tf32.

Few rows (decode) leave most of the GPU idle with one program per ``BLOCK_N`` columns, so the K
loop may be split over ``SPLIT_K`` programs writing fp32 partial sums, added in split order by
torch afterwards (deterministic, no atomics).

Configurations are a fixed table by row count (no autotuning: nothing is benchmarked at the first
call, so CUDA-graph capture sees a plain launch). With ``deterministic`` one configuration serves
every row count and K is not split, so a row's result does not depend on how many rows the call
has (each program's rows are computed independently, with the same tiles and the same K order).

Import this module only after the interpreter choice is made (``TRITON_INTERPRET=1`` for Triton's
CPU interpreter): ``@triton.jit`` decides between the compiled and the interpreted kernel at import.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_FP16_MAX = 65504.0
_FP16_MIN_NORMAL = 2.0**-14


@triton.jit
def _w4a16_kernel(
    X,  # [M, K] activations (fp16 / bf16 / fp32), rows stride_xm apart, columns contiguous
    W,  # [K/8, N] int32 packed 4-bit values
    S,  # [K/group, N] scales
    Z,  # [K/group, N] zeros (read only with HAS_ZERO)
    Y,  # [M, N] contiguous output (SPLIT_K == 1), activation dtype
    P,  # [SPLIT_K, M, N] fp32 partial sums (SPLIT_K > 1)
    M,
    N,
    K,
    stride_xm,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ROWWISE: tl.constexpr,
):
    tl.static_assert(GROUP % BLOCK_K == 0, "a K step must lie inside one group")
    tl.static_assert(BLOCK_K % 8 == 0, "a K step is whole int32 words")
    # Grid: (row block, column tile, K split); row blocks vary fastest, so the programs running
    # together share their weight tile in L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    # this split's K steps
    steps = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(steps, SPLIT_K)
    first = pid_k * per
    last = tl.minimum(first + per, steps)
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_w[:, None] * N + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(first, last):
        k0 = step * BLOCK_K
        k_mask = offs_k < K - k0
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        words = tl.load(w_ptrs + (k0 // 8) * N, mask=(offs_w < (K - k0) // 8)[:, None] & n_mask[None, :], other=0)
        q = (words[:, None, :] >> shifts[None, :, None]) & 15  # [BLOCK_K/8, 8, BLOCK_N]: k = 8i + j
        q = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)
        g = k0 // GROUP
        scale = tl.load(S + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            bias = tl.load(Z + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32) - 8.0 * scale
        else:
            bias = -8.0 * scale
        w = q * scale[None, :] + bias[None, :]  # [BLOCK_K, BLOCK_N]
        if ROWWISE:  # products summed over K along an axis: one order for every row (see config)
            prod = x.to(tl.float32)[:, :, None] * w.to(x.dtype).to(tl.float32)[None, :, :]
            acc += tl.sum(prod, axis=1)
        elif UPCAST:  # bf16 under the interpreter: its tl.dot on bf16 is wrong (triton #11584); the
            # same products in fp32 (a bf16 x bf16 product is exact there)
            w = w.to(x.dtype).to(tl.float32)
            acc += tl.dot(x.to(tl.float32), w, input_precision=DOT_PREC, out_dtype=tl.float32)
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PREC, out_dtype=tl.float32)
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        y_ptrs = Y + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask)
    else:
        p_ptrs = P + (pid_k * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=mask)


def is_interpreted() -> bool:
    """Whether the kernel was built for Triton's CPU interpreter (decided at import)."""
    return type(_w4a16_kernel).__name__ == "InterpretedFunction"


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the largest row count it serves; BLOCK_K is
# lowered to the group where the group is smaller. Not tuned on a GPU yet: shapes in the range of
# published w4a16 Triton kernels (small row blocks for decode, 64-128 tiles for prefill).
_CONFIGS = (
    (16, (16, 64, 128, 4, 4)),
    (32, (32, 64, 128, 4, 4)),
    (64, (64, 64, 64, 4, 4)),
    (1 << 62, (128, 128, 64, 8, 3)),
)
_DETERMINISTIC = (64, 64, 64, 4, 4)  # every row count, K not split
# fp32 activations (the LM head's) stage twice the bytes: at most 2 stages keeps every tile within
# ~100 KB of shared memory (sm_86/89 have 99 KB a block)
_FP32_STAGES = 2
_INTERPRETER = (32, 64, 32, 4, 1)  # small blocks: several row blocks, column tiles and K steps on test shapes


def config(m: int, n: int, k: int, group: int, device: torch.device, deterministic: bool = False):
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K)`` for an ``[m, k] x [k, n]`` call."""
    if is_interpreted():
        bm, bn, bk, warps, stages = _INTERPRETER
    elif deterministic:
        bm, bn, bk, warps, stages = _DETERMINISTIC
    else:
        bm, bn, bk, warps, stages = next(c for limit, c in _CONFIGS if m <= limit)
    bk = min(bk, group)
    split = 1
    if not deterministic and not is_interpreted() and m <= 64:
        # Few rows: the tiles alone would leave SMs idle; split K until there are ~2 programs an SM,
        # each keeping at least 4 K steps.
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        want = triton.cdiv(2 * _num_sms(device), tiles)
        split = max(1, min(want, triton.cdiv(k, bk) // 4, 16))
    return bm, bn, bk, warps, stages, split


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [N, K]`` (uint8, 0..15; K a multiple of 8) with ``scale``/``zero [N, K/group]`` into
    ``(qweight [K/8, N] int32, scale_zero [2 or 1, K/group, N])`` (see the module docstring), on
    ``q``'s device. Works a few thousand rows at a time (the uint8 copies are 0.5 bytes a weight)."""
    n, k = q.shape
    if k % 8:
        raise ValueError(f"int4 packing needs input features divisible by 8; got {k}")
    words = torch.empty(k // 8, n, dtype=torch.int32, device=q.device)
    for lo in range(0, n, 4096):
        hi = min(lo + 4096, n)
        part = q[lo:hi]
        # byte i of a row holds values 2i (low nibble) and 2i + 1 (high); four little-endian
        # bytes make the int32 whose nibble j is value 8w + j
        pairs = torch.bitwise_or(part[:, 0::2], part[:, 1::2] << 4)
        words[:, lo:hi] = pairs.contiguous().view(torch.int32).t()
    sym = bool((zero == 0).all())
    sz = scale[None] if sym else torch.stack((scale, zero))  # [1 or 2, N, K/group]
    # fp16 unless a value overflows it or a scale is subnormal there (bf16 keeps fp32's range)
    mag = scale.abs()
    fits = sz.numel() == 0 or (
        bool((sz.abs().amax() <= _FP16_MAX).item()) and bool(((mag == 0) | (mag >= _FP16_MIN_NORMAL)).all().item())
    )
    sz = sz.to(torch.float16 if fits else torch.bfloat16).transpose(1, 2).contiguous()
    return words, sz


def unpack(words: torch.Tensor, scale_zero: torch.Tensor, rows: torch.Tensor | None = None):
    """``(q [R, K] uint8, scale, zero [R, K/group] fp32)`` of :func:`pack`'s output, for every
    output row or only ``rows``."""
    w = words if rows is None else words[:, rows]  # [K/8, R]
    sz = scale_zero if rows is None else scale_zero[:, :, rows]
    pairs = w.t().contiguous().view(torch.uint8)  # [R, K/2]
    q = torch.stack((pairs & 15, pairs >> 4), dim=-1).view(pairs.shape[0], -1)
    scale = sz[0].t().float()
    zero = sz[1].t().float() if sz.shape[0] == 2 else torch.zeros_like(scale)
    return q, scale, zero


def w4a16_linear(
    x: torch.Tensor,
    words: torch.Tensor,
    scale_zero: torch.Tensor,
    group: int,
    deterministic: bool = False,
    cfg: tuple[int, int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W^T`` for the packed ``W [N, K]``, in ``x``'s dtype (fp16, bf16 or fp32).
    ``cfg``: a :func:`config` tuple to use instead of the table's (tests)."""
    m, k = x.shape
    n = words.shape[1]
    if words.shape[0] * 8 != k:
        raise ValueError(f"int4 weight has {words.shape[0] * 8} input features, activations {k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if m == 0:
        return x.new_empty(0, n)
    bm, bn, bk, warps, stages, split = cfg or config(m, n, k, group, x.device, deterministic)
    if x.dtype == torch.float32 and cfg is None:
        stages = min(stages, _FP32_STAGES)
    upcast = is_interpreted() and x.dtype == torch.bfloat16
    # Under the interpreter tl.dot is numpy's matmul, whose BLAS kernels round a row by its
    # position in the tile (rows 3:19 of a call differ from the same rows at 0:16 of another), so a
    # deterministic call there sums the products itself. Compiled, an MMA's row does not depend on
    # its neighbours (the GPU check runs the same test compiled).
    rowwise = deterministic and is_interpreted()
    # fp32 asks for fp32 accuracy: tf32 (the GPU default) is ~1e-3 relative off
    prec = "ieee" if (upcast or x.dtype == torch.float32) else None
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if split == 1 else None
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _w4a16_kernel[grid](
        x,
        words,
        scale_zero[0],
        scale_zero[-1],  # the scales again when scale-only: never read
        part if y is None else y,  # (Y when not split, P when split: the other is never written)
        part,
        m,
        n,
        k,
        x.stride(0),
        GROUP=group,
        HAS_ZERO=scale_zero.shape[0] == 2,
        SPLIT_K=split,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        UPCAST=upcast,
        DOT_PREC=prec,
        ROWWISE=rowwise,
        num_warps=warps,
        num_stages=stages,
    )
    return y if split == 1 else part.sum(0).to(x.dtype)  # the splits added in a fixed order
