"""The C decode step of a Gated DeltaNet layer (``cpu_gated_delta.c``): the short convolution and
the gated delta rule's recurrent form straight from and into the state pool's slots, built for the
widest instruction set this CPU has (AVX-512, else AVX2). None where native kernels are off or
cannot build; the torch forms run then."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmkit.core import native

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SOURCE = Path(__file__).with_name("cpu_gated_delta.c")
_SIGS = dict(
    conv_step=[_P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I],
    gated_delta_step=[_P, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I],
)


@functools.cache
def lib():
    for isa in ("avx512", "avx2"):
        if native.cpu_has(isa):
            built = native.load(_SOURCE, isa=isa, **_SIGS)
            if built is not None:
                return built
    return None


def usable(x: torch.Tensor, conv_buf: torch.Tensor, rec_buf: torch.Tensor, dk: int, dv: int, kernel: int) -> bool:
    return (
        x.device.type == "cpu"
        and conv_buf.dtype == rec_buf.dtype == torch.float32
        and dk <= 512
        and dv <= 512
        and kernel <= 8
        and lib() is not None
    )


def _i64(xs: torch.Tensor) -> torch.Tensor:
    return xs.to(torch.int64).contiguous()


def conv_step(mixed, weight, conv_buf, read, write, fresh):
    """``causal_conv.conv_step`` on rows ``mixed [B, C]`` (fp32), the states read from slots
    ``read`` of ``conv_buf`` and written to slots ``write``."""
    b, c = mixed.shape
    out = torch.empty(b, c, dtype=torch.float32)
    mixed, weight = mixed.float().contiguous(), weight.float().contiguous()
    read, write = _i64(read), _i64(write)
    lib().conv_step(
        mixed.data_ptr(),
        c,
        weight.data_ptr(),
        conv_buf.data_ptr(),
        conv_buf.data_ptr(),
        read.data_ptr(),
        write.data_ptr(),
        fresh.data_ptr(),
        out.data_ptr(),
        b,
        c,
        weight.shape[1],
    )
    return out


def gated_delta_step(qkv, key_dim, g, beta, rec_buf, read, write, fresh, hk, hv, dk, dv):
    """``gated_delta_rule.recurrent`` on rows ``qkv [B, 2 key_dim + hv dv]`` (the conv's output:
    queries, keys, values), states from slots ``read`` of ``rec_buf`` into slots ``write``;
    returns the outputs ``[B, hv, dv]``."""
    b = qkv.shape[0]
    out = torch.empty(b, hv, dv, dtype=torch.float32)
    g, beta = g.float().contiguous(), beta.float().contiguous()
    read, write = _i64(read), _i64(write)
    lib().gated_delta_step(
        qkv.data_ptr(),
        qkv.shape[1],
        key_dim,
        2 * key_dim,
        g.data_ptr(),
        beta.data_ptr(),
        rec_buf.data_ptr(),
        rec_buf.data_ptr(),
        read.data_ptr(),
        write.data_ptr(),
        fresh.data_ptr(),
        out.data_ptr(),
        b,
        hk,
        hv,
        dk,
        dv,
    )
    return out
