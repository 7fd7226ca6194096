"""The C int8 and int4 GEMMs (``cpu_quant_gemm.c``): llama.cpp's scheme of int8 activation blocks and
integer dot products, behind torch-shaped calls.

Measured on the project's 2-core VM against torch's ``_weight_int8pack_mm`` and
``_weight_int4pack_mm_for_cpu`` (README): faster at every row count, most at one row (the weight
stream is prefetched) and, where the CPU has AVX512-VNNI, at many (one instruction a 4-byte dot
product). The activations are rounded to int8 in blocks of 32 (llama.cpp's Q8 blocks). A row's
result does not depend on the call's row count, nor on which of the two builds (AVX2 or VNNI) ran.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmkit.core import native
from llmkit.core.model.cpu.hugepages import huge_empty

_SOURCE = Path(__file__).with_name("cpu_quant_gemm.c")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def isa() -> str:
    """The instruction set the kernels are built for here."""
    return "avx512vnni" if native.cpu_has("avx512vnni") else "avx2"


@functools.cache
def _lib(which: str | None = None):
    return native.load(
        _SOURCE,
        isa=which or isa(),
        q8_linear=[_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR],
        q4_linear=[_PTR, _I64, _I64, _PTR, _PTR, _I64, ctypes.c_int, _PTR, _I64, _I64, ctypes.c_int],
    )


def available() -> bool:
    return _lib() is not None


def q8_linear(x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor, which: str | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T`` -> ``[M, N]`` (fp32) for int8 ``qweight [N, K]`` with bf16 row scales."""
    x = x.float().contiguous()
    (mrows, k), n = x.shape, qweight.shape[0]
    y = x.new_empty(mrows, n)
    if mrows:
        _lib(which).q8_linear(x.data_ptr(), mrows, k, qweight.data_ptr(), qscale.data_ptr(), n, y.data_ptr())
    return y


def q4_linear(
    x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int, n_out: int, which: str | None = None
) -> torch.Tensor:
    """``x [M, K]`` times a :func:`q4_pack` weight -> ``[M, n_out]`` fp32 (its first ``n_out`` outputs)."""
    if x.dtype != torch.float32 or not x.is_contiguous():  # (~120 calls a decode step: no no-op ops)
        x = x.float().contiguous()
    m, k = x.shape
    y = torch.empty(m, n_out)
    if m:
        n, sym = packed.shape[0] * 32, scale_zero.dtype == torch.float16
        _lib(which).q4_linear(
            x.data_ptr(), m, k, packed.data_ptr(), scale_zero.data_ptr(), n, group, y.data_ptr(), n_out, n_out, sym
        )
    return y


def q4_pack(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, sym: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [N, K]`` (0..15, N a multiple of 32) with fp32 ``scale``/``zero [N, K/group]`` into the
    kernel's layout (see cpu_quant_gemm.c): ``packed [N/32, K/32, 4 vectors, 4 octets, 8 columns, 4]``
    uint8 (low nibble input 8o + i of the block, high 8o + 4 + i) and ``scale_zero
    [N/32, K/group, 4, 8, 2]`` bf16; ``sym`` (every zero 0): the scales alone ``[N/32, K/group, 4, 8]``
    in fp16 (see :func:`symmetric`)."""
    n, k = q.shape
    o = q.view(n // 32, 4, 8, k // 32, 4, 2, 4).permute(0, 3, 1, 4, 2, 6, 5)  # [..., 8 cols, 4, lo/hi]
    # streamed every decode step: in 2 MB pages where large (hugepages.py), written straight there
    packed = huge_empty((n // 32, k // 32, 4, 4, 8, 4), torch.uint8)
    torch.bitwise_or(o[..., 0], o[..., 1] << 4, out=packed)
    sz = scale.to(torch.float16).unsqueeze(-1) if sym else torch.stack((scale, zero), dim=-1).to(torch.bfloat16)
    sz = sz.view(n // 32, 4, 8, -1, sz.shape[-1]).permute(0, 3, 1, 2, 4)
    sz = huge_empty(tuple(sz.shape), sz.dtype).copy_(sz)
    return packed, sz.squeeze(-1) if sym else sz


def symmetric(scale: torch.Tensor, zero: torch.Tensor) -> bool:
    """Whether a weight packs scale-only (:func:`q4_pack`'s ``sym``) without changing a value: every
    zero 0 and every scale an fp16 (GGUF Q4_0, symmetric GPTQ). It then also reads 18 bytes per 32
    weights instead of 20, and keeps the scale's fp16 bits where the pairs round it to bf16."""
    return bool((zero == 0).all()) and bool((scale.to(torch.float16).float() == scale).all())


def q4_unpack(packed: torch.Tensor, scale_zero: torch.Tensor, rows: torch.Tensor | None = None):
    """The ``(q [R, K] uint8, scale, zero [R, K/group] fp32)`` of :func:`q4_pack`'s output, for all
    rows or only ``rows``."""
    if rows is None:
        rows = torch.arange(packed.shape[0] * 32)
    t, v, j = rows // 32, (rows // 8) % 4, rows % 8
    b = packed[t, :, v, :, j]  # [R, K/32, 4 octets, 4]
    q = torch.stack((b & 15, b >> 4), dim=-2).reshape(rows.shape[0], -1)  # per octet: 4 low, 4 high
    sz = scale_zero[t, :, v, j].float()  # [R, K/group, 2], or [R, K/group] scale-only
    if scale_zero.dtype == torch.float16:
        return q, sz, torch.zeros_like(sz)
    return q, sz[..., 0], sz[..., 1]
