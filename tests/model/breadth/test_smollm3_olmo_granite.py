"""SmolLM3 (a NoPE layer), OLMo 2 and OLMo 3 (post-norms, whole-projection Q/K norms; OLMo 3's
sliding layers with their own rope) and Granite (its four multipliers) against transformers on
tiny random weights: logits of prefill, chunked prefill over a radix-cached prefix and batched
decode; greedy generation through the real engine."""

from __future__ import annotations

import pytest

from breadth_utils import IDS, save_tiny
from model_utils import assert_greedy_matches_generate, load_ours
from paged_runner import check_cached_prefix_chunked_decode

FAMILIES = {
    "smollm3": ("SmolLM3ForCausalLM", ["Attention", "Attention", "Attention", "VariantAttention"]),
    "olmo2": ("Olmo2ForCausalLM", ["VariantAttention"] * 2),
    "olmo3": ("Olmo3ForCausalLM", ["VariantAttention"] * 3),
    "granite": ("GraniteForCausalLM", ["Attention"] * 2),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, save_tiny(request.param, d)


def test_logits_match_transformers(tiny):
    arch, d, ref = tiny
    model = load_ours(d)
    cls, attns = FAMILIES[arch]
    assert type(model).__name__ == cls
    assert [type(layer.self_attn).__name__ for layer in model.layers] == attns
    check_cached_prefix_chunked_decode(model, ref, IDS, page_size=4)


def test_greedy_generate_matches_transformers(tiny):
    _, d, ref = tiny
    cached = assert_greedy_matches_generate(ref, d, [IDS[:40], IDS[:40] + [7, 8, 9]], n=12)
    assert cached[1] >= 32


def test_layer_kinds_follow_the_config(tmp_path):
    """SmolLM3's fourth layer is unrotated; OLMo 3's sliding layers get the window, the full one none."""
    save_tiny("olmo3", tmp_path)
    model = load_ours(tmp_path)
    assert [layer.self_attn.sliding_window for layer in model.layers] == [16, None, 16]
