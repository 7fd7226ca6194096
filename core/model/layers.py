"""Building blocks shared by model plugins: RMSNorm and rotary embeddings (linear layers live in
``linear.py``)."""

from __future__ import annotations

import importlib.util
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.cpu import cpu_norm, cpu_pointwise
from llmkit.core.model.hot_module import HotModule

# CUDA runs the fused Triton kernels of triton_pointwise.py (one kernel per op instead of 2-4) where
# triton is installed (an extra, which CUDA builds of torch bring; without it the torch forms run, as
# in moe.py); LLMKIT_DISABLE_FUSED_KERNELS=1 keeps the torch forms (a benchmark's "before", or a
# suspect kernel).
FUSED_ON_CUDA = (
    os.environ.get("LLMKIT_DISABLE_FUSED_KERNELS", "") != "1" and importlib.util.find_spec("triton") is not None
)


# A decode step's GEMMs of a few rows as one Triton kernel each, with the norm or SiLU-and-mul before
# them folded in (triton_gemv.py). LLMKIT_TRITON_GEMV=1: always, 0: never; unset: measured against
# cuBLAS per block shape and row count at start-up (gemv_choice.py).
_GEMV_ENV = os.environ.get("LLMKIT_TRITON_GEMV", "")
GEMV_ON_CUDA = FUSED_ON_CUDA and _GEMV_ENV != "0"
GEMV_MEASURED = _GEMV_ENV != "1"


def decode_gemv(x: torch.Tensor):
    """The fused decode-GEMV module where it is on and ``x`` is a CUDA tensor of few enough rows,
    else None."""
    if not (GEMV_ON_CUDA and x.is_cuda):
        return None
    from llmkit.core.model import triton_gemv

    return triton_gemv if x.shape[0] <= triton_gemv.MAX_ROWS else None


def _fused(x: torch.Tensor):
    """The fused-kernel module where ``x`` is a CUDA tensor and they are on, else None."""
    if not (x.is_cuda and FUSED_ON_CUDA):
        return None
    from llmkit.core.model import triton_pointwise  # imports triton: only once a CUDA tensor shows up

    return triton_pointwise


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2 * inter]`` (gate first): one kernel on CUDA, one C
    call on the CPU where it builds, else torch."""
    fused = _fused(gate_up)
    if fused is not None:
        return fused.silu_mul(gate_up, inter)
    return cpu_pointwise.silu_mul(gate_up, inter)


class RMSNorm(HotModule):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise ``x`` (after adding ``residual``); with a residual, also return the sum."""
        weight = self._parameters["weight"]  # (not nn.Module.__getattr__: a decode step makes 61 calls)
        if cpu_norm.usable(x, weight):
            return cpu_norm.rms_norm(x, weight, self.eps, residual)  # one C call (cpu_norm.c)
        fused = _fused(x)
        if fused is not None:
            return fused.rms_norm(x, weight, self.eps, residual)  # one kernel, residual add included
        if residual is not None:
            x = x + residual
            residual = x
        out = F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return out if residual is None else (out, residual)


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def _rope_params(config: dict) -> dict:
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    return {**scaling, **params}


def _inv_freq(head_dim: int, config: dict) -> torch.Tensor:
    return _rope(head_dim, config)[0]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope(head_dim: int, config: dict) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rotary dims and the factor cos/sin are scaled by (YaRN's
    attention factor; 1 otherwise)."""
    params = _rope_params(config)
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if rope_type in (None, "default"):
        return inv, 1.0
    if rope_type == "yarn":
        return _yarn(inv, head_dim, theta, params, config)
    if rope_type == "proportional":
        # Gemma 4's full-attention layers: the first ``partial_rotary_factor`` of the frequencies
        # (exponents over the whole head), the rest 0 (those channels pass unrotated)
        angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        inv[angles:] = 0.0
        return inv / float(params.get("factor", 1.0)), 1.0
    return _scaled(inv, rope_type, params), 1.0


def _yarn(inv: torch.Tensor, dim: int, theta: float, params: dict, config: dict) -> tuple[torch.Tensor, float]:
    # YaRN (arXiv:2309.00071) as transformers computes it: interpolate the low frequencies by
    # ``factor``, keep the high ones, ramp linearly between the beta_fast/beta_slow rotation counts.
    old_ctx = float(params["original_max_position_embeddings"])
    factor = params.get("factor") or float(config["max_position_embeddings"]) / old_ctx
    factor = float(factor)
    attn = params.get("attention_factor")
    if attn is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = _yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all) if ms and ms_all else _yarn_mscale(factor)
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def corr_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (inv / factor) * (1 - extrapolate) + inv * extrapolate, float(attn)


def _scaled(inv: torch.Tensor, rope_type: str, params: dict) -> torch.Tensor:
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
    raise ValueError(f"rope type '{rope_type}' is not supported; supported: {', '.join(ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embeddings with a precomputed cos/sin table.

    The table is stored full width as ``cos2 = [cos, cos]`` and ``sin2 = [-sin, sin]``, so a
    rotation is ``x * cos2 + roll(x, D/2) * sin2``: four ops instead of eight (a decode step runs
    it once per layer), and bit-identical to ``[x1 cos - x2 sin, x2 cos + x1 sin]`` (negating a
    product is exact, and ``a + (-b)`` rounds exactly like ``a - b``)."""

    def __init__(self, head_dim: int, max_positions: int, config: dict):
        super().__init__()
        inv, scale = _rope(head_dim, config)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
        cos, sin = (freqs.cos() * scale).float(), (freqs.sin() * scale).float()
        self.register_buffer("cos2", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin2", torch.cat((-sin, sin), dim=-1), persistent=False)
        self._cast: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for ``positions``, shaped to broadcast over heads; computed once per
        forward and shared by every layer."""
        cos2, sin2 = self.tables(dtype)
        return cos2[positions].unsqueeze(1), sin2[positions].unsqueeze(1)

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole tables in ``dtype``. Another dtype than the fp32 tables' is cast once and
        kept: a bf16 step then indexes two tables instead of indexing and casting each (two
        kernels fewer a step), with the same numbers (a cast commutes with an index)."""
        if self.cos2.dtype == dtype:
            return self.cos2, self.sin2
        key = (dtype, self.cos2.device)
        cast = self._cast.get(key)
        if cast is None:
            cast = self._cast[key] = (self.cos2.to(dtype), self.sin2.to(dtype))
        return cast

    @staticmethod
    def rotate(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate ``x`` [T, heads, D] (queries, keys, or both stacked) with a :meth:`table`: one C
        call on the CPU (the same numbers), one kernel on CUDA, else
        ``x * cos2 + x.roll(D/2, -1) * sin2``."""
        fused = _fused(x)
        if fused is not None:
            return fused.rotate(x, *table)
        return cpu_pointwise.rotate(x, *table)
