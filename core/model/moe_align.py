"""The (token, slot) rows of an MoE batch sorted by expert, for the fused grouped GEMM.

Pure torch, apart from the Triton kernel (``fused_moe_triton``) that consumes it, so it is tested
on any machine and imported without choosing Triton's interpreter first.
"""

from __future__ import annotations

import torch


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay the ``T x k`` (token, slot) assignments out expert by expert for a grouped GEMM.

    Returns ``sorted_ids`` ``[num_blocks * block_m]``: the flat (token, slot) index ``t * k + j`` of
    each row, each expert's rows contiguous (in (token, slot) order) and padded with ``T * k`` up to
    a multiple of ``block_m``; and ``block_expert`` ``[num_blocks]``, the expert of each block, -1 for
    the blocks past the last expert's. ``num_blocks`` is an upper bound computed from the shapes
    alone, so nothing is read back to the host."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    dev = flat.device
    # scatter_add, not bincount: bincount sizes its output from the max id, a read-back on CUDA
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    # sum_e ceil(c_e / bm) < n / bm + (active experts), and at most min(E, n) experts are active
    num_blocks = -(-n // block_m) + min(num_experts, n)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first row in ``order``
    dest = (ends - padded)[expert_of] + torch.arange(n, device=dev) - first[expert_of]
    sorted_ids = torch.full((num_blocks * block_m,), n, dtype=torch.int64, device=dev)
    sorted_ids[dest] = order
    block_start = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_ids, block_expert
