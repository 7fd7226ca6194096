"""The MoE families from GGUF (llama.cpp's ``qwen3moe``, ``gpt-oss`` and ``deepseek2``): a GGUF
written here from a tiny random transformers model, with llama.cpp's names and its stacked
``ffn_*_exps`` expert tensors (MXFP4 for gpt-oss, as its published GGUFs are), converts to a config
and HF-named tensors our model loads; its logits equal transformers' on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmkit.core.engine.builder import build_model
from llmkit.core.plugins import registry

from model_utils import save_tiny_model
from paged_runner import PagedRunner

gguf = pytest.importorskip("gguf")

IDS = [(37 * i + 11) % 512 for i in range(30)]
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
}


def _write_gguf(ref, path) -> None:
    cfg = ref.config
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_vocab_size(cfg.vocab_size)
    sd = {k: v.detach().float().numpy() for k, v in ref.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, name in _LAYER.items():
            w.add_tensor(f"blk.{i}.{name}.weight", sd[p + hf + ".weight"])
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2I, H] in transformers' memory layout
        inter = gate_up.shape[1] // 2
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :inter]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, inter:]))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen3moe_gguf_matches_transformers(tmp_path):
    from llmkit.core.model.gguf_loader import gguf_config, gguf_tensors

    # llama.cpp's qwen3moe: every layer sparse, top-k renormalised
    ref = save_tiny_model("qwen3_moe", tmp_path / "hf", mlp_only_layers=[], norm_topk_prob=True)
    _write_gguf(ref, tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = gguf_config(reader)
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == 4
    assert registry().architecture_for_model_type("qwen3_moe") == "Qwen3MoeForCausalLM"
    model = build_model(registry().model("Qwen3MoeForCausalLM"), config, torch.device("cpu"), torch.float32)
    model.load_weights(gguf_tensors(reader, config))
    model.finalize_weights()
    with torch.no_grad():
        full = ref(torch.tensor([IDS])).logits[0]
    runner = PagedRunner(model, 16)
    (ours,) = runner.step([(runner.new_seq(), IDS)])
    assert torch.allclose(ours, full, atol=1e-4, rtol=1e-4), (ours - full).abs().max()


def _write_gpt_oss_gguf(ref, path) -> None:
    """llama.cpp's layout: gate and up de-interleaved, experts [E, out, in] in MXFP4, biases f32;
    the reference model gets the dequantized experts so both sides run the same weights."""
    from gguf.quants import dequantize, quantize

    cfg = ref.config
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_vocab_size(cfg.vocab_size)
    sd = {k: v.detach().float().numpy() for k, v in ref.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    mx = gguf.GGMLQuantizationType.MXFP4
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            w.add_tensor(f"blk.{i}.{name}.weight", sd[f"{p}self_attn.{hf}.weight"])
            w.add_tensor(f"blk.{i}.{name}.bias", sd[f"{p}self_attn.{hf}.bias"])
        w.add_tensor(f"blk.{i}.attn_sinks.weight", sd[f"{p}self_attn.sinks"])
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[f"{p}input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.post_attention_norm.weight", sd[f"{p}post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", sd[f"{p}mlp.router.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate_inp.bias", sd[f"{p}mlp.router.bias"])
        gate_up, gu_bias = sd[f"{p}mlp.experts.gate_up_proj"], sd[f"{p}mlp.experts.gate_up_proj_bias"]
        dense = {}
        for name, t in (
            ("ffn_gate_exps", gate_up[:, :, 0::2].transpose(0, 2, 1)),  # [E, I, H]
            ("ffn_up_exps", gate_up[:, :, 1::2].transpose(0, 2, 1)),
            ("ffn_down_exps", sd[f"{p}mlp.experts.down_proj"].transpose(0, 2, 1)),  # [E, H, I]
        ):
            q = quantize(np.ascontiguousarray(t), mx)
            w.add_tensor(f"blk.{i}.{name}.weight", q, raw_dtype=mx)
            dense[name] = dequantize(q, mx).reshape(t.shape)
        w.add_tensor(f"blk.{i}.ffn_gate_exps.bias", np.ascontiguousarray(gu_bias[:, 0::2]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.bias", np.ascontiguousarray(gu_bias[:, 1::2]))
        w.add_tensor(f"blk.{i}.ffn_down_exps.bias", sd[f"{p}mlp.experts.down_proj_bias"])
        with torch.no_grad():
            experts = ref.model.layers[i].mlp.experts
            experts.gate_up_proj[:, :, 0::2] = torch.from_numpy(dense["ffn_gate_exps"].transpose(0, 2, 1).copy())
            experts.gate_up_proj[:, :, 1::2] = torch.from_numpy(dense["ffn_up_exps"].transpose(0, 2, 1).copy())
            experts.down_proj.copy_(torch.from_numpy(dense["ffn_down_exps"].transpose(0, 2, 1).copy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gpt_oss_mxfp4_gguf_matches_transformers(tmp_path):
    from llmkit.core.model.gguf_loader import gguf_config, gguf_tensors

    ref = save_tiny_model("gpt_oss", tmp_path / "hf", swiglu_limit=7.0)  # llama.cpp's fixed clamp
    _write_gpt_oss_gguf(ref, tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = gguf_config(reader)
    assert config["model_type"] == "gpt_oss" and config["rope_scaling"]["rope_type"] == "yarn"
    model = build_model(registry().model("GptOssForCausalLM"), config, torch.device("cpu"), torch.float32)
    model.load_weights(gguf_tensors(reader, config))
    model.finalize_weights()
    assert [layer.self_attn.sliding_window for layer in model.layers] == [16, None]
    ids = [(37 * i + 11) % 512 for i in range(40)]  # past the 16-token window
    with torch.no_grad():
        full = ref(torch.tensor([ids])).logits[0]
    runner = PagedRunner(model, 16)
    (ours,) = runner.step([(runner.new_seq(), ids)])
    assert torch.allclose(ours, full, atol=1e-4, rtol=1e-4), (ours - full).abs().max()


def _write_deepseek2_gguf(ref, path, sigmoid: bool) -> None:
    """llama.cpp's deepseek2 layout: MLA tensors with kv_b_proj split into attn_k_b (transposed)
    and attn_v_b, stacked routed experts, shared experts as *_shexp, the correction bias as
    exp_probs_b, the routing in metadata (gating function, groups, scale, norm)."""
    cfg = ref.config
    heads, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    rank, v_dim = cfg.kv_lora_rank, cfg.v_head_dim
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(1)  # MLA: one latent "head" in the cache
    w.add_key_length(rank + rope)
    w.add_value_length(rank)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(v_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(rope)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(rank)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(bool(sigmoid and cfg.norm_topk_prob))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_vocab_size(cfg.vocab_size)
    sd = {k: v.detach().float().numpy() for k, v in ref.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
        names.update({"self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm"})
        names["self_attn.o_proj"] = "attn_output"
        if cfg.q_lora_rank:
            names.update({"self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm"})
            names["self_attn.q_b_proj"] = "attn_q_b"
        else:
            names["self_attn.q_proj"] = "attn_q"
        for hf, name in names.items():
            w.add_tensor(f"{b}{name}.weight", sd[f"{p}{hf}.weight"])
        kv_b = sd[f"{p}self_attn.kv_b_proj.weight"].reshape(heads, nope + v_dim, rank)
        w.add_tensor(f"{b}attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)))
        w.add_tensor(f"{b}attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]))
        if i < cfg.first_k_dense_replace:
            for proj, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                w.add_tensor(f"{b}{name}.weight", sd[f"{p}mlp.{proj}.weight"])
            continue
        w.add_tensor(f"{b}ffn_gate_inp.weight", sd[f"{p}mlp.gate.weight"])
        if sigmoid:
            w.add_tensor(f"{b}exp_probs_b.bias", sd[f"{p}mlp.gate.e_score_correction_bias"])
        gate_up = sd[f"{p}mlp.experts.gate_up_proj"]
        inter = gate_up.shape[1] // 2
        w.add_tensor(f"{b}ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :inter]))
        w.add_tensor(f"{b}ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, inter:]))
        w.add_tensor(f"{b}ffn_down_exps.weight", sd[f"{p}mlp.experts.down_proj"])
        for proj, name in (
            ("gate_proj", "ffn_gate_shexp"),
            ("up_proj", "ffn_up_shexp"),
            ("down_proj", "ffn_down_shexp"),
        ):
            w.add_tensor(f"{b}{name}.weight", sd[f"{p}mlp.shared_experts.{proj}.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    ("arch", "cls"), [("deepseek_v3", "DeepseekV3ForCausalLM"), ("deepseek_v2", "DeepseekV2ForCausalLM")]
)
def test_deepseek2_gguf_matches_transformers(tmp_path, arch, cls):
    from llmkit.core.model.gguf_loader import gguf_config, gguf_tensors

    ref = save_tiny_model(arch, tmp_path / "hf")
    _write_deepseek2_gguf(ref, tmp_path / "tiny.gguf", sigmoid=arch == "deepseek_v3")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = gguf_config(reader)
    assert registry().architecture_for_model_type(config["model_type"]) == cls
    model = build_model(registry().model(cls), config, torch.device("cpu"), torch.float32)
    model.load_weights(gguf_tensors(reader, config))
    model.finalize_weights()
    with torch.no_grad():
        full = ref(torch.tensor([IDS])).logits[0]
    runner = PagedRunner(model, 16)
    (ours,) = runner.step([(runner.new_seq(), IDS)])
    assert torch.allclose(ours, full, atol=1e-4, rtol=1e-4), (ours - full).abs().max()


def test_deepseek2_gguf_serves_with_the_tokenizer_beside_it(tmp_path, monkeypatch):
    """transformers cannot rebuild a deepseek2 tokenizer from GGUF metadata: the conversion takes
    the tokenizer files next to the .gguf (and says so when there are none)."""
    from llmkit.core.model.source import resolve_model_dir

    from model_utils import copy_embedded_tokenizer

    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(tmp_path / "cache"))
    ref = save_tiny_model("deepseek_v3", tmp_path / "hf")
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    _write_deepseek2_gguf(ref, gguf_dir / "tiny.gguf", sigmoid=True)
    with pytest.raises(ValueError, match="put the model's tokenizer.json"):
        resolve_model_dir(str(gguf_dir / "tiny.gguf"))
    copy_embedded_tokenizer(gguf_dir)
    converted = resolve_model_dir(str(gguf_dir / "tiny.gguf"))
    assert (converted / "tokenizer.json").exists()
    from model_utils import load_ours

    model = load_ours(converted)
    with torch.no_grad():
        full = ref(torch.tensor([IDS])).logits[0]
    runner = PagedRunner(model, 16)
    (ours,) = runner.step([(runner.new_seq(), IDS)])
    assert torch.allclose(ours, full, atol=1e-4, rtol=1e-4), (ours - full).abs().max()
