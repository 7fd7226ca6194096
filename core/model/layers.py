"""Building blocks shared by model plugins: linear, RMSNorm, rotary embeddings."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# Rows per GEMM call in deterministic mode. MKL picks different kernels (and summation orders)
# for different row counts, so a row's result depends on its batch-mates; multiplying fixed,
# zero-padded tiles of rows makes every row's result independent of the batch.
DETERMINISTIC_TILE = 16


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias):
    # On CPU, oneDNN's fp32 GEMM beats F.linear's MKL path for decode-sized row counts (measured:
    # 1.15x for one row, 1.3x for 16), while MKL is a few percent faster for long prefills.
    if (
        _ONEDNN
        and x.shape[0] < 256
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


# Weight-only int8 (--quantization int8): per-output-channel scales, bf16 activations. It halves
# the bytes a decode step reads, but torch's int8 kernel is slower than fp32 GEMM beyond a few
# dozen rows, so larger batches (prefill) keep using the fp32 weights.
INT8_MAX_ROWS = 16


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 weights and their bf16 scales."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(torch.bfloat16)


def _int8_gemm(x: torch.Tensor, q: tuple[torch.Tensor, torch.Tensor], bias):
    out = torch._weight_int8pack_mm(x.to(torch.bfloat16), q[0], q[1]).to(x.dtype)
    return out if bias is None else out + bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, deterministic: bool = False, q=None):
    if q is not None and x.shape[0] <= INT8_MAX_ROWS and not deterministic:
        return _int8_gemm(x, q, bias)
    if not deterministic:
        return _gemm(x, weight, bias)
    m = x.shape[0]
    pad = (-m) % DETERMINISTIC_TILE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = torch.cat([_gemm(t, weight, bias) for t in x.split(DETERMINISTIC_TILE)])
    return out[:m]


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.q: tuple[torch.Tensor, torch.Tensor] | None = None  # int8 copy, when quantized

    def quantize_int8(self) -> None:
        self.q = quantize_int8(self.weight)

    def forward(self, x: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        return linear(x, self.weight, self.bias, deterministic, self.q)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise ``x`` (after adding ``residual``); with a residual, also return the sum."""
        if residual is not None:
            x = x + residual
            residual = x
        out = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return out if residual is None else (out, residual)


def _inv_freq(head_dim: int, config: dict) -> torch.Tensor:
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if rope_type in (None, "default"):
        return inv
    if rope_type == "linear":
        return inv / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"rope type '{rope_type}' is not supported")


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embeddings with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, config: dict):
        super().__init__()
        inv = _inv_freq(head_dim, config)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for ``positions``, shaped to broadcast over heads; computed once per
        forward and shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate ``x`` [T, heads, D] (queries, keys, or both stacked) with a :meth:`table`."""
        return _rotate(x, *table)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
