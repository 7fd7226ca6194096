"""A stack of pre-norm decoder blocks run by one C call per forward (``cpu_decoder.c``).

A model builds a :class:`NativeStack` from its blocks' weights once (:func:`native_linear` says
whether a layer's format can go in: int4 in our C layout, int8 without a dense copy) and runs it
with the attention backend's :meth:`~llmkit.core.model.attention.AttentionBackend.native_attend`
callback. Every step is the same C kernel the Python path calls, in the same order, so the output
is bit for bit the Python path's (tests/model/cpu/test_cpu_decoder.py); only the ~60 us a block of Python
and ctypes glue between the kernels goes (README, ``benchmarks/profile_decode_step.py``).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmkit.core import native
from llmkit.core.model.cpu import cpu_norm, cpu_pointwise, cpu_quant
from llmkit.core.model.quant import int4_format, int8
from llmkit.core.model.quant.int4_format import Int4Format
from llmkit.core.model.quant.int8 import Int8Format

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
LIN_INT4, LIN_INT8, LIN_INT4_SYM = 1, 2, 3


class CLinear(ctypes.Structure):
    _fields_ = [(n, _I64) for n in ("kind", "group", "n", "k", "n_out")] + [(n, _PTR) for n in ("w", "s", "bias")]


class CBlock(ctypes.Structure):
    _fields_ = [("layer", _I64), ("in_norm", _PTR), ("post_norm", _PTR)] + [
        (n, CLinear) for n in ("qkv", "o", "gate_up", "down")
    ]


class CStack(ctypes.Structure):
    _fields_ = [(n, _PTR) for n in ("q4", "q8", "norm", "silu", "attend", "attend_ctx")] + [
        ("eps", ctypes.c_float),
        *((n, _I64) for n in ("hidden", "inter", "attn_width", "qkv_width")),
    ]


@functools.cache
def _lib():
    return native.load(
        Path(__file__).with_name("cpu_decoder.c"),
        decoder_stack=[_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR],
    )


@functools.cache
def _kernels() -> tuple[int, int, int, int] | None:
    """Addresses of the kernels the stack calls, or None where one of them does not build."""
    libs = (cpu_quant._lib(), cpu_norm._lib(), cpu_pointwise._lib(), _lib())
    if any(lib is None for lib in libs):
        return None
    q, norm, point, _ = libs
    fns = (q.q4_linear, q.q8_linear, norm.rms_norm, point.silu_mul)
    return tuple(ctypes.cast(f, _PTR).value for f in fns)


def available() -> bool:
    return _kernels() is not None


@dataclass
class NativeAttend:
    """One forward's attention for a C caller: ``fn(ctx, layer, qkv, qkv_row, out)`` (see
    ``AttentionBackend.native_attend``); ``keep`` holds what ``ctx`` points into."""

    fn: int
    ctx: int
    keep: Any


def native_linear(layer) -> CLinear | None:
    """The layer as the stack calls it, or None where its format does not run a C kernel at every
    row count (a dense weight, int8 with a dense copy, GPTQ act order, torch's int4 layout) or it
    is sharded."""
    fmt, b = layer.format, layer._buffers
    if layer.parallel != "replicated" or (layer.bias is not None and layer.bias.dtype != torch.float32):
        return None
    bias = None if layer.bias is None else layer.bias.data_ptr()
    if isinstance(fmt, Int4Format) and getattr(layer, "q4_native", False) and b.get("in_perm") is None:
        packed, sz = b["q4_packed"], b["q4_scale_zero"]
        n, k = packed.shape[0] * 32, layer.local_in
        kind = LIN_INT4_SYM if sz.dtype == torch.float16 else LIN_INT4  # (cpu_quant.q4_pack's sym)
        return CLinear(kind, fmt.group, n, k, layer.local_out, packed.data_ptr(), sz.data_ptr(), bias)
    if isinstance(fmt, Int8Format) and layer.weight is None and layer.local_in % 32 == 0:
        w, s = b["qweight"], b["qscale"]
        return CLinear(LIN_INT8, 0, w.shape[0], layer.local_in, layer.local_out, w.data_ptr(), s.data_ptr(), bias)
    return None


class NativeStack:
    """Blocks ``(layer_id, in_norm weight, post_norm weight, qkv, o, gate_up, down)`` (Linear
    layers) as one C call; build with :meth:`build`, which returns None where any part cannot go."""

    def __init__(self, blocks: list[CBlock], keep: list, hidden: int, inter: int, attn_width: int, eps: float):
        self._blocks = (CBlock * len(blocks))(*blocks)
        self._keep = keep  # the tensors the structs point into
        self.hidden, self.inter, self.attn_width = hidden, inter, attn_width
        self.qkv_width = max(b.qkv.n_out for b in blocks)
        self.n = len(blocks)
        # the kernels and shapes once; each forward sets the attention callback
        self._stack = CStack(*_kernels(), 0, 0, eps, hidden, inter, attn_width, self.qkv_width)

    @classmethod
    def build(cls, blocks: list[tuple], eps: float) -> "NativeStack | None":
        kernels = _kernels()
        if kernels is None or not blocks:
            return None
        out, keep = [], []
        for layer_id, in_norm, post_norm, *lins in blocks:
            norms = (in_norm, post_norm)
            if any(w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous() for w in norms):
                return None
            cl = [native_linear(m) for m in lins]
            if any(c is None for c in cl):
                return None
            keep += [*norms, *(t for m in lins for t in m._buffers.values() if t is not None)]
            keep += [m.bias for m in lins if m.bias is not None]
            out.append(CBlock(layer_id, in_norm.data_ptr(), post_norm.data_ptr(), *cl))
        # one hidden, attention and MLP width for every block: the C code sizes its scratch by them
        hidden, attn_width, inter = out[0].o.n_out, out[0].o.k, out[0].down.k
        if any((b.o.n_out, b.o.k, b.gate_up.n_out, b.down.k) != (hidden, attn_width, 2 * inter, inter) for b in out):
            return None
        return cls(out, keep, hidden, inter, attn_width, eps)

    def usable(self, x: torch.Tensor) -> bool:
        rows = x.shape[0]
        return (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.shape[-1] == self.hidden
            and rows <= min(int4_format.INT4_MAX_ROWS, int8.INT8_NO_DENSE_MAX_ROWS)
        )

    def run(self, x: torch.Tensor, attend: NativeAttend, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        """All blocks over the embedding output ``x [M, hidden]`` (fp32) -> ``(last MLP output,
        residual)``. ``lora``: the forward's adapter rows (a ``cpu_lora.NativeLoRA``), or None."""
        m = x.shape[0]
        x = x.contiguous()
        res, out = torch.empty_like(x), torch.empty_like(x)
        scratch = torch.empty(m * (2 * self.hidden + self.qkv_width + self.attn_width + 3 * self.inter))
        stack = self._stack
        stack.attend, stack.attend_ctx = attend.fn, attend.ctx
        _lib().decoder_stack(
            ctypes.addressof(stack),
            ctypes.addressof(self._blocks),
            self.n,
            x.data_ptr(),
            out.data_ptr(),
            res.data_ptr(),
            m,
            scratch.data_ptr(),
            None if lora is None else lora.address,
        )
        return out, res
