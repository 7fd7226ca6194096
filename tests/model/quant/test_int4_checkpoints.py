"""GPTQ and AWQ 4-bit group-128 checkpoints, written here in the formats' real tensor layouts
(qweight / qzeros / scales / g_idx), load onto the int4 kernel and match a transformers model that
holds the same weights dequantized by the formats' published formulas.

Tolerance: the int4 values, zeros and groups are carried over exactly; the kernel keeps each
group's scale and zero in bf16 (<= 2^-9 relative) and multiplies bf16 activations, so a layer is
within 1% relative of the fp32 product. The two-layer model's logits (weights |w| <= 0.09) land at
0.2-0.3% relative (measured); bound 1.5%. (With 7x larger weights the errors compound to 2-8%
through the layers: the bf16 activations of the kernel, not the layout.) A layout mistake (nibble
order, transposition, zero offset) gives errors of order 100%.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from llmkit.core.engine.builder import build_model
from llmkit.core.model import quantize
from llmkit.core.model.loader.int4_checkpoints import int4_checkpoint_weights, quant_method
from llmkit.core.model.loader.source import iter_safetensors, load_config
from llmkit.core.plugins import registry

GROUP = 128
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _int32(v: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns < 2^32 as the int32 the checkpoints store."""
    return ((v + 2**31) % 2**32 - 2**31).to(torch.int32)


def _pack_gptq(q, z, g_idx):
    """q [K, N] and z [groups, N] (1..15) into GPTQ's qweight [K/8, N] / qzeros [groups, N/8]."""
    k, n = q.shape
    qw = sum(q.view(k // 8, 8, n)[:, j].long() << (4 * j) for j in range(8))
    zs = z.long() - 1  # GPTQ (v1) stores zero - 1
    qz = sum(zs.view(-1, n // 8, 8)[:, :, j] << (4 * j) for j in range(8))
    return {"qweight": _int32(qw), "qzeros": _int32(qz), "g_idx": g_idx.to(torch.int32)}


def _pack_awq(q, z):
    """q [K, N] and z [groups, N] into AWQ's qweight [K, N/8] / qzeros [groups, N/8], columns
    interleaved in the order [0, 2, 4, 6, 1, 3, 5, 7]."""

    def pack(t):
        r, n = t.shape
        t = t.long().view(r, n // 8, 8)
        return _int32(sum(t[:, :, AWQ_ORDER[i]] << (4 * i) for i in range(8)))

    return {"qweight": pack(q), "qzeros": pack(z)}


def _write(method: str, path, act_order: bool = False):
    """A random two-layer Llama as a GPTQ/AWQ checkpoint; returns the transformers model holding
    the dequantized weights."""
    import transformers

    from model_utils import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config("llama")
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 256, 256, 64  # two groups per input
    perms = {}  # GPTQ's act order follows the input's Hessian: layers sharing an input share it
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    tensors = {}
    with torch.no_grad():
        for name, p in ref.named_parameters():
            leaf = name.rsplit(".", 2)[-2]
            if leaf not in LINEARS:
                if p.dim() > 1:
                    p.normal_(0, 0.2)
                tensors[name] = p.detach().half().float().clone()
                p.copy_(tensors[name])
                continue
            n, k = p.shape
            groups = k // GROUP
            q = torch.randint(0, 16, (k, n))
            z = torch.randint(1, 16, (groups, n))
            s = (torch.rand(groups, n) * 0.004 + 0.002).half()  # |w| <= 0.09: a well-conditioned model
            if act_order:
                shares = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}
                key = (name.split(".")[2], shares.get(leaf, leaf))
                perm = perms.setdefault(key, torch.randperm(k))
                g_idx = torch.empty(k, dtype=torch.long)
                g_idx[perm] = torch.arange(k) // GROUP
            else:
                g_idx = torch.arange(k) // GROUP
            if method == "gptq":
                w = s.float()[g_idx] * (q - z[g_idx]).float()  # [K, N]
                packed = _pack_gptq(q, z, g_idx)
            else:
                w = s.float()[g_idx] * (q - z[g_idx]).float()
                packed = _pack_awq(q, z)
            p.copy_(w.t())
            prefix = name.removesuffix(".weight")
            tensors.update({f"{prefix}.{key}": v for key, v in packed.items()})
            tensors[f"{prefix}.scales"] = s
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = cfg.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order, "sym": False}
        if method == "gptq"
        else {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    )
    (path / "config.json").write_text(json.dumps(config))
    return ref


@pytest.mark.parametrize("method, act_order", [("gptq", False), ("gptq", True), ("awq", False)])
def test_int4_checkpoint_matches_its_dequantized_reference(method, act_order, tmp_path):
    from tests.model.test_reference_transformers import _prefill_logits

    ref = _write(method, tmp_path, act_order)
    cfg = load_config(tmp_path)
    assert quant_method(cfg) == method
    model = build_model(registry().model("LlamaForCausalLM"), cfg, torch.device("cpu"), torch.float32)
    model.load_weights(int4_checkpoint_weights(iter_safetensors(tmp_path), cfg))
    quantize.finalize_weights(model)
    layer = model.layers[1].mlp.down_proj
    assert layer.format.name == "int4" and layer.format.group == GROUP and layer.weight is None
    ref_w = ref.model.layers[1].mlp.down_proj.weight.detach()
    torch.testing.assert_close(layer.format.dense_weight(layer), ref_w, rtol=2**-7, atol=2**-7 * ref_w.abs().max())
    for m in (1, 16, 512):  # the int4 kernel (decode) and dequantize-then-fp32 (prefill)
        x = torch.randn(m, ref_w.shape[1])
        want = x @ ref_w.T
        assert ((layer(x) - want).norm() / want.norm()).item() < 0.01
    ids = torch.randint(0, 512, (40,)).tolist()
    got = _prefill_logits(model, ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert ((got - want).norm() / want.norm()).item() < 0.015
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    if act_order:
        assert model.layers[0].self_attn.qkv_proj.in_perm is not None


def test_unsupported_checkpoint_quantization_fails_naming_the_supported_ones():
    with pytest.raises(ValueError, match="'fp8' is not supported; supported: gptq, awq"):
        quant_method({"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="3 bits"):
        quant_method({"quantization_config": {"quant_method": "gptq", "bits": 3}})


def test_engine_loads_a_gptq_directory_through_the_builder(tmp_path):
    from model_utils import copy_embedded_tokenizer, start_engine

    _write("gptq", tmp_path)
    copy_embedded_tokenizer(tmp_path)
    engine = start_engine(model_path=str(tmp_path), max_total_tokens=256)
    try:
        layer = engine.runner.model.layers[0].self_attn.qkv_proj
        assert layer.format.name == "int4" and layer.format.group == GROUP
    finally:
        engine.shutdown()
