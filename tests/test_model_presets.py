"""The real-shape presets of the new families (benchmarks/gpu_presets.py, for --load-format dummy)
build with the published parameter counts; built on the meta device, so nothing is allocated."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from llmkit.core.engine.builder import build_model
from llmkit.core.plugins import registry

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from gpu_presets import PRESETS  # noqa: E402


@pytest.mark.parametrize(
    ("preset", "layers", "billions", "kv_numbers_per_token_layer"),
    [
        ("qwen3-30b-a3b", None, 30.5, 2 * 4 * 128),
        ("gpt-oss-20b", None, 20.9, 2 * 8 * 64),
        ("deepseek-v3-5l", None, 26.6, 512 + 64),
        # the preset at DeepSeek-V3's full 61 layers: 671B without the MTP module; its latent
        # cache holds 512 + 64 numbers per token and layer (vs 2 x 128 heads x 192/128 decompressed)
        ("deepseek-v3-5l", 61, 671, 512 + 64),
    ],
)
def test_presets_build_with_the_published_sizes(preset, layers, billions, kv_numbers_per_token_layer):
    config = dict(PRESETS[preset])
    if layers:
        config["num_hidden_layers"] = layers
    model = build_model(registry().model(config["architectures"][0]), config, torch.device("meta"), torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    assert n / 1e9 == pytest.approx(billions, rel=0.03), n
    k, v = model.kv_cache_dims
    assert model.local_kv_heads * (k + v) == kv_numbers_per_token_layer
