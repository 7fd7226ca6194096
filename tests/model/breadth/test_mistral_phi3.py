"""Mistral (a sliding window the prompts outgrow), Mixtral (routed MoE) and Phi-3/Phi-4 (fused
projections, partial rotary, LongRoPE) against transformers on tiny random weights: logits of
prefill, chunked prefill over a radix-cached prefix and batched decode; greedy generation through
the real engine."""

from __future__ import annotations

import pytest

from breadth_utils import IDS, save_tiny
from model_utils import assert_greedy_matches_generate, load_ours
from paged_runner import check_cached_prefix_chunked_decode

FAMILIES = {
    "mistral": ("MistralForCausalLM", "VariantAttention", "MLP"),
    "mixtral": ("MixtralForCausalLM", "Attention", "RoutedMoE"),
    "phi3": ("Phi3ForCausalLM", "VariantAttention", "MLP"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, save_tiny(request.param, d)


def test_logits_match_transformers(tiny):
    arch, d, ref = tiny
    model = load_ours(d)
    cls, attn, mlp = FAMILIES[arch]
    assert type(model).__name__ == cls
    assert {(type(layer.self_attn).__name__, type(layer.mlp).__name__) for layer in model.layers} == {(attn, mlp)}
    check_cached_prefix_chunked_decode(model, ref, IDS, page_size=4)


def test_greedy_generate_matches_transformers(tiny):
    _, d, ref = tiny
    cached = assert_greedy_matches_generate(ref, d, [IDS[:40], IDS[:40] + [7, 8, 9]], n=12)
    assert cached[1] >= 32  # the second prompt reused the first one's pages
