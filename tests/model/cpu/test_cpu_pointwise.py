"""The C pointwise ops (rotary rotation, SiLU-and-multiply) against their torch spellings."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmkit.core.model.cpu import cpu_pointwise
from llmkit.core.model.layers import RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu_pointwise._lib() is None, reason="no C kernel here")


@pytest.mark.parametrize("dim", [64, 128, 24])  # whole 8-lane halves, and a scalar path
@pytest.mark.parametrize("tokens", [1, 5, 300])  # one thread, and the threads sharing rows
def test_rotation_is_bit_for_bit_torchs(dim, tokens):
    g = torch.Generator().manual_seed(dim + tokens)
    rope = RotaryEmbedding(dim, 4096, {"rope_theta": 500000.0})
    cos2, sin2 = rope.table(torch.randint(0, 4096, (tokens,), generator=g), torch.float32)
    heads, kv = 6, 2
    qkv = torch.randn(tokens, (heads + 2 * kv) * dim, generator=g)
    x = qkv[:, : (heads + kv) * dim].view(tokens, heads + kv, dim)  # a strided view, as the model passes it
    want = x * cos2 + x.roll(dim // 2, -1) * sin2
    assert torch.equal(cpu_pointwise.rotate(x, cos2, sin2), want)
    assert torch.equal(RotaryEmbedding.rotate(x, (cos2, sin2)), want)


@pytest.mark.parametrize("inter", [1536, 20])
def test_silu_mul_matches_torch(inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(70, 2 * inter, generator=g) * 6
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, 1e-30])  # exp's range ends
    gate, up = gate_up.split(inter, dim=-1)
    got = cpu_pointwise.silu_mul(gate_up, inter)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    assert torch.equal(cpu_pointwise.silu_mul(gate_up[3:4], inter), got[3:4])  # rows stand alone


def test_fallbacks_are_the_torch_ops(monkeypatch):
    x = torch.randn(3, 4, 64)
    cos2, sin2 = torch.randn(3, 1, 64), torch.randn(3, 1, 64)
    gate_up = torch.randn(3, 64)
    fast_rot, fast_act = cpu_pointwise.rotate(x, cos2, sin2), cpu_pointwise.silu_mul(gate_up, 32)
    monkeypatch.setattr(cpu_pointwise, "_lib", lambda: None)
    assert torch.equal(cpu_pointwise.rotate(x, cos2, sin2), fast_rot)
    torch.testing.assert_close(cpu_pointwise.silu_mul(gate_up, 32), fast_act, rtol=1e-6, atol=1e-6)
