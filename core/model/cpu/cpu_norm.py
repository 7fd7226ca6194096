"""The C RMSNorm (``cpu_norm.c``) with the residual add fused, behind a torch-shaped call."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmkit.core import native

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _lib():
    args = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float]
    return native.load(Path(__file__).with_name("cpu_norm.c"), rms_norm=args)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    fp32 = x.dtype == weight.dtype == torch.float32
    return fp32 and x.device.type == "cpu" and _lib() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``rms_norm(x + residual) * weight`` over the last dim; with ``residual``, ``(out, x + residual)``."""
    # (a decode step makes 61 of these calls: no redundant tensor ops)
    if not x.is_contiguous():
        x = x.contiguous()
    dim = x.shape[-1]
    out = torch.empty_like(x)
    total = None
    if residual is not None:
        if not residual.is_contiguous():
            residual = residual.contiguous()
        total = torch.empty_like(x)
    _lib().rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        None if total is None else total.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // dim,
        dim,
        eps,
    )
    return out if residual is None else (out, total)
