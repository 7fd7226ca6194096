"""Granite 4.0-H: the Mamba2 state layer of Nemotron-H under Granite's block (two norms, a mixer
then a routed SwiGLU MoE beside a shared expert, each branch scaled by ``residual_multiplier``),
its embedding, attention and logit multipliers, rotary or unrotated attention. The real engine's
greedy output against transformers' ``generate`` (prompts batched, chunked, a conversation resumed
from a snapshot); the dense, unrotated variant logit for logit; a layer table that disagrees with
the weights fails naming the layer."""

from __future__ import annotations

import pytest
import torch
from hybrid_utils import check_batched, check_conversation, prompt, served_engine

from model_utils import load_ours, save_tiny_model


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """transformers' model and an engine on its checkpoint (hybrid_utils.served_engine)."""
    ref, engine = served_engine("granitemoehybrid", tmp_path_factory.mktemp("granitemoehybrid"))
    yield ref, engine
    engine.shutdown()


def test_greedy_matches_generate_batched(served):
    check_batched(*served)


def test_conversation_resumes_from_snapshot(served):
    check_conversation(*served)


def test_dense_unrotated_variant_matches_transformers(tmp_path):
    """``num_local_experts: 0`` (the shared expert alone) and ``position_embedding_type: nope``:
    prefill in two chunks and a decode step equal transformers' logits."""
    from paged_runner import PagedRunner

    ref = save_tiny_model("granitemoehybrid", tmp_path, position_embedding_type="nope", num_local_experts=0)
    model = load_ours(tmp_path)
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


# --- GGUF -----------------------------------------------------------------------------------


def _permute(w, heads: int):
    """llama.cpp's Q/K row order (its converter's permute: halves to interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(ref, path) -> None:
    """As llama.cpp's converter writes a Granite 4.0-H: ``granitehybrid``, KV heads per layer (0
    for Mamba2), rope off (``rope.scaling.finetuned`` false), the four multipliers as scale keys,
    Q/K rows permuted, the Mamba2 tensors as for Nemotron-H, the stacked gate/up experts split, the
    shared expert's ``input_linear`` split into gate and up (``ffn_*_shexp``, or ``ffn_*`` without
    experts)."""
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    cfg = ref.config
    types, experts = cfg.layer_types, cfg.num_local_experts
    w = gguf.GGUFWriter(str(path), "granitehybrid")
    w.add_block_count(len(types))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size if experts else cfg.shared_intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if t == "full_attention" else 0 for t in types])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_attention_scale(cfg.attention_multiplier)
    w.add_embedding_scale(cfg.embedding_multiplier)
    w.add_residual_scale(cfg.residual_multiplier)
    w.add_logit_scale(cfg.logits_scaling)
    w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_ssm_conv_kernel(cfg.mamba_d_conv)
    w.add_ssm_state_size(cfg.mamba_d_state)
    w.add_ssm_group_count(cfg.mamba_n_groups)
    w.add_ssm_inner_size(cfg.mamba_n_heads * cfg.mamba_d_head)
    w.add_ssm_time_step_rank(cfg.mamba_n_heads)
    w.add_rope_scaling_finetuned(False)
    sd = {k: v.detach().float().numpy() for k, v in ref.state_dict().items()}

    def add(name, t):
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    for i, kind in enumerate(types):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        gate, up = np.split(sd[p + "shared_mlp.input_linear.weight"], 2)
        shexp = "_shexp" if experts else ""
        add(b + f"ffn_gate{shexp}.weight", gate)
        add(b + f"ffn_up{shexp}.weight", up)
        add(b + f"ffn_down{shexp}.weight", sd[p + "shared_mlp.output_linear.weight"])
        if experts:
            add(b + "ffn_gate_inp.weight", sd[p + "block_sparse_moe.router.weight"])
            gate_up = sd[p + "block_sparse_moe.experts.gate_up_proj"]
            add(b + "ffn_gate_exps.weight", gate_up[:, : cfg.intermediate_size])
            add(b + "ffn_up_exps.weight", gate_up[:, cfg.intermediate_size :])
            add(b + "ffn_down_exps.weight", sd[p + "block_sparse_moe.experts.down_proj"])
        if kind == "full_attention":
            a = p + "self_attn."
            add(b + "attn_q.weight", _permute(sd[a + "q_proj.weight"], cfg.num_attention_heads))
            add(b + "attn_k.weight", _permute(sd[a + "k_proj.weight"], cfg.num_key_value_heads))
            add(b + "attn_v.weight", sd[a + "v_proj.weight"])
            add(b + "attn_output.weight", sd[a + "o_proj.weight"])
            continue
        m = p + "mamba."
        add(b + "ssm_in.weight", sd[m + "in_proj.weight"])
        add(b + "ssm_out.weight", sd[m + "out_proj.weight"])
        add(b + "ssm_conv1d.weight", sd[m + "conv1d.weight"].squeeze(1))
        add(b + "ssm_conv1d.bias", sd[m + "conv1d.bias"])
        add(b + "ssm_dt.bias", sd[m + "dt_bias"])
        add(b + "ssm_a", (-np.exp(sd[m + "A_log"])).reshape(-1, 1))
        add(b + "ssm_d", sd[m + "D"].reshape(-1, 1))
        add(b + "ssm_norm.weight", sd[m + "norm.weight"].reshape(cfg.mamba_n_groups, -1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("experts", [4, 0], ids=["moe", "dense"])
def test_gguf_matches_transformers(tmp_path, experts):
    """The GGUF's config names the same layers, sizes and multipliers; its prefill (in two chunks)
    and decode logits equal transformers' on the same (unrotated, as the converter leaves a
    Granite 4.0-H) weights."""
    gguf = pytest.importorskip("gguf")
    from llmkit.core.engine.builder import build_model
    from llmkit.core.model import quantize
    from llmkit.core.model.loader.gguf_loader import gguf_config, gguf_tensors
    from llmkit.core.plugins import registry

    from paged_runner import PagedRunner

    hf = dict(position_embedding_type="nope", num_local_experts=experts)
    ref = save_tiny_model("granitemoehybrid", tmp_path / "hf", **hf)
    _write_gguf(ref, tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = gguf_config(reader)
    assert config["layer_types"] == ["mamba", "attention", "mamba", "mamba"]
    assert config["position_embedding_type"] == "nope" and config["logits_scaling"] == ref.config.logits_scaling
    config["mamba_chunk_size"] = ref.config.mamba_chunk_size  # (not in the GGUF)
    model_cls = registry().model(registry().architecture_for_model_type(config["model_type"]))
    model = build_model(model_cls, config, torch.device("cpu"), torch.float32)
    model.load_weights(gguf_tensors(reader, config))
    quantize.finalize_weights(model)
    attn = ref.model.layers[1].self_attn  # Q/K rows back in the checkpoint's order (unrotated, the
    # logits would not tell: the same permutation of Q and K leaves every product as it was)
    qk = torch.cat([attn.q_proj.weight, attn.k_proj.weight])
    torch.testing.assert_close(model.layers[1].mixer.qkv_proj.weight[: qk.shape[0]], qk.detach())
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
