"""Qwen3-MoE against transformers on tiny random-weight models: logits of prefill, of chunked
prefill over a page-shared (radix-cached) prefix and of batched decode, at page sizes 1 and 16;
greedy generation through the real engine; the batched experts against a per-token reference."""

from __future__ import annotations

import pytest
import torch

from llmkit.core.engine.builder import build_model
from llmkit.core.model.loader.source import iter_safetensors, load_config
from llmkit.core.model.moe import FusedExperts, softmax_topk
from llmkit.core.plugins import registry

from model_utils import assert_greedy_matches_generate, copy_embedded_tokenizer, load_ours, save_tiny_model
from paged_runner import PagedRunner, check_cached_prefix_chunked_decode
from paged_runner import assert_close as _close

# A: layer 0 sparse, layer 1 dense, renormalised top-2; B: every 2nd layer sparse, raw softmax weights
VARIANTS = {
    "A": {},
    "B": dict(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False),
}
IDS = [(37 * i + 11) % 512 for i in range(52)]


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"qwen3-moe-{request.param}")
    ref = save_tiny_model("qwen3_moe", d, **VARIANTS[request.param])
    with torch.no_grad():
        full = ref(torch.tensor([IDS])).logits[0]
    return request.param, d, ref, full


def test_sparse_layers_follow_the_config(tiny):
    variant, d, _, _ = tiny
    model = load_ours(d)
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == (["SparseMoeBlock", "MLP"] if variant == "A" else ["MLP", "SparseMoeBlock"])


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_logits_match_transformers(tiny, page_size):
    _, d, _, full = tiny
    runner = PagedRunner(load_ours(d), page_size)
    (ours,) = runner.step([(runner.new_seq(), IDS)])
    _close(ours, full)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cached_prefix_chunked_prefill_and_decode_match_transformers(tiny, page_size):
    """Sequence 1 prefills 32 tokens. Sequence 2 reuses those 32 tokens' pages, prefills the next
    17 in chunks of 7 (each chunk batched with one of sequence 1's decode steps), then both decode
    together; every step's logits equal transformers' over the whole sequence."""
    _, d, ref, _ = tiny
    check_cached_prefix_chunked_decode(load_ours(d), ref, IDS, page_size)


def test_fused_experts_match_a_per_token_reference():
    """The grouped-by-expert execution against the obvious per-token loop, with biases, uneven
    expert loads (one expert unused) and a tensor-parallel-style split of the intermediate channels
    summed by hand."""
    torch.manual_seed(1)
    e, h, inter, t, k = 5, 16, 12, 23, 2
    gate_up = torch.randn(e, 2 * inter, h)
    down = torch.randn(e, h, inter)
    b13, b2 = torch.randn(e, 2 * inter), torch.randn(e, h)
    x = torch.randn(t, h)
    logits = torch.randn(t, e)
    logits[:, 3] = -1e9  # expert 3 never chosen
    w, ids = softmax_topk(logits, k, renormalize=True)
    ref = torch.zeros(t, h)
    for i in range(t):
        for j in range(k):
            ex = ids[i, j]
            g, u = (gate_up[ex] @ x[i] + b13[ex]).chunk(2)
            ref[i] += w[i, j] * (down[ex] @ (torch.nn.functional.silu(g) * u) + b2[ex])

    from llmkit.core.model.parallel import TPGroup

    class PartialSums(TPGroup):  # one "rank" of a group, its partial sum returned as is
        def all_reduce(self, x):
            return x

    def build(rank, size):
        tp = PartialSums(rank=rank, size=size)
        ex = FusedExperts(e, h, inter, bias=True, tp=tp)
        for i in range(e):
            ex.load(gate_up[i, :inter], i, 0)
            ex.load(gate_up[i, inter:], i, 1)
            ex.load(down[i], i, 2)
            ex.load(b13[i, :inter], i, 0)
            ex.load(b13[i, inter:], i, 1)
            ex.load(b2[i], i, 2)
        assert ex.missing() == []
        return ex

    with torch.no_grad():
        torch.testing.assert_close(build(0, 1)(x, w, ids), ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(build(0, 1)(x, w, ids, True), ref, atol=1e-4, rtol=1e-4)
        # two ranks each hold half of every expert's channels; the test sums what all-reduce would
        halves = [build(r, 2)(x, w, ids) for r in range(2)]
        torch.testing.assert_close(halves[0] + halves[1], ref, atol=1e-4, rtol=1e-4)


def test_missing_expert_weight_is_named(tmp_path):
    save_tiny_model("qwen3_moe", tmp_path)
    config = load_config(tmp_path)
    model = build_model(registry().model("Qwen3MoeForCausalLM"), config, torch.device("cpu"), torch.float32)
    weights = [(n, t) for n, t in iter_safetensors(tmp_path) if "experts.2.up_proj" not in n]
    with pytest.raises(KeyError, match=r"layers\.0\.mlp\.experts\.2\.up_proj\.weight"):
        model.load_weights(weights)


def test_greedy_32_tokens_equal_transformers_generate(tmp_path):
    """Through the real engine (page size 16, prefill chunks of 16, radix cache): two prompts
    sharing a 32-token prefix, the second run after the first so its prefix comes from the cache."""
    ref = save_tiny_model("qwen3_moe", tmp_path)
    copy_embedded_tokenizer(tmp_path)
    cached = assert_greedy_matches_generate(ref, tmp_path, [IDS[:40], IDS[:32] + [401, 7, 99, 250, 3]])
    assert cached == [0, 32]
