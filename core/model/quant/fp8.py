"""Block-scaled FP8 checkpoints (DeepSeek-V3 / R1, Kimi-K2): each ``W [out, in]`` is stored as
``float8_e4m3fn`` with a ``weight_scale_inv [ceil(out / b0), ceil(in / b1)]`` beside it, one scale
per ``b0 x b1`` block (``quantization_config.weight_block_size``): ``W = W_fp8 * scale``.
Without an FP8 GEMM here, the weights are dequantized once, at load, to the compute dtype.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch

log = logging.getLogger("llmkit")

SCALE_SUFFIX = "_scale_inv"


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight`` (FP8) times its per-block ``scale_inv``, as fp32."""
    rows, cols = weight.shape
    b0, b1 = block
    if scale_inv.shape != (-(-rows // b0), -(-cols // b1)):
        raise ValueError(f"FP8 scales {tuple(scale_inv.shape)} do not match a {rows}x{cols} weight in {b0}x{b1} blocks")
    scale = scale_inv.float().repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    return weight.float() * scale


def dequantize_fp8_blocks(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass a checkpoint's tensors through, pairing each FP8 ``*.weight`` with its
    ``*.weight_scale_inv`` (in either order) and yielding the dequantized weight in its place."""
    waiting: dict[str, torch.Tensor] = {}
    count = 0
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            key, is_scale = name.removesuffix(SCALE_SUFFIX), True
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            key, is_scale = name, False
        else:
            yield name, tensor
            continue
        other = waiting.pop(key, None)
        if other is None:
            waiting[key] = tensor
            continue
        weight, scale = (other, tensor) if is_scale else (tensor, other)
        count += 1
        yield key, dequantize_fp8_block(weight, scale, block)
    if waiting:
        raise KeyError(f"FP8 tensors without their weight or {SCALE_SUFFIX} partner: {sorted(waiting)[:5]}")
    if count:
        log.info("%d block-scaled FP8 weights dequantized at load (no FP8 GEMM here)", count)
