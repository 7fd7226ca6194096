"""GLM-4.5 (DeepSeek-V3's grouped sigmoid routing with shared experts after a dense layer, partial
rotary, Q/K/V bias and per-head norms) and MiniMax-M2 (whole-projection Q/K norms, partial rotary,
biased sigmoid routing) against transformers on tiny random weights: logits of prefill, chunked
prefill over a radix-cached prefix and batched decode; greedy generation through the real engine;
GLM's multi-token-prediction layer in the checkpoint is skipped."""

from __future__ import annotations

import json

import pytest
import torch

from breadth_utils import IDS, save_tiny
from model_utils import assert_greedy_matches_generate, load_ours
from paged_runner import check_cached_prefix_chunked_decode

FAMILIES = {
    "glm4_moe": ("Glm4MoeForCausalLM", ["MLP", "MoE", "MoE"]),
    "minimax_m2": ("MiniMaxM2ForCausalLM", ["RoutedMoE", "RoutedMoE"]),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, save_tiny(request.param, d)


def test_logits_match_transformers(tiny):
    arch, d, ref = tiny
    model = load_ours(d)
    cls, mlps = FAMILIES[arch]
    assert type(model).__name__ == cls
    assert [type(layer.mlp).__name__ for layer in model.layers] == mlps
    assert {layer.self_attn.rotary_dim for layer in model.layers} == {16}
    check_cached_prefix_chunked_decode(model, ref, IDS, page_size=4)


def test_greedy_generate_matches_transformers(tiny):
    _, d, ref = tiny
    cached = assert_greedy_matches_generate(ref, d, [IDS[:40], IDS[:40] + [7, 8, 9]], n=12)
    assert cached[1] >= 32


def test_glm_skips_the_mtp_layer(tmp_path):
    """A checkpoint whose config counts one layer fewer than it ships (GLM's MTP layer, stored after
    the last decoder layer) loads and still matches."""
    ref = save_tiny("glm4_moe", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    model = load_ours(tmp_path)
    assert len(model.layers) == 2 and ref.config.num_hidden_layers == 3


def test_minimax_fp8_block_checkpoint_loads_and_matches(tmp_path):
    """MiniMax's published checkpoints: projections and experts in float8_e4m3fn with a
    ``weight_scale_inv`` per block (here 8x8, ragged at the edges), the rest unquantized. Loaded
    dequantized, the logits equal transformers' on the same dequantized weights."""
    import transformers
    from safetensors.torch import load_file, save_file

    save_tiny("minimax_m2", tmp_path / "hf")
    tensors = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    plain, fp8 = dict(tensors), dict(tensors)
    names = [
        n
        for n, t in tensors.items()
        if t.dim() == 2 and n.endswith(("proj.weight", "w1.weight", "w2.weight", "w3.weight"))
    ]
    for name in names:
        w = tensors[name]
        rows, cols = w.shape
        pad = torch.zeros(-(-rows // 8) * 8, -(-cols // 8) * 8)
        pad[:rows, :cols] = w.abs()
        scale = pad.view(-(-rows // 8), 8, -1, 8).amax(dim=(1, 3)).clamp(min=1e-8) / 448  # (e4m3's max)
        full = scale.repeat_interleave(8, 0)[:rows].repeat_interleave(8, 1)[:, :cols]
        q = (w / full).to(torch.float8_e4m3fn)
        fp8[name], fp8[name + "_scale_inv"] = q, scale
        plain[name] = q.float() * full
    for d, tensors_out in (("plain", plain), ("fp8", fp8)):
        (tmp_path / d).mkdir()
        save_file(tensors_out, str(tmp_path / d / "model.safetensors"))
        cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
        if d == "fp8":
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [8, 8]}
        (tmp_path / d / "config.json").write_text(json.dumps(cfg))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "plain"), dtype=torch.float32).eval()
    assert len(names) > 20
    check_cached_prefix_chunked_decode(load_ours(tmp_path / "fp8"), ref, IDS, page_size=4)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"attn_type_list": [0, 1]}, "lightning-attention"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        ({"quantization_config": {"quant_method": "fp8"}}, "weight_block_size"),
    ],
)
def test_minimax_variants_it_cannot_run_are_refused(override, message):
    from llmkit.core.engine.builder import build_model
    from llmkit.core.plugins import registry

    from breadth_utils import tiny_config

    config = {**tiny_config("minimax_m2").to_dict(), **override}
    with pytest.raises(ValueError, match=message):
        build_model(registry().model("MiniMaxM2ForCausalLM"), config, torch.device("cpu"), torch.float32)
