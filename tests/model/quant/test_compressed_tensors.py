"""compressed-tensors checkpoints (llm-compressor's format), written by the ``compressed-tensors``
package itself, against transformers' model on the same checkpoint dequantized
(``CompressedTensorsConfig(dequantize=True)``, the package's own formulas).

4-bit ``pack-quantized`` weights load onto the int4 kernel: their values, zero points and groups
carry over exactly and each group's scale and zero are kept in bf16 (<= 2^-9 relative), the kernel
multiplying bf16 activations, so the bound is the GPTQ/AWQ tests' (test_int4_checkpoints.py): the
dense weight within 2^-7, logits within 1.5 % relative on weights of |w| <~ 0.1. int8 and FP8
weights are dequantized at load: the same numbers as the reference, greedy tokens equal.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

from llmkit.core.engine.builder import build_model
from llmkit.core.model import quantize
from llmkit.core.model.loader.compressed_tensors import checkpoint_quantization, compressed_tensors_weights
from llmkit.core.model.loader.source import iter_safetensors, load_config
from llmkit.core.plugins import registry

from model_utils import assert_greedy_matches_generate, copy_embedded_tokenizer, start_engine, tiny_config

ct = pytest.importorskip("compressed_tensors")


def _observe(module) -> None:
    """The weight's min/max per the scheme's strategy, turned into scale and zero point."""
    from compressed_tensors.quantization.utils import calculate_qparams

    w, a = module.weight.data, module.quantization_scheme.weights
    if a.strategy == "group":
        g = w.view(w.shape[0], -1, a.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    elif a.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif a.strategy == "block":
        b0, b1 = a.block_structure
        g = w.view(w.shape[0] // b0, b0, w.shape[1] // b1, b1)
        lo, hi = g.amin((1, 3)), g.amax((1, 3))
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zp = calculate_qparams(lo, hi, a)
    module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data = zp.to(module.weight_zero_point.dtype).reshape(module.weight_zero_point.shape)


def write_checkpoint(path, fmt: str, std: float = 0.2, **weights):
    """A tiny Llama quantized by compressed-tensors (``weights``: its QuantizationArgs) and saved
    compressed in ``fmt``; returns transformers' model on it, dequantized."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for m in model.modules():
        if hasattr(m, "weight_scale"):
            _observe(m)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(path))
    compressor.update_config(str(path))
    copy_embedded_tokenizer(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.CompressedTensorsConfig(dequantize=True)
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, quantization_config=cfg
        ).eval()


def _ours(path):
    cfg = load_config(path)
    assert checkpoint_quantization(cfg) == "compressed-tensors"
    model = build_model(registry().model("LlamaForCausalLM"), cfg, torch.device("cpu"), torch.float32)
    model.load_weights(compressed_tensors_weights(iter_safetensors(path), cfg))
    quantize.finalize_weights(model)
    return model


INT4 = {
    "group": dict(strategy="group", group_size=32, symmetric=True),
    "group-asymmetric": dict(strategy="group", group_size=32, symmetric=False),
    "channel": dict(strategy="channel", symmetric=True),
}


@pytest.mark.parametrize("case", sorted(INT4))
def test_int4_pack_quantized_on_the_int4_kernel(case, tmp_path):
    from tests.model.test_reference_transformers import _prefill_logits

    ref = write_checkpoint(tmp_path, "pack-quantized", std=0.03, num_bits=4, type="int", **INT4[case])
    model = _ours(tmp_path)
    layer = model.layers[1].mlp.down_proj
    assert layer.format.name == "int4" and layer.weight is None
    ref_w = ref.model.layers[1].mlp.down_proj.weight.detach()
    torch.testing.assert_close(layer.format.dense_weight(layer), ref_w, rtol=2**-7, atol=2**-7 * ref_w.abs().max())
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    got = _prefill_logits(model, ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert ((got - want).norm() / want.norm()).item() < 0.015
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


DEQUANTIZED = {
    "int8-channel": ("int-quantized", dict(num_bits=8, type="int", strategy="channel", symmetric=True)),
    "fp8-channel": ("float-quantized", dict(num_bits=8, type="float", strategy="channel", symmetric=True)),
    "fp8-tensor": ("float-quantized", dict(num_bits=8, type="float", strategy="tensor", symmetric=True)),
    "fp8-block": (
        "float-quantized",
        dict(num_bits=8, type="float", strategy="block", block_structure=[32, 32], symmetric=True),
    ),
}


@pytest.mark.parametrize("case", sorted(DEQUANTIZED))
def test_int8_and_fp8_dequantized_equal_the_reference(case, tmp_path):
    fmt, args = DEQUANTIZED[case]
    ref = write_checkpoint(tmp_path, fmt, **args)
    model = _ours(tmp_path)
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        ours = model.layers[0].get_submodule(name).weight
        assert torch.equal(ours, ref.model.layers[0].get_submodule(name).weight.detach()), name
    if case == "fp8-block":  # one served run: the engine picks the loader from config.json
        assert_greedy_matches_generate(ref, tmp_path, [[(7 * i) % 500 + 1 for i in range(24)]], n=8)


def test_engine_serves_int4_through_the_builder(tmp_path):
    write_checkpoint(tmp_path, "pack-quantized", std=0.03, num_bits=4, type="int", strategy="group", group_size=32)
    engine = start_engine(model_path=str(tmp_path), max_total_tokens=256)
    try:
        layer = engine.runner.model.layers[0].self_attn.qkv_proj
        assert layer.format.name == "int4" and layer.format.group == 32
    finally:
        engine.shutdown()


def test_unreadable_schemes_fail_naming_what(tmp_path):
    base = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
    bad = [
        ({**base, "format": "nvfp4-pack-quantized", "config_groups": {"g": {"weights": weights}}}, "format"),
        ({**base, "config_groups": {"g": {"weights": {**weights, "strategy": "tensor_group"}}}}, "strategy"),
        ({**base, "config_groups": {}}, "no config_groups"),
        (
            {**base, "config_groups": {"a": {"weights": weights}, "b": {"weights": {**weights, "group_size": 64}}}},
            "differently",
        ),
    ]
    for qc, what in bad:
        with pytest.raises(ValueError, match=what):
            checkpoint_quantization({"quantization_config": qc})
    # a layer whose scale is in the file but whose weight is not: named, not half-loaded
    write_checkpoint(tmp_path, "int-quantized", num_bits=8, type="int", strategy="channel", symmetric=True)
    cfg = load_config(tmp_path)
    dropped = ((n, t) for n, t in iter_safetensors(tmp_path) if n != "model.layers.0.mlp.up_proj.weight")
    with pytest.raises(KeyError, match="model.layers.0.mlp.up_proj"):
        list(compressed_tensors_weights(dropped, cfg))
