"""``--quantization int8|int4``: weight-only decode GEMMs stay close to the fp32 model."""

from __future__ import annotations

import pytest
import torch

from llmkit.core.engine.builder import architecture_of, build_model
from llmkit.core.model import quantize
from llmkit.core.model.linear import Linear
from llmkit.core.model.loader.source import iter_safetensors, load_config, resolve_model_dir
from llmkit.core.model.quant.int4_format import Int4Format
from llmkit.core.model.quant.int8 import INT8_MAX_ROWS, Int8Format
from llmkit.core.plugins import registry


def test_int8_linear_close_to_fp32():
    torch.manual_seed(0)
    w, x = torch.randn(256, 128) * 0.05, torch.randn(4, 128)
    layer = Linear(128, 256)
    layer.load(w)
    big = torch.randn(INT8_MAX_ROWS + 1, 128)
    ref, ref_big = layer(x), layer(big)
    layer.set_format(Int8Format())
    out = layer(x)
    assert ((out - ref).norm() / ref.norm()).item() < 0.02
    assert torch.equal(layer(big), ref_big)  # beyond the threshold the fp32 weights are used


@pytest.mark.parametrize("in_features", [4, 12, 24, 40, 100])
def test_int8_linear_with_input_width_off_the_kernels_multiple(in_features):
    # Widths the C kernel (a multiple of 32) and torch's int8pack kernel (16) do not take: torch's
    # read past the row (garbage at 1 row, a segfault at 3); these run the dequantized GEMM.
    torch.manual_seed(0)
    layer = Linear(in_features, 48)
    layer.load(torch.randn(48, in_features) * 0.05)
    layer.set_format(Int8Format(keep_dense=False))
    for rows in (1, 3, 20):
        x = torch.randn(rows, in_features)
        ref = x @ Int8Format().dense_weight(layer).T
        assert torch.allclose(layer(x), ref, atol=1e-5, rtol=1e-5)


def test_quantized_embedded_model_logits_close():
    d = resolve_model_dir(None)
    cfg = load_config(d)
    cls = registry().model(architecture_of(cfg))
    model = build_model(cls, cfg, torch.device("cpu"), torch.float32)
    model.load_weights(iter_safetensors(d))
    hidden = torch.randn(3, cfg["hidden_size"])
    with torch.inference_mode():
        ref = model.compute_logits(hidden)
        quantize.quantize(model, "int8")
        got = model.compute_logits(hidden)
    assert ((got - ref).norm() / ref.norm()).item() < 0.02
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 2 / 3


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("m", [1, 16, 512])
def test_int4_linear_close_to_fp32(group, m):
    torch.manual_seed(0)
    w, x = torch.randn(320, 256) * 0.05, torch.randn(m, 256)
    layer = Linear(256, 320)
    layer.load(w)
    ref = layer(x)
    layer.set_format(Int4Format(group))
    assert layer.weight is None  # no fp32 copy stays resident
    deq = layer.format.dense_weight(layer)
    # asymmetric 4-bit min/max: each weight within half a step of its group's range
    step = (w.view(320, -1, group).amax(-1) - w.view(320, -1, group).amin(-1)) / 15
    assert bool(((deq - w).abs().view(320, -1, group) <= step[..., None] * 0.51 + 2**-8 * w.abs().max()).all())
    out = layer(x)
    # 4-bit rounding of Gaussian weights: ~9% (group 32) to ~11% (group 128) of the output norm
    assert ((out - ref).norm() / ref.norm()).item() < 0.15
    # and against the dequantized weights it is only bf16 rounding
    assert ((out - x @ deq.T).norm() / (x @ deq.T).norm()).item() < 0.01


def test_int4_quantized_embedded_model_logits_close():
    d = resolve_model_dir(None)
    cfg = load_config(d)
    cls = registry().model(architecture_of(cfg))
    model = build_model(cls, cfg, torch.device("cpu"), torch.float32)
    model.load_weights(iter_safetensors(d))
    hidden = torch.randn(3, cfg["hidden_size"])
    with torch.inference_mode():
        ref = model.compute_logits(hidden)
        quantize.quantize(model, "int4", 64)
        got = model.compute_logits(hidden)
    assert model.layers[0].mlp.down_proj.format.name == "int4" and model.layers[0].mlp.down_proj.format.group == 64
    assert ((got - ref).norm() / ref.norm()).item() < 0.1
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 2 / 3


def test_int4_engine_serves_with_a_group_size():
    from model_utils import start_engine

    engine = start_engine(quantization="int4", quantization_group_size=128, max_total_tokens=512)
    try:
        layer = engine.runner.model.layers[0]
        assert layer.mlp.down_proj.format.group == 128  # 1536 input features
        assert layer.self_attn.qkv_proj.format.group == 64  # 576 = 4.5 x 128: the largest group that divides
    finally:
        engine.shutdown()
