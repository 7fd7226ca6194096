"""GGUF weights that stay quantized: a checkpoint tensor over the file's memory-mapped blocks.

:class:`GGUFTensor` is what the native GGUF loader yields for a quantized weight. It names the
weight format its layer switches to (:meth:`GGUFTensor.weight_format`) and hands the layer exactly
the rows and columns it holds, so loading slices and repacks in one pass and no fp32 copy of the
model is ever resident (one layer's worth is, transiently, for the int8 mapping).

Type -> kernel layout (chosen by measurement, see the README's CPU quantization table):

- ``Q4_0``, ``Q4_1``, ``Q4_K``: exactly int4 in groups of 32 with a scale and a zero
  (:class:`~llmkit.core.model.quant.int4_format.Int4Format`): Q4_0 ``d*(q-8)``, Q4_1 ``d*q+m``, Q4_K
  ``d*sc*q - dmin*m`` per 32-column sub-block. The only rounding is the kernel's bf16 scale/zero.
- ``Q8_0``, ``Q5_K``, ``Q6_K``: requantized to int8 per output channel
  (:class:`~llmkit.core.model.quant.int8.Int8Format` without a dense copy); torch has no
  grouped int8 kernel, so this adds at most half a per-row step of rounding.
"""

from __future__ import annotations

import numpy as np
import torch

# The quantized GGUF types served natively; F32/F16/BF16 tensors load as dense tensors.
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q5_K", "Q6_K")
SUPPORTED_TYPES = INT4_TYPES + INT8_TYPES
DENSE_TYPES = ("F32", "F16", "BF16")


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


class GGUFTensor:
    """A quantized GGUF weight ``[rows, cols]``: ``data`` is ``[rows, bytes per row]`` uint8 (a
    view of the memory-mapped file until rows are permuted or sliced)."""

    group = 32

    def __init__(self, name: str, qtype: str, data: np.ndarray, cols: int) -> None:
        if qtype not in SUPPORTED_TYPES:
            raise ValueError(
                f"GGUF tensor '{name}' has type {qtype}, which llmkit cannot serve quantized; "
                f"supported: {', '.join(SUPPORTED_TYPES + DENSE_TYPES)}"
            )
        self.name, self.qtype, self.data, self.cols = name, qtype, data, cols

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.cols)

    def row_slice(self, lo: int, hi: int) -> "GGUFTensor":
        return GGUFTensor(self.name, self.qtype, self.data[lo:hi], self.cols)

    def weight_format(self, layer):
        if self.qtype in INT4_TYPES:
            from llmkit.core.model.quant.int4_format import Int4Format

            fmt = layer.format
            return fmt if getattr(fmt, "name", "") == "int4" and fmt.group == self.group else Int4Format(self.group)
        from llmkit.core.model.quant.int8 import Int8Format

        fmt = layer.format
        return fmt if getattr(fmt, "name", "") == "int8" and not fmt.keep_dense else Int8Format(keep_dense=False)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight (the ``gguf`` package's reference dequantization)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        w = dequantize(np.ascontiguousarray(self.data), GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(self.shape))

    def int4_groups(self, rows: slice, cols: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q uint8 [r, c] in 0..15, scale [r, c/32], zero [r, c/32])`` of ``[rows, cols]`` with
        ``w = (q - 8) * scale + zero`` exactly (fp32 scales and zeros)."""
        data = np.ascontiguousarray(self.data[rows])
        r = data.shape[0]
        if self.qtype in ("Q4_0", "Q4_1"):
            blocks = data.reshape(r, self.cols // 32, -1)
            d = _f16(blocks[..., 0:2])
            if self.qtype == "Q4_0":
                qs, zero = blocks[..., 2:18], np.zeros_like(d)
            else:
                qs, zero = blocks[..., 4:20], _f16(blocks[..., 2:4]) + 8 * d
            q = np.concatenate((qs & 15, qs >> 4), axis=-1)  # low nibbles: 0..15, high: 16..31
            scale = d
        elif self.qtype == "Q4_K":
            from gguf.quants import Q4_K

            blocks = data.reshape(-1, 144)  # [r * cols/256, 144]
            nb = blocks.shape[0]
            d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
            sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
            qs = blocks[:, 16:].reshape(nb, 4, 1, 32)
            q = np.concatenate((qs & 15, qs >> 4), axis=2).reshape(r, self.cols)
            scale = (d[:, None] * sc.astype(np.float32)).reshape(r, -1)
            zero = (8 * scale.reshape(nb, 8) - dmin[:, None] * m.astype(np.float32)).reshape(r, -1)
        else:
            raise ValueError(f"{self.qtype} is not a 4-bit GGUF type")
        q = q.reshape(r, self.cols)[:, cols]
        g = slice(cols.start // 32, cols.stop // 32)
        return (
            torch.from_numpy(np.ascontiguousarray(q)),
            torch.from_numpy(scale[:, g].copy()),
            torch.from_numpy(zero[:, g].copy()),
        )
