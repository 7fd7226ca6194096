"""``--quantization int8``: weight-only int8 decode GEMMs stay close to the fp32 model."""

from __future__ import annotations

import torch

from llmkit.core.engine.builder import architecture_of, build_model
from llmkit.core.model.layers import INT8_MAX_ROWS, linear, quantize_int8
from llmkit.core.model.source import iter_safetensors, load_config, resolve_model_dir
from llmkit.core.plugins import registry


def test_int8_linear_close_to_fp32():
    torch.manual_seed(0)
    w, x = torch.randn(256, 128) * 0.05, torch.randn(4, 128)
    ref = linear(x, w)
    out = linear(x, w, q=quantize_int8(w))
    assert ((out - ref).norm() / ref.norm()).item() < 0.02
    big = torch.randn(INT8_MAX_ROWS + 1, 128)  # beyond the threshold the fp32 weights are used
    assert torch.equal(linear(big, w, q=quantize_int8(w)), linear(big, w))


def test_quantized_embedded_model_logits_close():
    d = resolve_model_dir(None)
    cfg = load_config(d)
    cls = registry().model(architecture_of(cfg))
    model = build_model(cls, cfg, torch.device("cpu"), torch.float32)
    model.load_weights(iter_safetensors(d))
    hidden = torch.randn(3, cfg["hidden_size"])
    with torch.inference_mode():
        ref = model.compute_logits(hidden)
        model.quantize("int8")
        got = model.compute_logits(hidden)
    assert ((got - ref).norm() / ref.norm()).item() < 0.02
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 2 / 3
