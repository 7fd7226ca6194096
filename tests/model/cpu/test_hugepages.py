"""Large weights are copied into huge-page-advised memory; everything else is left alone."""

from __future__ import annotations

import mmap

import pytest
import torch

from llmkit.core.model.cpu import hugepages
from llmkit.core.model.cpu.hugepages import HUGE, huge_copy, huge_empty


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here")
def test_a_large_tensor_is_copied_to_an_aligned_advised_mapping():
    t = torch.randint(0, 255, (5 * HUGE + 12345,), dtype=torch.uint8).view(-1)[: 5 * HUGE].view(1280, -1)
    out = huge_copy(t)
    assert torch.equal(out, t) and out.shape == t.shape and out.is_contiguous()
    assert out.data_ptr() % HUGE == 0 and out.data_ptr() != t.data_ptr()
    b = huge_copy(torch.randn(5 * HUGE).bfloat16().view(-1, 64))  # any dtype, by bytes
    assert b.dtype == torch.bfloat16 and b.data_ptr() % HUGE == 0
    out.add_(1)  # writable, and alive without the mapping's Python object
    del t


def test_small_tensors_and_unadvisable_systems_keep_the_tensor(monkeypatch):
    small = torch.zeros(hugepages.MIN_BYTES // 4 - 1)
    assert huge_copy(small) is small
    assert huge_empty((3, 5), torch.float16).shape == (3, 5)
    big = torch.zeros(hugepages.MIN_BYTES)
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    assert huge_copy(big) is big
