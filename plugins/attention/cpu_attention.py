"""The C attention kernel (``cpu_attention.c``) behind a torch-shaped call."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmkit.core import native

_SOURCE = Path(__file__).with_name("cpu_attention.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # anything else one byte, via a table

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _lib():
    args = [_PTR, _PTR, _PTR, ctypes.c_int, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR]
    return native.load(_SOURCE, paged_attention=args + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int, _PTR, _PTR])


@functools.cache
def _byte_table(dtype: torch.dtype) -> torch.Tensor:
    """fp32 value of each byte of a one-byte float dtype (fp8)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()


def available(pool_dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and (pool_dtype in _DTYPES or pool_dtype.itemsize == 1) and _lib() is not None


def paged_attention(q, kbuf, vbuf, table, rows, lens, *, scale, window, sinks, v_head_dim) -> torch.Tensor:
    """``q [B, H, D]`` (fp32; B query rows), row b over the first ``lens[b]`` keys of the sequence at
    ``table[rows[b]]`` -> ``[B, H, Dv]``.
    ``vbuf`` None: the values are the keys' first ``v_head_dim`` channels (a latent cache)."""
    b, h, d = q.shape
    hkv = kbuf.shape[1]
    q = q.contiguous()
    out = q.new_empty(b, h, v_head_dim)
    code = _DTYPES.get(kbuf.dtype, 3)
    lut = _byte_table(kbuf.dtype) if code == 3 else None
    values = kbuf if vbuf is None else vbuf
    _lib().paged_attention(
        q.data_ptr(),
        kbuf.data_ptr(),
        values.data_ptr(),
        code,
        None if lut is None else lut.data_ptr(),
        kbuf.stride(0),
        kbuf.stride(1),
        values.stride(0),
        values.stride(1),
        table.data_ptr(),
        table.stride(0),
        rows.data_ptr(),
        lens.data_ptr(),
        b,
        h,
        hkv,
        d,
        v_head_dim,
        scale,
        window or 0,
        None if sinks is None else sinks.data_ptr(),
        out.data_ptr(),
    )
    return out
