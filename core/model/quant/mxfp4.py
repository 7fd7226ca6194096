"""MXFP4 (OCP microscaling FP4) weights, as gpt-oss checkpoints store their experts.

A tensor ``W [..., rows, cols]`` is stored as ``blocks [..., rows, cols / 32, 16]`` (uint8, two
E2M1 values per byte, low nibble first) and ``scales [..., rows, cols / 32]`` (uint8 exponents
biased by 127): ``W[r, 32 g + j] = fp4(j-th nibble of blocks[r, g]) * 2 ** (scales[r, g] - 127)``.
Without an MXFP4 kernel the experts are dequantized once, at load, to the compute dtype.
"""

from __future__ import annotations

import torch

# E2M1 code points: sign bit, 2 exponent bits, 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., rows, G, 16]`` blocks and ``[..., rows, G]`` scales to a ``[..., rows, G * 32]`` tensor."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.uint8)
    vals = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1).flatten(-2)  # [..., G, 32]
    out = torch.ldexp(vals, scales.to(torch.int32).unsqueeze(-1) - 127)
    return out.flatten(-2).to(dtype)
