"""gpt-oss against transformers on tiny random-weight models: attention sinks, alternating sliding
window / full layers (prompts longer than the window), biases, YaRN rope, the clamped-SwiGLU experts
(a limit low enough to clamp), MXFP4 expert checkpoints; paged decode, shared prefixes and chunked
prefill; greedy generation through the engine; the variants and backends refused at start-up."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmkit.core.model.attention import SINKS, SLIDING_WINDOW
from llmkit.core.model.quant.mxfp4 import dequantize_mxfp4

from model_utils import assert_greedy_matches_generate, copy_embedded_tokenizer, load_ours, save_tiny_model
from paged_runner import PagedRunner, check_cached_prefix_chunked_decode, mixed_scenario, mixed_scenario_interpreted
from paged_runner import assert_close as _close

IDS = [(37 * i + 11) % 512 for i in range(52)]  # > the tiny model's 16-token window


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt-oss")
    ref = save_tiny_model("gpt_oss", d)
    with torch.no_grad():
        full = ref(torch.tensor([IDS])).logits[0]
    return d, ref, full


def test_layers_alternate_sliding_and_full(tiny):
    d, _, _ = tiny
    model = load_ours(d)
    assert [layer.self_attn.sliding_window for layer in model.layers] == [16, None]
    assert model.layers[0].self_attn.sinks.abs().max() > 0.1  # the sinks were loaded


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_logits_match_transformers(tiny, page_size):
    d, _, full = tiny
    runner = PagedRunner(load_ours(d), page_size)
    (ours,) = runner.step([(runner.new_seq(), IDS)])
    _close(ours, full)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cached_prefix_chunked_prefill_and_decode_match_transformers(tiny, page_size):
    """As for Qwen3-MoE: a 32-token prefix shared page-wise, the rest prefilled in chunks batched
    with the other sequence's decode steps, then batched decode; the window slides throughout."""
    d, ref, _ = tiny
    check_cached_prefix_chunked_decode(load_ours(d), ref, IDS, page_size)


def test_real_window_of_128_with_a_longer_prompt(tmp_path):
    """gpt-oss's own window (128): a 150-token prefill, then decode steps past it, deterministic
    mode (per-sequence attention) included."""
    ref = save_tiny_model("gpt_oss", tmp_path, sliding_window=128)
    ids = [(53 * i + 7) % 512 for i in range(156)]
    with torch.no_grad():
        full = ref(torch.tensor([ids])).logits[0]
    runner = PagedRunner(load_ours(tmp_path), 16)
    s = runner.new_seq()
    (lp,) = runner.step([(s, ids[:150])])
    _close(lp, full[:150])
    for i in range(150, 156):
        (ld,) = runner.step([(s, [ids[i]])], deterministic=i % 2 == 0)
        _close(ld, full[i : i + 1])


def _quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 codes with per-32 scales near ``w``'s magnitude (the test needs valid codes, not
    a faithful quantizer)."""
    *lead, cols = w.shape
    g = cols // 32
    codes = torch.randint(0, 256, (*lead, g, 16), dtype=torch.uint8)
    scales = torch.randint(124, 127, (*lead, g), dtype=torch.uint8)
    return codes, scales


def test_mxfp4_dequantization_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    blocks, scales = _quantize_mxfp4(torch.zeros(3, 8, 64))
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    ours = dequantize_mxfp4(blocks, scales)  # [E, out, in]
    assert torch.equal(ours.transpose(1, 2), theirs)


def test_mxfp4_checkpoint_loads_and_matches(tmp_path, caplog):
    """A checkpoint whose experts are stored as MXFP4 blocks/scales (as the published ones are):
    our logits equal transformers' with the same experts in dense form, and the log says they
    were dequantized."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    ref = save_tiny_model("gpt_oss", tmp_path, hidden_size=64, intermediate_size=64)
    tensors = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
        f.unlink()
    with torch.no_grad():
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            w = tensors.pop(name)  # [E, in, out]
            blocks, scales = _quantize_mxfp4(w.transpose(1, 2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            ref.get_parameter(name).copy_(dense)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="llmkit"):
        model = load_ours(tmp_path)
    assert "MXFP4 expert tensors dequantized" in caplog.text
    with torch.no_grad():
        full = ref(torch.tensor([IDS])).logits[0]
    runner = PagedRunner(model, 16)
    (ours,) = runner.step([(runner.new_seq(), IDS)])
    _close(ours, full)


def test_greedy_32_tokens_equal_transformers_generate(tmp_path):
    ref = save_tiny_model("gpt_oss", tmp_path)
    copy_embedded_tokenizer(tmp_path)
    cached = assert_greedy_matches_generate(ref, tmp_path, [IDS[:40], IDS[:32] + [401, 7, 99, 250, 3]])
    assert cached == [0, 32]


def test_unknown_quantization_is_refused_naming_the_field(tmp_path):
    from llmkit.core.engine.builder import build_model
    from llmkit.core.model.loader.source import load_config
    from llmkit.core.plugins import registry

    save_tiny_model("gpt_oss", tmp_path)
    config = load_config(tmp_path)
    config["quantization_config"] = {"quant_method": "awq"}
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method 'awq'.*supported: mxfp4"):
        build_model(registry().model("GptOssForCausalLM"), config, torch.device("cpu"), torch.float32)


def test_backends_without_sinks_are_refused():
    from llmkit.core.plugins import registry

    flashinfer = registry().attention_backend("flashinfer")
    with pytest.raises(ValueError, match="'flashinfer' does not implement sinks, sliding_window"):
        flashinfer.check_features({SINKS, SLIDING_WINDOW}, "flashinfer")
    for name in ("torch", "triton"):  # the triton kernels take windows and sinks (test_triton_attention)
        registry().attention_backend(name).check_features({SINKS, SLIDING_WINDOW}, name)


@pytest.mark.parametrize(
    "params",
    [
        # gpt-oss-20b's config.json
        dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, rope_theta=150000.0,
             original_max_position_embeddings=4096),
        # DeepSeek-V3's: truncation on, mscale == mscale_all_dim (attention factor 1)
        dict(rope_type="yarn", factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
             rope_theta=10000.0, original_max_position_embeddings=4096),
    ],
)  # fmt: skip
def test_yarn_frequencies_match_transformers(params):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from llmkit.core.model.layers import _rope

    raw = dict(hidden_size=2880, num_attention_heads=64, head_dim=64, max_position_embeddings=131072)
    cfg = transformers.GptOssConfig(**raw, rope_parameters=dict(params))
    theirs, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours, our_scale = _rope(64, {**raw, "rope_scaling": dict(params)})
    assert our_scale == pytest.approx(scale, rel=1e-9)
    assert torch.allclose(ours.float(), theirs.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_kernels_interpreted_match_torch_and_transformers(tiny, page_size, tmp_path):
    """gpt-oss on the triton attention backend and the fused-MoE kernel (in Triton's interpreter;
    sinks and a 16-token window over prompts of 32-51 tokens, biased clamped-SwiGLU experts): a
    cached prefix, chunked prefill mixed with decode (extend kernel), decode (split-K kernel)
    equal the torch paths and transformers."""
    d, _, full = tiny
    got = mixed_scenario_interpreted(d, page_size, IDS, tmp_path / "triton.pt")
    want = mixed_scenario(d, page_size, IDS)
    assert len(got) == len(want) == 11
    _close(got[0], full[:32])  # the prefill, against transformers
    _close(got[-2], full[50:51])  # b's last decode step
    for g, w in zip(got, want):
        _close(g, w)
