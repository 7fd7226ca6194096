"""``--quantization int8``: weight-only, symmetric per output channel. The kernel is our C one
(:mod:`llmkit.core.model.cpu.cpu_quant`: int8 activation blocks, integer dot products) where it builds,
else torch's ``_weight_int8pack_mm`` with bf16 activations; the C kernel is as fast or faster at
every row count measured (1-512) and twice as fast for the embedded model's 49k-row LM head. It
halves the bytes a decode step reads, but is slower than the fp32 GEMM beyond a few dozen rows, so
larger batches (prefill) keep using the dense weight; a layer loaded from an already quantized
source (GGUF Q8_0 / Q5_K / Q6_K) keeps no dense copy and runs the kernel at every row count
(dequantizing per call costs more).
"""

from __future__ import annotations

import torch

from llmkit.core.model.cpu import cpu_quant
from llmkit.core.model.cpu.hugepages import huge_copy
from llmkit.core.model.linear import WeightFormat, dense_linear

INT8_MAX_ROWS = 16  # rows per call up to which a layer with a dense copy runs the kernel
INT8_NO_DENSE_MAX_ROWS = 1 << 30  # the same without a dense copy: no limit (benchmarks lower it)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 weights and their bf16 scales."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(torch.bfloat16)


class Int8Format(WeightFormat):
    """``keep_dense``: keep the loaded fp32 weight for calls with many rows (a dense checkpoint
    quantized with ``--quantization int8``); without it only the int8 weight stays resident."""

    name = "int8"

    def __init__(self, keep_dense: bool = True) -> None:
        self.keep_dense = keep_dense

    def finalize(self, layer) -> None:
        if layer.weight is None:  # already finalized
            return
        q, scale = quantize_int8(layer.weight)
        layer.register_buffer("qweight", huge_copy(q), persistent=False)  # (see hugepages.py)
        layer.register_buffer("qscale", scale, persistent=False)
        if not self.keep_dense:
            layer.weight = None

    def apply(self, layer, x, deterministic):
        # Without a dense copy (a GGUF's Q8_0/Q5_K/Q6_K, the embedded model's tied LM head) the
        # kernel runs at every row count: dequantizing per call costs more, and the kernel's rows
        # do not depend on the row count, so neither does a request's output on its batch.
        dense = layer.weight is not None
        if x.shape[0] <= (INT8_MAX_ROWS if dense else INT8_NO_DENSE_MAX_ROWS) and not (dense and deterministic):
            return self._kernel(layer, x)
        return dense_linear(x, self.dense_weight(layer).to(x.dtype), None, deterministic)

    @staticmethod
    def _kernel(layer, x):
        b = layer._buffers
        if x.device.type == "cpu" and x.shape[1] % 32 == 0 and cpu_quant.available():
            y = cpu_quant.q8_linear(x, b["qweight"], b["qscale"])
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        if x.shape[1] % 16 == 0:
            return torch._weight_int8pack_mm(x.to(torch.bfloat16), b["qweight"], b["qscale"]).to(x.dtype)
        # torch's CPU int8pack kernel reads past a row whose length is not a multiple of 16:
        # garbage or a segfault (measured at 4, 8, 12, 17, 24, 40, 100 input features).
        return dense_linear(x, (b["qweight"].float() * b["qscale"].float()[:, None]).to(x.dtype), None, False)

    def dense_weight(self, layer):
        if layer.weight is not None:
            return layer.weight
        return layer.qweight.float() * layer.qscale.float()[:, None]

    def embed(self, layer, ids):
        return layer.qweight[ids].float() * layer.qscale[ids].float()[..., None]
