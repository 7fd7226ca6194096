"""The C decode step of a Mamba2 layer (``cpu_mamba2.c``): the causal convolution and the selective
scan's recurrent form straight from and into the state pool's slots, built for the widest
instruction set this CPU has (AVX-512, else AVX2). None where native kernels are off or cannot
build; the torch forms (``causal_conv.py``, ``ssd.py``) run then."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmkit.core import native

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SOURCE = Path(__file__).with_name("cpu_mamba2.c")
_SIGS = dict(
    conv_step=[_P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I],
    ssd_step=[_P, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I],
)


@functools.cache
def lib():
    for isa in ("avx512", "avx2"):
        if native.cpu_has(isa):
            built = native.load(_SOURCE, isa=isa, **_SIGS)
            if built is not None:
                return built
    return None


def usable(x: torch.Tensor, conv_buf: torch.Tensor, ssm_buf: torch.Tensor, kernel: int) -> bool:
    """On the CPU with fp32 states (an fp32 model's conv state; a bf16 one's runs in torch)."""
    return (
        x.device.type == "cpu"
        and conv_buf.dtype == ssm_buf.dtype == torch.float32
        and kernel <= 8
        and lib() is not None
    )


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


def conv_step(xbc, weight, bias, conv_buf, read, write, fresh):
    """``causal_conv.conv_step`` (with SiLU) on rows ``xbc [R, C]``, the states read from slots
    ``read`` of ``conv_buf`` and written to slots ``write``; ``fresh`` (uint8): rows with no state."""
    r, c = xbc.shape
    out = torch.empty(r, c, dtype=torch.float32)
    xbc, weight = _f32(xbc), _f32(weight)
    bias = torch.zeros(c) if bias is None else _f32(bias)
    read, write = read.to(torch.int64).contiguous(), write.to(torch.int64).contiguous()
    lib().conv_step(
        xbc.data_ptr(),
        weight.data_ptr(),
        bias.data_ptr(),
        conv_buf.data_ptr(),
        conv_buf.data_ptr(),
        read.data_ptr(),
        write.data_ptr(),
        fresh.data_ptr(),
        out.data_ptr(),
        r,
        c,
        weight.shape[1],
    )
    return out


def ssd_step(xbc, dt, A, D, ssm_buf, read, write, fresh, heads: int, head_dim: int, state: int, groups: int):
    """``ssd.recurrent`` on the conv's output rows ``xbc [R, H P + 2 G N]`` (x, B, C), ``dt [R, H]``,
    states from slots ``read`` of ``ssm_buf`` into slots ``write``; returns ``[R, H, P]`` (fp32)."""
    r = xbc.shape[0]
    out = torch.empty(r, heads, head_dim, dtype=torch.float32)
    xbc, dt, A, D = _f32(xbc), _f32(dt), _f32(A), _f32(D)
    read, write = read.to(torch.int64).contiguous(), write.to(torch.int64).contiguous()
    inner = heads * head_dim
    lib().ssd_step(
        xbc.data_ptr(),
        xbc.shape[1],
        inner,
        inner + groups * state,
        dt.data_ptr(),
        A.data_ptr(),
        D.data_ptr(),
        ssm_buf.data_ptr(),
        ssm_buf.data_ptr(),
        read.data_ptr(),
        write.data_ptr(),
        fresh.data_ptr(),
        out.data_ptr(),
        r,
        heads,
        head_dim,
        state,
        groups,
    )
    return out
