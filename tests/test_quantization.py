"""``--quantization int8``: weight-only int8 decode GEMMs stay close to the fp32 model."""

from __future__ import annotations

import torch

from llmkit.core.engine.builder import architecture_of, build_model
from llmkit.core.model.linear import Linear
from llmkit.core.model.source import iter_safetensors, load_config, resolve_model_dir
from llmkit.core.model.weight_formats import INT8_MAX_ROWS, Int8Format
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
