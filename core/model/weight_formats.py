"""Weight formats built into the core, and the ``--quantization`` name table.

``int8``: weight-only, symmetric per output channel, bf16 activations through torch's
``_weight_int8pack_mm``. It halves the bytes a decode step reads, but that kernel is slower than the
fp32 GEMM beyond a few dozen rows, so larger batches (prefill) keep using the dense weight.
"""

from __future__ import annotations

import torch

from llmkit.core.model.linear import DENSE, WeightFormat, dense_linear

INT8_MAX_ROWS = 16


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 weights and their bf16 scales."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(torch.bfloat16)


class Int8Format(WeightFormat):
    name = "int8"

    def finalize(self, layer) -> None:
        q, scale = quantize_int8(layer.weight)
        layer.register_buffer("qweight", q, persistent=False)
        layer.register_buffer("qscale", scale, persistent=False)

    def apply(self, layer, x, deterministic):
        if x.shape[0] <= INT8_MAX_ROWS and not deterministic:
            return torch._weight_int8pack_mm(x.to(torch.bfloat16), layer.qweight, layer.qscale).to(x.dtype)
        return dense_linear(x, layer.weight, None, deterministic)


def weight_format(name: str | None) -> WeightFormat:
    """The format ``--quantization NAME`` converts dense weights to."""
    if name in (None, "", "none"):
        return DENSE
    if name == "int8":
        return Int8Format()
    raise ValueError(f"quantization '{name}' is not supported; supported: none, {', '.join(QUANTIZATIONS)}")


QUANTIZATIONS = ("int8",)
