"""Nemotron-H: Mamba2 layers (their state the convolution's last inputs and an fp32 SSM matrix per
head) beside attention without rotary embeddings, ReLU² feed-forwards and a MoE of ReLU² experts,
through the same state pool and state-aware prefix cache as the other hybrids. The SSD kernels
against transformers' torch forms; the real engine's greedy output against transformers'
``generate`` (prompts batched, chunked, a conversation resumed from a snapshot); a GGUF written the
way llama.cpp's converter writes one, compared logit for logit; a layer pattern that disagrees with
the weights fails naming the layer."""

from __future__ import annotations

import threading

import pytest
import torch
from hybrid_utils import (
    check_batched,
    check_conversation,
    check_one_token_prompt,
    check_step_failing_midway,
    idle_states,
    prompt,
    run_prompts,
    served_engine,
)

from llmkit.core.model.hybrid import ssd

from model_utils import assert_same_as_generate, save_tiny_model


def _scan_inputs(T: int, R: int = 1, H: int = 6, P: int = 4, G: int = 3, N: int = 5):
    """Random scan inputs for ``R`` sequences of ``T`` tokens: ``dt`` already through softplus,
    ``A`` negative, three groups of B/C shared by two heads each."""
    g = torch.Generator().manual_seed(T * 7 + R)
    x = torch.randn(R, T, H, P, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(R, T, H, generator=g))
    A = -torch.rand(H, generator=g) * 2 - 0.1
    B, C = torch.randn(R, T, G, N, generator=g), torch.randn(R, T, G, N, generator=g)
    D = torch.randn(H, generator=g)
    state = torch.randn(R, H, P, N, generator=g)
    return x, dt, A, B, C, D, state


def test_chunked_scan_matches_transformers_from_a_state():
    """The chunked form from a nonzero state, its chunks of 4 not dividing 11 tokens, equals
    transformers' ``mamba2_chunk_scan`` (its chunks of 8), outputs and final state."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    x, dt, A, B, C, D, state = _scan_inputs(11)
    ref, ref_state = mamba2_chunk_scan(x, dt, A, B, C, 8, D=D, initial_states=state, return_final_states=True)
    y, s = ssd.chunked(x[0], dt[0], A, B[0], C[0], D, state[0], chunk=4)
    torch.testing.assert_close(y, ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, ref_state[0], atol=1e-4, rtol=1e-4)


def test_chunked_in_two_equals_one_pass_and_none_is_zeros():
    """A sequence scanned in two calls (the state carried) equals one pass; None starts from zeros."""
    x, dt, A, B, C, D, _ = _scan_inputs(23)
    whole, s_whole = ssd.chunked(x[0], dt[0], A, B[0], C[0], D, None, chunk=8)
    a, s = ssd.chunked(x[0, :9], dt[0, :9], A, B[0, :9], C[0, :9], D, torch.zeros(6, 4, 5), chunk=8)
    b, s = ssd.chunked(x[0, 9:], dt[0, 9:], A, B[0, 9:], C[0, 9:], D, s, chunk=8)
    torch.testing.assert_close(torch.cat([a, b]), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, s_whole, atol=1e-4, rtol=1e-4)


def test_recurrent_matches_transformers_and_continues_the_chunked_form():
    """The recurrent step of three rows equals transformers' ``mamba2_selective_state_update``; a
    prompt's chunked state followed by recurrent steps equals one chunked pass."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_selective_state_update

    x, dt, A, B, C, D, state = _scan_inputs(1, R=3)
    P, N = x.shape[-1], B.shape[-1]
    ref_state = state.clone()
    ref = mamba2_selective_state_update(
        ref_state,
        x[:, 0],
        dt[:, 0, :, None].expand(-1, -1, P),
        A[:, None, None].expand(-1, P, N),
        B[:, 0],
        C[:, 0],
        D[:, None].expand(-1, P),
    )
    y, s = ssd.recurrent(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, state)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, ref_state, atol=1e-5, rtol=1e-5)

    x, dt, A, B, C, D, _ = _scan_inputs(14)
    whole, s_whole = ssd.chunked(x[0], dt[0], A, B[0], C[0], D, None, chunk=4)
    rows, s = [], None
    _, s = ssd.chunked(x[0, :10], dt[0, :10], A, B[0, :10], C[0, :10], D, None, chunk=4)
    s = s[None]
    for t in range(10, 14):
        o, s = ssd.recurrent(x[:, t], dt[:, t], A, B[:, t], C[:, t], D, s)
        rows.append(o)
    torch.testing.assert_close(torch.cat(rows), whole[10:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s[0], s_whole, atol=1e-4, rtol=1e-4)


def test_native_decode_step_matches_torch_forms():
    """The C decode step (conv with bias and SiLU, the recurrent scan, states slot to slot) equals
    the torch forms on the same slots, fresh rows (no state yet) among them; 3 groups of B/C."""
    from llmkit.core.model.hybrid import causal_conv, mamba2_cpu

    if mamba2_cpu.lib() is None:
        pytest.skip("no native kernels here (no C compiler or AVX2)")
    torch.manual_seed(0)
    R, H, P, G, N, K = 5, 6, 8, 3, 16, 4
    C = H * P + 2 * G * N
    conv, ssm = torch.randn(2 * R, C, K - 1), torch.randn(2 * R, H, P, N)
    xbc, w, bias = torch.randn(R, C), torch.randn(C, K), torch.randn(C)
    dt, A, D = torch.rand(R, H), -torch.rand(H) - 0.1, torch.randn(H)
    read, write = torch.arange(R) * 2, torch.arange(R) * 2 + 1
    fresh = [False, True, False, False, True]
    keep = torch.tensor([not f for f in fresh])
    conv_out, conv_new = causal_conv.conv_step(xbc, w, torch.where(keep.view(-1, 1, 1), conv[read], 0.0), bias)
    x, B, Cm = conv_out.split([H * P, G * N, G * N], dim=1)
    shape = (R, G, N)
    state = torch.where(keep.view(-1, 1, 1, 1), ssm[read], 0.0)
    y, ssm_new = ssd.recurrent(x.reshape(R, H, P), dt, A, B.reshape(shape), Cm.reshape(shape), D, state)
    flags = torch.tensor(fresh, dtype=torch.uint8)
    ours_conv = mamba2_cpu.conv_step(xbc, w, bias, conv, read, write, flags)
    ours = mamba2_cpu.ssd_step(ours_conv, dt, A, D, ssm, read, write, flags, H, P, N, G)
    torch.testing.assert_close(ours_conv, conv_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv[write], conv_new)
    torch.testing.assert_close(ours, y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ssm[write], ssm_new, atol=1e-5, rtol=1e-5)


# --- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """transformers' model and an engine on its checkpoint (hybrid_utils.served_engine)."""
    ref, engine = served_engine("nemotron_h", tmp_path_factory.mktemp("nemotron_h"))
    yield ref, engine
    engine.shutdown()


def test_greedy_matches_generate_batched(served):
    check_batched(*served)


def test_conversation_resumes_from_snapshot(served):
    check_conversation(*served)


def test_one_token_prompt_starts_from_zeros_on_a_used_row(served):
    check_one_token_prompt(*served)


def test_aborts_give_every_slot_back(served):
    """Requests aborted mid-prompt and mid-decode beside one that finishes: no state slot stays
    with a request, and a flush empties the snapshots."""
    ref, engine = served
    prompts = [prompt(9, 50), prompt(10, 20), prompt(11, 33)]
    results = run_prompts(engine, prompts, 20, abort_after={0: 0, 1: 3})
    assert len(results[1][0]) < 20 and len(results[2][0]) == 20
    assert_same_as_generate(ref, prompts[2], results[2][0], "the survivor")
    idle_states(engine)
    flushed = threading.Event()
    engine.flush_cache(lambda ok: ok and flushed.set())
    assert flushed.wait(60)
    assert engine.call(engine.stats).result(timeout=60)["state_snapshots_in_use"] == 0


def test_a_step_failing_midway_leaves_states_as_they_were(served):
    """A step that raises in the last attention layer, after both Mamba2 layers wrote their states."""
    ref, engine = served
    check_step_failing_midway(ref, engine, engine.runner.model.layers[5].mixer)


# --- loading --------------------------------------------------------------------------------


def test_layer_pattern_disagreeing_with_weights_names_the_layer(tmp_path):
    """A config whose layer 1 says Mamba2 over a checkpoint whose layer 1 is attention."""
    from llmkit.core.engine.builder import build_model
    from llmkit.core.model.loader.source import iter_safetensors
    from llmkit.plugins.models.mamba2.nemotron_h import NemotronHForCausalLM

    save_tiny_model("nemotron_h", tmp_path)
    config = {"hybrid_override_pattern": "MMM-E*", **_config_dict(tmp_path)}
    config.pop("layers_block_type")
    model = build_model(NemotronHForCausalLM, config, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="layer 1 is 'mamba'.*'attention' weight"):
        model.load_weights(iter_safetensors(tmp_path))


def _config_dict(path) -> dict:
    from llmkit.core.model.loader.source import load_config

    return load_config(path)


# --- GGUF -----------------------------------------------------------------------------------

_GGUF_NAMES = {
    "norm": "attn_norm",
    "mixer.in_proj": "ssm_in",
    "mixer.out_proj": "ssm_out",
    "mixer.q_proj": "attn_q",
    "mixer.k_proj": "attn_k",
    "mixer.v_proj": "attn_v",
    "mixer.o_proj": "attn_output",
    "mixer.up_proj": "ffn_up",
    "mixer.down_proj": "ffn_down",
}


def _write_gguf(ref, path) -> None:
    """As llama.cpp's converter: KV heads and feed-forward widths per layer (0 where a layer has
    none: a layer with neither is Mamba2), the Mamba2 sizes as ssm.* keys, the conv weight squeezed
    to ``[C, K]``, ``A`` as ``-exp(A_log)`` and ``D`` as ``[heads, 1]``, the grouped norm's weight
    as ``[groups, channels / groups]``, ``dt_bias`` as ``ssm_dt.bias``. With MoE layers the
    architecture is ``nemotron_h_moe``: their width is the experts', the experts stacked."""
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    cfg = ref.config
    types = cfg.layers_block_type
    moe = "moe" in types
    w = gguf.GGUFWriter(str(path), "nemotron_h_moe" if moe else "nemotron_h")
    w.add_block_count(len(types))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    widths = {"mlp": cfg.intermediate_size, "moe": cfg.moe_intermediate_size}
    w.add_feed_forward_length([widths.get(t, 0) for t in types])
    if moe:
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.moe_shared_expert_intermediate_size)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_group_count(cfg.n_group)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if t == "full_attention" else 0 for t in types])
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_inner_size(cfg.mamba_num_heads * cfg.mamba_head_dim)
    w.add_ssm_state_size(cfg.ssm_state_size)
    w.add_ssm_time_step_rank(cfg.mamba_num_heads)
    w.add_ssm_group_count(cfg.n_groups)
    w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
    w.add_vocab_size(cfg.vocab_size)
    sd = {k: v.detach().float().numpy() for k, v in ref.state_dict().items()}

    def add(name, t):
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))

    add("token_embd.weight", sd["model.embeddings.weight"])
    add("output_norm.weight", sd["model.norm_f.weight"])
    add("output.weight", sd["lm_head.weight"])
    for i in range(len(types)):
        p = f"model.layers.{i}."
        for hf, g in _GGUF_NAMES.items():
            if p + hf + ".weight" in sd:
                add(f"blk.{i}.{g}.weight", sd[p + hf + ".weight"])
        m = p + "mixer."
        if types[i] == "moe":
            add(f"blk.{i}.ffn_gate_inp.weight", sd[m + "gate.weight"])
            add(f"blk.{i}.exp_probs_b.bias", sd[m + "gate.e_score_correction_bias"])
            add(f"blk.{i}.ffn_up_exps.weight", sd[m + "experts.up_proj"])
            add(f"blk.{i}.ffn_down_exps.weight", sd[m + "experts.down_proj"])
            add(f"blk.{i}.ffn_up_shexp.weight", sd[m + "shared_experts.up_proj.weight"])
            add(f"blk.{i}.ffn_down_shexp.weight", sd[m + "shared_experts.down_proj.weight"])
        if types[i] != "linear_attention":
            continue
        add(f"blk.{i}.ssm_conv1d.weight", sd[m + "conv1d.weight"].squeeze(1))
        add(f"blk.{i}.ssm_conv1d.bias", sd[m + "conv1d.bias"])
        add(f"blk.{i}.ssm_dt.bias", sd[m + "dt_bias"])
        add(f"blk.{i}.ssm_a", (-np.exp(sd[m + "A_log"])).reshape(-1, 1))
        add(f"blk.{i}.ssm_d", sd[m + "D"].reshape(-1, 1))
        add(f"blk.{i}.ssm_norm.weight", sd[m + "norm.weight"].reshape(cfg.n_groups, -1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_DENSE = ["linear_attention", "full_attention", "linear_attention", "mlp", "full_attention"]
_MOE = ["linear_attention", "full_attention", "linear_attention", "moe", "full_attention"]


@pytest.mark.parametrize("types", [_DENSE, _MOE], ids=["nemotron_h", "nemotron_h_moe"])
def test_gguf_matches_transformers(tmp_path, types):
    """The GGUF's config names the same layer pattern and Mamba2 sizes; its prefill (in two chunks,
    the SSD chunks of 8 inside them) and decode logits equal transformers' on the same weights.
    (The MoE routes over one group: the converter keeps the group count, not the groups chosen.)"""
    gguf = pytest.importorskip("gguf")
    from llmkit.core.engine.builder import build_model
    from llmkit.core.model import quantize
    from llmkit.core.model.loader.gguf_loader import gguf_config, gguf_tensors
    from llmkit.core.plugins import registry

    from paged_runner import PagedRunner

    ref = save_tiny_model("nemotron_h", tmp_path / "hf", layers_block_type=types, n_group=1, topk_group=1)
    _write_gguf(ref, tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = gguf_config(reader)
    assert config["hybrid_override_pattern"] == ref.config.hybrid_override_pattern
    assert (config["n_groups"], config["mamba_head_dim"]) == (ref.config.n_groups, ref.config.mamba_head_dim)
    model_cls = registry().model(registry().architecture_for_model_type(config["model_type"]))
    config["chunk_size"] = ref.config.chunk_size  # (not in the GGUF: the result does not depend on it)
    model = build_model(model_cls, config, torch.device("cpu"), torch.float32)
    model.load_weights(gguf_tensors(reader, config))
    quantize.finalize_weights(model)
    ids = prompt(7, 30)
    runner = PagedRunner(model, 4)
    row = runner.new_seq()
    (head,) = runner.step([(row, ids[:13])])
    (tail,) = runner.step([(row, ids[13:])])
    (decode,) = runner.step([(row, [7])])
    with torch.no_grad():
        logits = ref(torch.tensor([ids + [7]])).logits[0]
    torch.testing.assert_close(torch.cat([head, tail]), logits[:-1], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(decode[0], logits[-1], atol=2e-4, rtol=2e-4)
