"""Llama 4's text model against transformers on tiny random weights: interleaved rope with the
weightless Q/K norm, a NoPE layer with the position temperature, top-1 MoE layers (the router score
scaling the token before its expert) with a shared expert beside dense ones; logits of prefill,
chunked prefill over a cached prefix and batched decode; greedy generation through the engine; and
the context cut to one attention chunk, which the backends do not mask by yet."""

from __future__ import annotations

import pytest
import torch

from breadth_utils import IDS, save_tiny
from model_utils import assert_greedy_matches_generate, load_ours, start_engine
from paged_runner import check_cached_prefix_chunked_decode


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama4")
    return d, save_tiny("llama4", d)


def test_layers_follow_the_config(tiny):
    model = load_ours(tiny[0])
    assert type(model).__name__ == "Llama4ForCausalLM"
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["MLP", "Llama4MoE", "MLP", "Llama4MoE"]
    assert [layer.self_attn.use_rope for layer in model.layers] == [True, True, True, False]
    assert model.layers[3].self_attn.temperature == (8.0, 0.1) and model.layers[0].self_attn.norm_eps


def test_logits_match_transformers(tiny):
    d, ref = tiny
    check_cached_prefix_chunked_decode(load_ours(d), ref, IDS, page_size=4)


def test_greedy_generate_matches_transformers(tiny):
    d, ref = tiny
    cached = assert_greedy_matches_generate(ref, d, [IDS[:40], IDS[:40] + [7, 8, 9]], n=12)
    assert cached[1] >= 32


def test_the_context_is_cut_to_one_attention_chunk(tmp_path):
    save_tiny("llama4", tmp_path, attention_chunk_size=64)
    engine = start_engine(model_path=str(tmp_path), device="cpu")
    try:
        assert engine.max_context <= 64
    finally:
        engine.shutdown()


def test_the_image_text_checkpoint_serves_its_language_model(tmp_path):
    """``Llama4ForConditionalGeneration``: the text model's logits, the vision tower skipped."""
    import transformers

    from breadth_utils import tiny_config
    from model_utils import copy_embedded_tokenizer

    text = tiny_config("llama4").to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    vision.update(image_size=32, patch_size=8, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    cfg = transformers.Llama4Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = transformers.Llama4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    ref.save_pretrained(str(tmp_path))
    copy_embedded_tokenizer(tmp_path)
    model = load_ours(tmp_path)
    assert type(model).__name__ == "Llama4ForCausalLM"
    check_cached_prefix_chunked_decode(model, ref, IDS, page_size=4)
