"""Qwen3.5, the first hybrid model: its Gated DeltaNet kernels against transformers' references,
and the real engine's greedy output against transformers' ``generate`` with the state pool and the
state-aware prefix cache in play: prompt chunks carrying state, a conversation's later turns
resuming from snapshots, a prompt branching mid-prefill, requests batched together, aborts; every
state slot is given back."""

from __future__ import annotations

import threading

import pytest
import torch
from hybrid_utils import check_step_failing_midway, idle_states, prompt, run_prompts, served_engine

from llmkit.core.model.hybrid import causal_conv, gated_delta_rule

from model_utils import assert_same_as_generate, copy_embedded_tokenizer, save_tiny_model, start_engine

# --- kernels ------------------------------------------------------------------------------------


def test_gated_delta_rule_forms_match_transformers():
    """The chunked form (150 tokens: two full chunks and a partial one, from a state) and the
    recurrent form token by token both equal transformers' chunked reference, outputs and final
    state; 2 key heads serve 4 value heads."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    torch.manual_seed(0)
    T, Hk, Hv, D = 150, 2, 4, 16
    q, k, v = torch.randn(T, Hk, D), torch.randn(T, Hk, D), torch.randn(T, Hv, D)
    g, beta, s0 = -torch.rand(T, Hv), torch.rand(T, Hv), 0.1 * torch.randn(Hv, D, D)
    ref, ref_state = torch_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        initial_state=s0[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out, state = gated_delta_rule.chunked(q, k, v, g, beta, s0)
    torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state[0], atol=1e-5, rtol=1e-5)
    state, outs = s0[None], []
    for t in range(T):
        o, state = gated_delta_rule.recurrent(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state
        )
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[0], ref_state[0], atol=1e-5, rtol=1e-5)


def test_causal_conv_prefill_then_steps_match_one_pass():
    """A prompt's convolution in two chunks and then token by token, carrying the state, equals
    one pass over the whole sequence (transformers' causal_conv1d_fn)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    torch.manual_seed(0)
    T, C, K = 23, 12, 4
    x, w = torch.randn(T, C), torch.randn(C, K)
    ref = causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    a, state = causal_conv.conv_prefill(x[:9], w, None)
    b, state = causal_conv.conv_prefill(x[9:20], w, state)
    rows, state = [a, b], state[None]
    for t in range(20, T):
        o, state = causal_conv.conv_step(x[t : t + 1], w, state)
        rows.append(o)
    torch.testing.assert_close(torch.cat(rows), ref, atol=1e-6, rtol=1e-6)


def test_native_decode_step_matches_torch_forms():
    """The C decode step (conv and recurrent rule, states slot to slot) equals the torch forms on
    the same slots, fresh rows (no state yet) among them; 2 key heads serve 4 value heads."""
    from llmkit.core.model.hybrid import gated_delta_cpu

    if gated_delta_cpu.lib() is None:
        pytest.skip("no native kernels here (no C compiler or AVX2)")
    torch.manual_seed(0)
    B, Hk, Hv, D, K = 5, 2, 4, 32, 4
    C = 2 * Hk * D + Hv * D
    conv, rec = torch.randn(2 * B, C, K - 1), 0.1 * torch.randn(2 * B, Hv, D, D)
    mixed, w = torch.randn(B, C), torch.randn(C, K)
    g, beta = -torch.rand(B, Hv), torch.rand(B, Hv)
    read, write = torch.arange(B) * 2, torch.arange(B) * 2 + 1
    fresh = [False, True, False, False, True]
    keep = torch.tensor([not f for f in fresh], dtype=torch.float32)
    conv_out, conv_new = causal_conv.conv_step(mixed, w, conv[read] * keep.view(-1, 1, 1))
    q, k, v = conv_out.split([Hk * D, Hk * D, Hv * D], dim=1)
    out, rec_new = gated_delta_rule.recurrent(
        q.reshape(B, Hk, D), k.reshape(B, Hk, D), v.reshape(B, Hv, D), g, beta, rec[read] * keep.view(-1, 1, 1, 1)
    )
    flags = torch.tensor(fresh, dtype=torch.uint8)
    ours_conv = gated_delta_cpu.conv_step(mixed, w, conv, read, write, flags)
    ours = gated_delta_cpu.gated_delta_step(ours_conv, Hk * D, g, beta, rec, read, write, flags, Hk, Hv, D, D)
    torch.testing.assert_close(ours_conv, conv_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv[write], conv_new)
    torch.testing.assert_close(ours, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rec[write], rec_new, atol=1e-5, rtol=1e-5)


def test_unserved_architecture_and_mismatched_layer_table_are_named():
    """An architecture llmkit does not serve names itself and the nearest supported one; a
    checkpoint whose weights do not fit its layer table fails at load, naming the layer."""
    from llmkit.core.plugins import PluginError, registry

    with pytest.raises(PluginError, match=r"'Qwen3_6ForCausalLM' is not served.*nearest supported: Qwen3_5ForCausalLM"):
        registry().model("Qwen3_6ForCausalLM")
    with pytest.raises(PluginError, match=r"'FalconH1ForCausalLM' is not served by llmkit; `llmkit plugins`"):
        registry().model("FalconH1ForCausalLM")


def test_layer_table_that_disagrees_with_the_weights_names_the_layer(tmp_path):
    import json

    from model_utils import load_ours

    save_tiny_model("qwen3_5", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["layer_types"][1] = "full_attention"  # its weights are a DeltaNet's
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(KeyError, match=r"layers\.1\."):
        load_ours(tmp_path)


# --- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """transformers' model and an engine on its checkpoint (hybrid_utils.served_engine)."""
    ref, engine = served_engine("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))
    yield ref, engine
    engine.shutdown()


def test_greedy_matches_generate_batched(served):
    """Four prompts of different lengths at once (prompt chunks beside decode rows in one step):
    each one's output equals transformers' alone."""
    ref, engine = served
    prompts = [prompt(1, 5), prompt(2, 37), prompt(3, 1), prompt(4, 70)]
    for ids, (ours, _) in zip(prompts, run_prompts(engine, prompts, 12)):
        assert_same_as_generate(ref, ids, ours, f"{len(ids)}-token prompt")
    idle_states(engine)


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_moe_families_greedy_matches_generate(tmp_path, arch):
    """Qwen3.5-MoE and Qwen3-Next (DeltaNet projections fused per key head, regrouped at load):
    routed experts with a gated shared expert on every layer; a prompt, then the same prompt
    resumed from its snapshot, equal ``generate``."""
    from model_utils import assert_greedy_matches_generate

    ref = save_tiny_model(arch, tmp_path)
    copy_embedded_tokenizer(tmp_path)
    ids = prompt(12, 40)
    assert assert_greedy_matches_generate(ref, tmp_path, [ids, ids], n=10) == [0, 32]


def test_conversation_resumes_from_snapshots(served):
    """Turn 2 sends turn 1's prompt, its answer and a new message: it resumes from the state
    snapshotted when turn 1 left (all of turn 1 but its last token), and equals ``generate``."""
    ref, engine = served
    turn1 = prompt(5, 29)
    ((out1, _),) = run_prompts(engine, [turn1], 10)
    assert_same_as_generate(ref, turn1, out1, "turn 1")
    turn2 = turn1 + out1 + prompt(6, 9)
    ((out2, cached),) = run_prompts(engine, [turn2], 10)
    assert cached == (len(turn1) + len(out1) - 1) // 4 * 4  # (page-aligned; the last token never computed)
    assert cached > len(turn1) - 4
    assert_same_as_generate(ref, turn2, out2, "turn 2")


def test_branch_mid_prefill_resumes_from_a_checkpoint(served):
    """A prompt sharing the first 40 tokens of an earlier one resumes from the checkpoint at 32
    (every 16 tokens) and equals ``generate``; the same prompt again resumes from its own end."""
    ref, engine = served
    base = prompt(7, 60)
    run_prompts(engine, [base], 4)
    branch = base[:40] + prompt(8, 20)
    ((out, cached),) = run_prompts(engine, [branch], 8)
    assert cached == 32
    assert_same_as_generate(ref, branch, out, "branch")
    ((again, cached),) = run_prompts(engine, [branch], 8)
    assert again == out and cached == (len(branch) - 1) // 4 * 4


def test_aborts_give_every_slot_back(served):
    """Requests aborted mid-prompt and mid-decode beside one that finishes: no state slot stays
    with a request, and a flush empties the snapshots."""
    ref, engine = served
    prompts = [prompt(9, 50), prompt(10, 20), prompt(11, 33)]
    results = run_prompts(engine, prompts, 20, abort_after={0: 0, 1: 3})
    assert len(results[1][0]) < 20 and len(results[2][0]) == 20
    assert_same_as_generate(ref, prompts[2], results[2][0], "the survivor")
    stats = idle_states(engine)
    assert stats["state_snapshots_in_use"] == stats["state_snapshots_cached"] > 0
    flushed = threading.Event()
    engine.flush_cache(lambda ok: ok and flushed.set())
    assert flushed.wait(60)
    assert idle_states(engine)["state_snapshots_in_use"] == 0


def test_preempted_requests_resume_from_their_snapshots(tmp_path):
    """A pool too small for four requests at once: the scheduler preempts some (their K/V and a
    snapshot of their state go to the prefix cache) and resumes them later from it; every output
    equals ``generate`` and no state slot stays with a request."""
    ref = save_tiny_model("qwen3_5", tmp_path)
    copy_embedded_tokenizer(tmp_path)
    engine = start_engine(
        model_path=str(tmp_path),
        device="cpu",
        page_size=4,
        chunked_prefill_size=64,
        max_total_tokens=160,
        max_running_requests=4,
    )
    try:
        prompts = [prompt(30 + i, 30 + 3 * i) for i in range(4)]
        for ids, (ours, _) in zip(prompts, run_prompts(engine, prompts, 14)):
            assert_same_as_generate(ref, ids, ours, f"{len(ids)}-token prompt")
        stats = idle_states(engine)
        assert stats["preemptions"] > 0
    finally:
        engine.shutdown()


def test_speculation_leaves_outputs_unchanged(tmp_path):
    """Speculative decoding on a hybrid model: a verify step runs the draft tokens through the state
    layers too; where some are rejected the request keeps the state from before the step (the other
    working slot) and computes the kept tokens again with its next step. The drafts here are
    ``generate``'s own tokens, every other one with its third token wrong (so both full and partial
    acceptance happen on each request); outputs equal ``generate``, and a later turn still resumes
    from a snapshot."""
    import torch

    ref = save_tiny_model("qwen3_5", tmp_path)
    copy_embedded_tokenizer(tmp_path)
    engine = start_engine(
        model_path=str(tmp_path),
        device="cpu",
        page_size=1,
        chunked_prefill_size=64,
        max_total_tokens=2048,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=4,
        state_snapshot_interval=16,
    )
    prompts = [prompt(40, 9), prompt(41, 25), prompt(42, 3)]
    n = 24
    expected = {}
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            gen = ref.generate(torch.tensor([ids]), max_new_tokens=n + 4, min_new_tokens=n + 4, do_sample=False)
            expected[f"r{i}"] = gen[0, len(ids) :].tolist()
    calls = {"n": 0}

    def propose(req, max_tokens):
        calls["n"] += 1
        draft = expected[req.rid][len(req.output_ids) : len(req.output_ids) + max_tokens]
        if calls["n"] % 2 and len(draft) > 2:
            draft = [*draft[:2], (draft[2] + 1) % 512, *draft[3:]]
        return draft

    engine.scheduler.speculator.proposer.propose = propose
    try:
        outs = run_prompts(engine, prompts, n)
        for i, (ids, (ours, _)) in enumerate(zip(prompts, outs)):
            assert ours == expected[f"r{i}"][:n], f"request {i}"
        stats = idle_states(engine)
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        turn2 = prompts[1] + outs[1][0] + prompt(43, 5)
        calls["n"] = -(10**6)  # (the proposer: no drafts for this one)
        engine.scheduler.speculator.proposer.propose = lambda req, k: []
        ((again, cached),) = run_prompts(engine, [turn2], 8)
        assert cached == len(turn2) - 6 and again
        assert_same_as_generate(ref, turn2, again, "the next turn")
    finally:
        engine.shutdown()


def test_a_step_failing_midway_leaves_states_as_they_were(served):
    """A step that raises in the attention layer after three DeltaNet layers wrote their states."""
    ref, engine = served
    check_step_failing_midway(ref, engine, engine.runner.model.layers[3].mixer)


# --- the server -----------------------------------------------------------------------------


def test_served_stream_equals_non_stream_and_reports_reuse(tmp_path):
    """Through the real server and the openai client: a completion streamed equals it whole, the
    follow-up turn reports its reused prompt tokens, and /get_server_info and /metrics count the
    state slots (none running once idle)."""
    import httpx
    import openai

    from model_utils import tiny_model_dir
    from server_utils import start_server, stop_server

    proc, url = start_server(["--model-path", str(tiny_model_dir(tmp_path, "qwen3_5")), "--max-running-requests", "4"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        prompt = "The hybrid model reads this prompt once. " * 2
        whole = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
        streamed = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
        follow = client.completions.create(
            model="m", prompt=prompt + whole.choices[0].text + " and then more", max_tokens=4, temperature=0
        )
        # (the tiny tokenizer spells generated ids differently when they come back as text, so the
        # turn resumes from the checkpoint before the first prompt's last token)
        reused = follow.usage.prompt_tokens_details.cached_tokens
        assert whole.usage.prompt_tokens - 1 == reused
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        stats = info.get("internal_states", [info])[0] if "internal_states" in info else info
        text = repr(info)
        assert "state_snapshots_cached" in text and "'state_slots_running': 0" in text, stats
        metrics = httpx.get(url + "/metrics", timeout=30).text
        for name in ("state_slots_running", "state_snapshots_cached", "state_snapshots_in_use"):
            assert f"llmkit:{name}" in metrics, name
    finally:
        stop_server(proc)
