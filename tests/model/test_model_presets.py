"""The real-shape presets of the new families (benchmarks/gpu_presets.py, for --load-format dummy)
build with the published parameter counts; built on the meta device, so nothing is allocated."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from llmkit.core.engine.builder import build_model
from llmkit.core.plugins import registry

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
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


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v2"])
def test_dummy_load_format_serves_the_new_families(tmp_path, arch):
    """--load-format dummy: random weights into every parameter (experts, sinks, MLA's latent
    projections, whose absorbed copies are derived after the fill) and the engine generates."""
    import threading

    from llmkit.core.engine.messages import GenerateRequest, SamplingParams

    from model_utils import copy_embedded_tokenizer, save_tiny_model, start_engine

    save_tiny_model(arch, tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()  # dummy weights need no checkpoint
    copy_embedded_tokenizer(tmp_path)
    engine = start_engine(model_path=str(tmp_path), load_format="dummy", device="cpu", max_total_tokens=256)
    try:
        mla = getattr(engine.runner.model.layers[0].self_attn, "w_uk", None)
        done, out = threading.Event(), []

        def sink(o):
            out.extend(o.token_ids)
            if o.finished:
                done.set()

        params = SamplingParams(max_new_tokens=4, min_new_tokens=4, temperature=0)
        engine.submit(GenerateRequest("dummy", [5, 6, 7, 8], params), sink)
        assert done.wait(120)
        assert len(out) == 4 and all(0 <= t < 512 for t in out)
        if mla is not None:
            assert mla.abs().max() > 0  # absorbed from the dummy kv_b_proj, not left empty
    finally:
        engine.shutdown()
