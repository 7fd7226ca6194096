"""The breadth families from GGUF: a file written here from a tiny random transformers checkpoint
the way llama.cpp's converter writes one (Mixtral as ``llama`` with stacked experts and its Q/K rows
permuted, ``phi3`` with fused projections and LongRoPE factor tensors, ``smollm3`` permuted and
tied, ``glm4moe`` with its MoE metadata and an MTP block after the last layer, ``minimax-m2``;
F32: block types are tested with the other families) converts to a config and HF-named tensors our
model loads; prefill and decode logits equal transformers' on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmkit.core.engine.builder import build_model
from llmkit.core.model import quantize
from llmkit.core.model.loader.source import iter_safetensors
from llmkit.core.plugins import registry

from breadth_utils import IDS, save_tiny
from paged_runner import PagedRunner

gguf = pytest.importorskip("gguf")

GGUF_ARCH = {
    "mixtral": "llama",
    "phi3": "phi3",
    "smollm3": "smollm3",
    "glm4_moe": "glm4moe",
    "minimax_m2": "minimax-m2",
}
PERMUTED = ("mixtral", "smollm3")
DENSE = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # (phi3: gate and up fused in one tensor)
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
EXPERTS |= {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _permute(w, heads: int):
    """llama.cpp's Q/K row order (its converter's permute: halves to interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(arch: str, ref, hf_dir, path, mtp: bool = False) -> None:
    cfg, name = ref.config, GGUF_ARCH[arch]
    sd = {n: t.float().numpy() for n, t in iter_safetensors(hf_dir)}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    n = cfg.num_hidden_layers
    w = gguf.GGUFWriter(str(path), name)
    w.add_block_count(n + (1 if mtp else 0))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    if arch == "mixtral" or arch == "minimax_m2":
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "minimax_m2":
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_rope_dimension_count(cfg.rotary_dim)
    if arch == "phi3":
        rot = int(head_dim * rope["partial_rotary_factor"])
        w.add_rope_dimension_count(rot)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_sliding_window(0)
        scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(scale) / np.log(rope["original_max_position_embeddings"])))
        )
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    if arch == "glm4_moe":
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_nextn_predict_layers(1 if mtp else 0)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(n + (1 if mtp else 0)):
        src = min(i, n - 1)  # (the MTP block: a copy of the last layer's tensors, plus its own)
        p = f"model.layers.{src}."
        for hf, g in DENSE.items():
            for suffix in ("weight", "bias"):
                t = sd.get(f"{p}{hf}.{suffix}")
                if t is None:
                    continue
                if arch in PERMUTED and g in ("attn_q", "attn_k") and suffix == "weight":
                    t = _permute(t, cfg.num_attention_heads if g == "attn_q" else cfg.num_key_value_heads)
                w.add_tensor(f"blk.{i}.{g}.{suffix}", np.ascontiguousarray(t))
        for hf in (p + "mlp.gate.e_score_correction_bias", p + "block_sparse_moe.e_score_correction_bias"):
            if hf in sd:
                w.add_tensor(f"blk.{i}.exp_probs_b.bias", sd[hf])
        for block in ("mlp", "block_sparse_moe"):
            for proj, g in EXPERTS.items():
                per = [sd.get(f"{p}{block}.experts.{e}.{proj}.weight") for e in range(64)]
                per = [t for t in per if t is not None]
                if per:
                    w.add_tensor(f"blk.{i}.{g}.weight", np.stack(per))
        if mtp and i == n:
            w.add_tensor(f"blk.{i}.nextn.eh_proj.weight", np.zeros((cfg.hidden_size, 2 * cfg.hidden_size), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_gguf_matches_transformers(tmp_path, arch):
    from llmkit.core.model.loader.gguf_loader import gguf_config, gguf_tensors

    # (llama.cpp keeps no expert groups for glm4moe; GLM-4.5's own checkpoints have one)
    ref = save_tiny(arch, tmp_path / "hf", **({"n_group": 1, "topk_group": 1} if arch == "glm4_moe" else {}))
    _write_gguf(arch, ref, tmp_path / "hf", tmp_path / "tiny.gguf", mtp=arch == "glm4_moe")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = gguf_config(reader)
    model_cls = registry().model(registry().architecture_for_model_type(config["model_type"]))
    assert model_cls.__name__ == type(ref).__name__
    model = build_model(model_cls, config, torch.device("cpu"), torch.float32)
    model.load_weights(gguf_tensors(reader, config))
    quantize.finalize_weights(model)
    runner = PagedRunner(model, 1)
    row = runner.new_seq()
    ids = IDS[:30]
    (prefill,) = runner.step([(row, ids)])
    (decode,) = runner.step([(row, [7])])
    with torch.no_grad():
        logits = ref(torch.tensor([ids + [7]])).logits[0]
    torch.testing.assert_close(prefill, logits[:-1], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(decode[0], logits[-1], atol=2e-4, rtol=2e-4)


def test_served_gguf_generates_as_transformers(tmp_path):
    """A Mixtral GGUF (``llama`` with experts) given to the engine as ``--model-path file.gguf``:
    the plan reads its config from the file, loads it dequantized (F32: no requantization), and
    greedy generation equals transformers' ``generate``."""
    from model_utils import assert_greedy_matches_generate, copy_embedded_tokenizer

    ref = save_tiny("mixtral", tmp_path / "hf")
    _write_gguf("mixtral", ref, tmp_path / "hf", tmp_path / "tiny.gguf")
    copy_embedded_tokenizer(tmp_path)
    assert_greedy_matches_generate(ref, tmp_path / "tiny.gguf", [IDS[:40]], n=8)
