"""Granite 4.0-H: the Mamba2 state layer of Nemotron-H under Granite's block (two norms, a mixer
then a routed SwiGLU MoE beside a shared expert, each branch scaled by ``residual_multiplier``),
its embedding, attention and logit multipliers, rotary or unrotated attention. The real engine's
greedy output against transformers' ``generate`` (prompts batched, chunked, a conversation resumed
from a snapshot); the dense, unrotated variant logit for logit; a layer table that disagrees with
the weights fails naming the layer."""

from __future__ import annotations

import threading

import pytest
import torch

from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from model_utils import assert_same_as_generate, copy_embedded_tokenizer, load_ours, save_tiny_model, start_engine


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 509 + 1 for i in range(n)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """transformers' model and an engine on its checkpoint: pages of 4 tokens, prompt chunks of
    16 (two SSD chunks of 8 each), a state snapshot every 16 prompt tokens."""
    path = tmp_path_factory.mktemp("granite_hybrid")
    ref = save_tiny_model("granitemoehybrid", path)
    copy_embedded_tokenizer(path)
    engine = start_engine(
        model_path=str(path),
        device="cpu",
        page_size=4,
        chunked_prefill_size=16,
        max_total_tokens=2048,
        state_snapshot_interval=16,
        max_running_requests=8,
    )
    yield ref, engine
    engine.shutdown()


def _run(engine, prompts: list[list[int]], n: int) -> list[tuple[list[int], int]]:
    """Submit every prompt at once; each one's greedy tokens and cached prompt tokens."""
    results, done = [None] * len(prompts), [threading.Event() for _ in prompts]

    def sink_for(i):
        out = []

        def sink(o):
            out.extend(o.token_ids)
            if o.finished:
                results[i] = (list(out), o.cached_tokens)
                done[i].set()

        return sink

    for i, ids in enumerate(prompts):
        params = SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=0)
        engine.submit(GenerateRequest(f"granite-h-{i}", ids, params), sink_for(i))
    for ev in done:
        assert ev.wait(300)
    return results


def _assert_idle(engine) -> None:
    stats = engine.call(engine.stats).result(timeout=60)
    assert stats["state_slots_running"] == 0 and stats["num_running_reqs"] == 0


def test_greedy_matches_generate_batched(served):
    """Four prompts of different lengths at once (a one-token prompt and 16-token chunks beside
    decode rows in one step): each one's output equals transformers' alone; no state slot stays
    taken."""
    ref, engine = served
    prompts = [_prompt(1, 5), _prompt(2, 37), _prompt(3, 1), _prompt(4, 50)]
    for ids, (ours, _) in zip(prompts, _run(engine, prompts, 10)):
        assert_same_as_generate(ref, ids, ours, f"{len(ids)}-token prompt")
    _assert_idle(engine)


def test_conversation_resumes_from_snapshot(served):
    """Turn 2 resumes from the states snapshotted when turn 1 left, and equals ``generate``."""
    ref, engine = served
    turn1 = _prompt(5, 29)
    ((out1, _),) = _run(engine, [turn1], 8)
    assert_same_as_generate(ref, turn1, out1, "turn 1")
    turn2 = turn1 + out1 + _prompt(6, 9)
    ((out2, cached),) = _run(engine, [turn2], 8)
    assert cached == (len(turn1) + len(out1) - 1) // 4 * 4 > 0  # (page-aligned; the last token never computed)
    assert_same_as_generate(ref, turn2, out2, "turn 2")
    _assert_idle(engine)


def test_dense_unrotated_variant_matches_transformers(tmp_path):
    """``num_local_experts: 0`` (the shared expert alone) and ``position_embedding_type: nope``:
    prefill in two chunks and a decode step equal transformers' logits."""
    from paged_runner import PagedRunner

    ref = save_tiny_model("granitemoehybrid", tmp_path, position_embedding_type="nope", num_local_experts=0)
    model = load_ours(tmp_path)
    ids = _prompt(7, 30)
    runner = PagedRunner(model, 4)
    row = runner.new_seq()
    (head,) = runner.step([(row, ids[:13])])
    (tail,) = runner.step([(row, ids[13:])])
    (decode,) = runner.step([(row, [7])])
    with torch.no_grad():
        logits = ref(torch.tensor([ids + [7]])).logits[0]
    torch.testing.assert_close(torch.cat([head, tail]), logits[:-1], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(decode[0], logits[-1], atol=2e-4, rtol=2e-4)


def test_layer_table_disagreeing_with_weights_names_the_layer(tmp_path):
    """A config whose layer 1 says Mamba2 over a checkpoint whose layer 1 is attention."""
    from llmkit.core.engine.builder import build_model
    from llmkit.core.model.loader.source import iter_safetensors, load_config
    from llmkit.plugins.models.mamba2.granite_hybrid import GraniteMoeHybridForCausalLM

    save_tiny_model("granitemoehybrid", tmp_path)
    config = {**load_config(tmp_path), "layer_types": ["mamba"] * 4}
    model = build_model(GraniteMoeHybridForCausalLM, config, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="layer 1 is 'mamba'.*'attention' weight"):
        model.load_weights(iter_safetensors(tmp_path))
