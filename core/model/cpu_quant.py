"""The C int8 GEMM (``cpu_quant_gemm.c``): llama.cpp's scheme of int8 activation blocks and
integer dot products, behind a torch-shaped call.

Measured on the project's 2-core Zen3 against torch's ``_weight_int8pack_mm`` (bf16 activations):
as fast or faster at 1-512 rows, about 2x on the embedded model's 49k x 576 LM head (README). The
activations are rounded to int8 in blocks of 32 (llama.cpp's Q8 blocks), about the precision the
bf16 activations had. A row's result does not depend on the call's row count.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmkit.core import native

_SOURCE = Path(__file__).with_name("cpu_quant_gemm.c")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _lib():
    return native.load(_SOURCE, q8_linear=[_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR])


def available() -> bool:
    return _lib() is not None


def q8_linear(x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ W^T`` -> ``[M, N]`` (fp32) for int8 ``qweight [N, K]`` with bf16 row scales."""
    x = x.float().contiguous()
    (mrows, k), n = x.shape, qweight.shape[0]
    y = x.new_empty(mrows, n)
    if mrows:
        _lib().q8_linear(x.data_ptr(), mrows, k, qweight.data_ptr(), qscale.data_ptr(), n, y.data_ptr())
    return y
