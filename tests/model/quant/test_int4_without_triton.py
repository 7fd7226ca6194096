"""int4 weights on CUDA have only a Triton kernel; triton is an extra, so without it packing the
layer fails in one line naming the extra (the CPU stands in for CUDA, as the interpreter tests do)."""

from __future__ import annotations

import sys

import pytest
import torch

from llmkit.core.model import quant
from llmkit.core.model.linear import Linear
from llmkit.core.model.quant import int4_format


def test_int4_on_a_triton_device_without_triton_names_the_extra(monkeypatch):
    monkeypatch.setattr(int4_format, "TRITON_DEVICES", ("cuda", "cpu"))
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises, as when not installed
    monkeypatch.delitem(sys.modules, "llmkit.core.model.quant.int4_triton", raising=False)
    monkeypatch.delattr(quant, "int4_triton", raising=False)
    layer = Linear(256, 64)
    layer.load(torch.randn(64, 256) * 0.05)
    with pytest.raises(RuntimeError, match=r"Triton kernel.*pip install 'llmkit\[triton\]'"):
        layer.set_format(int4_format.Int4Format(32))
