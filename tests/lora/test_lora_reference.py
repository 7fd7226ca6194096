"""LoRA logits against transformers + peft with the adapter merged into the base weights: fused
QKV and gate-up targets, rsLoRA scaling, and over a quantized base."""

from __future__ import annotations

import pytest
import torch

from llmkit.core.lora.manager import LoRAManager
from llmkit.core.model import quantize

from lora_utils import ALL_TARGETS, merged_logits, save_adapter
from model_utils import load_ours, save_tiny_model

IDS = [3, 17, 99, 250, 7, 401, 12, 5, 300, 42, 8, 1]


def _prefill(model, ids, lora):
    from tests.model.test_reference_transformers import _prefill_logits

    return _prefill_logits(model, ids, lora=lora)


@pytest.mark.parametrize(
    "targets,rslora",
    [
        (ALL_TARGETS, False),  # fused QKV and gate-up, every part adapted
        (["q_proj", "v_proj", "up_proj", "down_proj"], False),  # parts left out of fused layers
        (["k_proj", "o_proj", "gate_proj"], True),  # rsLoRA: alpha / sqrt(r)
    ],
)
def test_logits_match_peft_merged(tmp_path, targets, rslora):
    save_tiny_model("llama", tmp_path / "base")
    peft_model = save_adapter(tmp_path / "base", tmp_path / "ad", seed=1, r=8, alpha=16, targets=targets, rslora=rslora)
    theirs = merged_logits(peft_model, IDS)
    model = load_ours(tmp_path / "base")
    base = _prefill(model, IDS, None)
    lora = LoRAManager(model, max_rank=64, max_per_batch=4)
    adapter = lora.load("ad", str(tmp_path / "ad"))
    assert lora.activate([adapter], [len(IDS)], torch.device("cpu"))
    ours = _prefill(model, IDS, lora.batch)
    assert (ours - base).abs().max() > 1e-2  # the adapter changes the logits
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()
    lora.deactivate()
    assert torch.equal(_prefill(model, IDS, None), base)  # base rows: exactly the plain model


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_attention_adapters_of_other_families_match_peft_merged(tmp_path, arch):
    """Qwen3 (Q/K norms: the Python layers) and Qwen3-MoE's attention projections; the MoE
    block's experts are not adaptable, so an adapter there is refused by name."""
    save_tiny_model(arch, tmp_path / "base")
    attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
    peft_model = save_adapter(tmp_path / "base", tmp_path / "ad", seed=3, r=4, targets=attn)
    theirs = merged_logits(peft_model, IDS)
    model = load_ours(tmp_path / "base")
    lora = LoRAManager(model, max_rank=64, max_per_batch=4)
    adapter = lora.load("ad", str(tmp_path / "ad"))
    lora.activate([adapter], [len(IDS)], torch.device("cpu"))
    ours = _prefill(model, IDS, lora.batch)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()
    if arch == "qwen3_moe":  # layer 0 is sparse: its experts are not adaptable (yet), refused by name
        save_adapter(tmp_path / "base", tmp_path / "mlp", seed=4, r=4, targets=["down_proj"])
        with pytest.raises(ValueError, match="experts"):
            lora.load("mlp", str(tmp_path / "mlp"))


def test_over_an_int8_base_the_delta_is_the_dense_one(tmp_path):
    """The adapter adds on the quantized layer's output: (int8 base + LoRA) - int8 base equals
    the dense model's LoRA delta up to the input's int8 error."""
    save_tiny_model("llama", tmp_path / "base")
    save_adapter(tmp_path / "base", tmp_path / "ad", seed=2, r=4, targets=["o_proj", "down_proj"])
    deltas = []
    for method in (None, "int8"):
        model = load_ours(tmp_path / "base")
        if method:
            quantize.quantize(model, method)
        lora = LoRAManager(model, max_rank=64, max_per_batch=4)
        adapter = lora.load("ad", str(tmp_path / "ad"))
        base = _prefill(model, IDS, None)
        lora.activate([adapter], [len(IDS)], torch.device("cpu"))
        deltas.append(_prefill(model, IDS, lora.batch) - base)
    assert deltas[1].abs().max() > 1e-2
    assert torch.allclose(deltas[0], deltas[1], atol=0.1 * deltas[0].abs().max().item())
