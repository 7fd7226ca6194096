"""The C pointwise ops (``cpu_pointwise.c``) behind torch-shaped calls, each with its torch spelling
where the kernels do not build."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from llmkit.core import native

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _lib():
    return native.load(
        Path(__file__).with_name("cpu_pointwise.c"),
        rope_rotate=[_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR],
        silu_mul=[_PTR, _I64, _I64, _PTR],
    )


def _usable(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and _lib() is not None


def rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """``x * cos2 + x.roll(D/2, -1) * sin2`` for ``x [T, H, D]`` and tables ``[T, 1, D]``: one C
    call on the CPU in fp32 (bit for bit the same numbers), else those torch ops."""
    t, h, d = x.shape
    if (
        _usable(x)
        and x.stride(2) == 1
        and cos2.dtype == torch.float32
        and cos2.is_contiguous()
        and sin2.is_contiguous()
    ):
        out = x.new_empty(t, h, d)
        _lib().rope_rotate(
            x.data_ptr(), x.stride(0), x.stride(1), cos2.data_ptr(), sin2.data_ptr(), t, h, d, out.data_ptr()
        )
        return out
    return x * cos2 + x.roll(d // 2, -1) * sin2


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2 * inter]`` (gate first)."""
    if _usable(gate_up) and gate_up.is_contiguous() and gate_up.shape[-1] == 2 * inter:
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        _lib().silu_mul(gate_up.data_ptr(), gate_up.numel() // (2 * inter), inter, out.data_ptr())
        return out
    gate, up = gate_up.split(inter, dim=-1)
    return F.silu(gate).mul_(up)
