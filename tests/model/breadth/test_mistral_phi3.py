"""Mistral (a sliding window the prompts outgrow), Ministral 3 (YaRN, queries scaled past the
original length), Mistral Small 3.1's image-text checkpoint as its language model, Mixtral (routed MoE) and Phi-3/Phi-4 (fused
projections, partial rotary, LongRoPE) against transformers on tiny random weights: logits of
prefill, chunked prefill over a radix-cached prefix and batched decode; greedy generation through
the real engine."""

from __future__ import annotations

import pytest
import torch

from breadth_utils import IDS, save_tiny
from model_utils import assert_greedy_matches_generate, load_ours
from paged_runner import check_cached_prefix_chunked_decode

FAMILIES = {
    "mistral": ("MistralForCausalLM", "VariantAttention", "MLP"),
    "mistral3": ("Mistral3ForConditionalGeneration", "Attention", "MLP"),
    "ministral3-vl": ("Mistral3ForConditionalGeneration", "VariantAttention", "MLP"),
    "ministral3": ("Ministral3ForCausalLM", "VariantAttention", "MLP"),
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


def test_longrope_rows_past_the_original_length_use_the_long_factors():
    """Below ``original_max_position_embeddings`` a position rotates by transformers' short-factor
    frequencies, from there by its long-factor ones (those transformers uses once a sequence
    outgrows the original length), both scaled by the attention factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from llmkit.core.model.decoder.longrope import LongRopeEmbedding

    from breadth_utils import tiny_config

    cfg = tiny_config("phi3")
    original, rot = cfg.rope_parameters["original_max_position_embeddings"], 12
    ours = LongRopeEmbedding(rot, cfg.max_position_embeddings, cfg.to_dict())
    fn = ROPE_INIT_FUNCTIONS["longrope"]
    for rows, seq_len in ((slice(0, original), None), (slice(original, None), original + 1)):
        inv, scale = fn(cfg, None, seq_len=seq_len)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)[rows]
        freqs = torch.outer(pos, inv)
        torch.testing.assert_close(ours.cos2[rows, : rot // 2], freqs.cos() * scale)
        torch.testing.assert_close(ours.sin2[rows, rot // 2 :], freqs.sin() * scale)
    assert scale > 1.0  # (factor 4: the attention factor is not trivial)
