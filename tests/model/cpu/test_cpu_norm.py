"""The C RMSNorm (fused residual add) against torch's, row by row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmkit.core.model.cpu import cpu_norm
from llmkit.core.model.layers import RMSNorm

pytestmark = pytest.mark.skipif(not cpu_norm.usable(torch.zeros(1), torch.zeros(1)), reason="no C kernel here")


@pytest.mark.parametrize("dim", [576, 64, 13])  # whole 8-lane chunks, and a scalar tail
def test_matches_torch_and_rows_do_not_depend_on_the_batch(dim):
    g = torch.Generator().manual_seed(dim)
    x, res, w = torch.randn(40, dim, generator=g), torch.randn(40, dim, generator=g), torch.randn(dim, generator=g)
    out, total = cpu_norm.rms_norm(x, w, 1e-5, res)
    assert torch.equal(total, x + res)
    torch.testing.assert_close(out, F.rms_norm(x + res, (dim,), w, 1e-5), atol=2e-6, rtol=2e-6)
    assert torch.equal(cpu_norm.rms_norm(x[7:9], w, 1e-5, res[7:9])[0], out[7:9])
    torch.testing.assert_close(cpu_norm.rms_norm(x, w, 1e-5), F.rms_norm(x, (dim,), w, 1e-5), atol=2e-6, rtol=2e-6)


def test_the_layer_takes_the_c_path_and_its_fallback_agrees(monkeypatch):
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.normal_()
    x, res = torch.randn(3, 4, 64), torch.randn(3, 4, 64)  # q/k norms see [tokens, heads, head_dim]
    fast, fast_sum = norm(x, res)
    monkeypatch.setattr(cpu_norm, "usable", lambda x, weight: False)
    slow, slow_sum = norm(x, res)
    assert torch.equal(fast_sum, slow_sum)
    torch.testing.assert_close(fast, slow, atol=2e-6, rtol=2e-6)
