"""The fused-MoE Triton kernel: one grouped GEMM over the (token, slot) rows sorted by expert.

As in SGLang's and vLLM's ``fused_moe``: :func:`~llmkit.core.model.moe_align.moe_align` lays the ``T x k``
assignments out expert by expert, each expert's run padded to a whole number of ``BLOCK_M`` rows,
so every block of sorted rows belongs to one expert. A program takes one such block and one tile of
output columns, gathers its rows of the activations, loads *its block's expert's* weight tile, and
writes each row's result to the row's own (token, slot) place. Two launches make an expert MLP:
gate/up (``[T, H] -> [T*k, 2I]``, plus bias), the activation in torch (SiLU-and-mul or gpt-oss's
clamped SwiGLU: any callable), then down (``[T*k, I] -> [T*k, H]``, plus bias, times the routing
weight). The k slots of a token are summed in slot order, as the torch path does.

Nothing here reads a count back to the host: the grid is sized by an upper bound on the blocks and
unused blocks exit at once. Each output row's arithmetic (the K loop over ``BLOCK_K`` chunks) does
not depend on which rows share its block, so a token's result does not depend on its batch-mates.

Import this module only after the interpreter choice is made (``TRITON_INTERPRET=1`` for Triton's
CPU interpreter): ``@triton.jit`` decides between the compiled and the interpreted kernel at import.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from llmkit.core.model.moe_align import moe_align


@triton.jit
def _fused_moe_kernel(
    A,  # [rows, K] activations: token rows (gate/up, A_ROW_DIV = k) or (token, slot) rows (down, 1)
    B,  # [E, N, K] expert weights
    Bias,  # [E, N] (read only with HAS_BIAS)
    C,  # [T*k, N] output, one row per (token, slot)
    topk_weights,  # [T*k] fp32 routing weights (read only with MUL_WEIGHT)
    sorted_ids,  # [num_blocks * BLOCK_M] (token, slot) index per sorted row; num_valid = padding
    block_expert,  # [num_blocks] expert of each block of sorted rows; -1 = unused block
    N,
    K,
    num_valid,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_biase,
    stride_cm,
    A_ROW_DIV: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # Grid: (block of sorted rows, tile of output columns).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids + offs_m).to(tl.int64)
    m_mask = ids < num_valid
    a_rows = tl.where(m_mask, ids // A_ROW_DIV, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = B + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk  # [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:  # bf16 under the interpreter: its tl.dot on bf16 is wrong (triton #11584)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PREC, out_dtype=tl.float32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(Bias + expert * stride_biase + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights + ids, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(
        C + ids[:, None] * stride_cm + offs_n[None, :],
        acc.to(C.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def is_interpreted() -> bool:
    """Whether the kernel was built for Triton's CPU interpreter (decided at import)."""
    return type(_fused_moe_kernel).__name__ == "InterpretedFunction"


def moe_config(
    dtype: torch.dtype, num_rows: int, num_experts: int, deterministic: bool = False
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps). Small row blocks when few rows per expert (decode),
    so padding wastes little; with ``deterministic`` one configuration for every batch, so not
    even the tile shape (and with it the GPU's MMA layout) depends on the batch."""
    if is_interpreted():  # tiny blocks: several row blocks, column tiles and K steps on test shapes
        return 16, 16, 16, 4
    block_k = 64 if dtype.itemsize <= 2 else 32
    if num_rows <= 4 * num_experts and not deterministic:
        return 16, 64, block_k, 4
    return 64, 64, block_k, 4


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    row_div: int,
    weights: torch.Tensor | None,
    cfg: tuple[int, int, int, int],
) -> None:
    n, k = w.shape[1], w.shape[2]
    block_m, block_n, block_k, warps = cfg
    assert a.stride(-1) == 1 and w.stride(-1) == 1 and out.stride(-1) == 1
    upcast = is_interpreted() and a.dtype == torch.bfloat16
    prec = "ieee" if (a.dtype == torch.float32 or upcast) else None
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _fused_moe_kernel[grid](
        a,
        w,
        w if bias is None else bias,  # any pointer when HAS_BIAS is off: never read
        out,
        out if weights is None else weights,
        sorted_ids,
        block_expert,
        n,
        k,
        out.shape[0],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        0 if bias is None else bias.stride(0),
        out.stride(0),
        A_ROW_DIV=row_div,
        HAS_BIAS=bias is not None,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=upcast,
        DOT_PREC=prec,
        num_warps=warps,
        num_stages=2,
    )


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    deterministic: bool = False,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * (w2_e @ act(w13_e @ x[t] + b13_e) + b2_e)`` with ``e = topk_ids[t, j]``,
    for ``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``; returns ``[T, H]`` (before any
    tensor-parallel all-reduce)."""
    t, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    x = x.contiguous()
    cfg = moe_config(x.dtype, t * top_k, num_experts, deterministic)
    sorted_ids, block_expert = moe_align(topk_ids, num_experts, cfg[0])
    h = torch.empty(t * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, b13, h, sorted_ids, block_expert, top_k, None, cfg)
    act = activation(h).contiguous()
    y = torch.empty(t * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    weights = topk_weights.to(torch.float32).reshape(-1).contiguous()
    _grouped_gemm(act, w2, b2, y, sorted_ids, block_expert, 1, weights, cfg)
    return y.view(t, top_k, -1).sum(dim=1)
