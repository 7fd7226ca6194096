"""The C int4 GEMM (llama.cpp's Q4 x Q8 scheme): its packing, its two builds, its rows."""

from __future__ import annotations

import pytest
import torch

from llmkit.core import native
from llmkit.core.model.cpu import cpu_quant
from llmkit.core.model.linear import Linear
from llmkit.core.model.quant.int4_format import Int4Format, quantize_int4

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C kernel here")


def _weight(n: int, k: int, group: int, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, scale, zero = quantize_int4(w, group)
    packed, sz = cpu_quant.q4_pack(q, scale, zero)
    s, z = scale.bfloat16().float(), zero.bfloat16().float()  # what the kernel keeps
    deq = ((q.float() - 8).view(n, -1, group) * s[..., None] + z[..., None]).view(n, k)
    return q, packed, sz, deq


def test_packing_round_trips_whole_and_by_rows():
    q, packed, sz, _ = _weight(96, 256, 64)
    back, scale, zero = cpu_quant.q4_unpack(packed, sz)
    assert torch.equal(back, q)
    rows = torch.tensor([0, 7, 8, 95, 33])
    q_r, s_r, z_r = cpu_quant.q4_unpack(packed, sz, rows)
    assert torch.equal(q_r, q[rows]) and torch.equal(s_r, scale[rows]) and torch.equal(z_r, zero[rows])


@pytest.mark.parametrize(("n", "k", "group"), [(960, 576, 32), (128, 1536, 128), (64, 256, 256)])
def test_close_to_the_dequantized_weight_and_rows_stand_alone(n, k, group):
    _, packed, sz, deq = _weight(n, k, group)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(1))
    n_out = n - 24  # the last column tile only partly kept (a layer's padding rows)
    y = cpu_quant.q4_linear(x, packed, sz, group, n_out)
    ref = x @ deq[:n_out].T
    # int8 activation blocks of 32: each x within half a step of amax/127 -> ~0.5 % of the output norm
    assert ((y - ref).norm() / ref.norm()).item() < 0.01
    for rows in (slice(0, 1), slice(5, 9), slice(64, 130)):  # one row, a 4-row tile, a second row chunk
        assert torch.equal(cpu_quant.q4_linear(x[rows], packed, sz, group, n_out), y[rows])


@pytest.mark.skipif(not native.cpu_has("avx512vnni"), reason="no AVX512-VNNI here")
def test_the_vnni_and_avx2_builds_agree_bit_for_bit():
    _, packed, sz, _ = _weight(320, 576, 32)
    qw = torch.randint(-127, 128, (200, 576), dtype=torch.int8)
    qs = torch.rand(200).bfloat16()
    for m in (1, 4, 37):
        x = torch.randn(m, 576) * 3
        assert torch.equal(
            cpu_quant.q4_linear(x, packed, sz, 32, 320, "avx2"), cpu_quant.q4_linear(x, packed, sz, 32, 320)
        )
        assert torch.equal(cpu_quant.q8_linear(x, qw, qs, "avx2"), cpu_quant.q8_linear(x, qw, qs))


def test_a_layer_packs_for_the_kernel_it_will_run(monkeypatch):
    w, x = torch.randn(200, 256) * 0.05, torch.randn(9, 256)
    outs = []
    for kernel in (True, False):
        monkeypatch.setattr(cpu_quant, "available", lambda kernel=kernel: kernel)
        layer = Linear(256, 200)
        layer.load(w)
        layer.set_format(Int4Format(64))
        assert layer.q4_native is kernel
        outs.append((layer(x), layer.format.dense_weight(layer), layer.format.embed(layer, torch.tensor([3, 199]))))
    (fast, w_fast, e_fast), (slow, w_slow, e_slow) = outs
    assert torch.equal(w_fast, w_slow) and torch.equal(e_fast, e_slow)  # the same stored weight
    assert ((fast - slow).norm() / slow.norm()).item() < 0.01  # int8 against bf16 activations


def _symmetric_weight(n: int, k: int, group: int, seed: int = 0):
    """Q4_0-like: zeros 0, scales powers of two (exact in bf16 and fp16 alike)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = 2.0 ** torch.randint(-9, -3, (n, k // group), generator=g).float()
    return q, scale, torch.zeros_like(scale)


def test_the_scale_only_layout_computes_what_the_pairs_compute():
    """A symmetric weight packs scale-only (fp16 scales, no zeros: 18 bytes per 32 weights, not 20).
    Where its scales are exact in bf16 too, the two layouts give the same numbers bit for bit, at
    every row count, and unpack to the same values."""
    q, scale, zero = _symmetric_weight(96, 512, 32)
    assert cpu_quant.symmetric(scale, zero) and not cpu_quant.symmetric(scale, zero + 0.5)
    assert not cpu_quant.symmetric(scale * 1.0001, zero)  # not an fp16: stays in pairs
    pairs, sym = cpu_quant.q4_pack(q, scale, zero), cpu_quant.q4_pack(q, scale, zero, sym=True)
    assert sym[1].dtype == torch.float16 and sym[1].numel() * 2 == pairs[1].numel()
    for m in (1, 3, 8, 40):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        assert torch.equal(cpu_quant.q4_linear(x, *sym, 32, 90), cpu_quant.q4_linear(x, *pairs, 32, 90))
        if native.cpu_has("avx512vnni"):
            assert torch.equal(cpu_quant.q4_linear(x, *sym, 32, 90, "avx2"), cpu_quant.q4_linear(x, *sym, 32, 90))
    for a, b in zip(cpu_quant.q4_unpack(*sym), cpu_quant.q4_unpack(*pairs)):
        assert torch.equal(a, b)


def test_a_q4_0_layer_keeps_its_fp16_scales():
    """GGUF Q4_0's scale is an fp16: the scale-only layout keeps it exactly (the pairs would round it
    to bf16), so the layer's dequantized weight is the gguf package's reference bit for bit."""
    from tests.model.quant.test_gguf_quant import _blocks, _layer, _reference

    blocks = _blocks("Q4_0", rows=64, cols=256)
    layer = _layer(blocks, "Q4_0", rows=64, cols=256)
    assert layer.q4_native and layer.q4_scale_zero.dtype == torch.float16
    assert torch.equal(layer.format.dense_weight(layer), _reference(blocks, "Q4_0"))
