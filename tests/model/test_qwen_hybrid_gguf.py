"""The Qwen hybrids from GGUF (llama.cpp's ``qwen35``, ``qwen35moe`` and ``qwen3next``): a GGUF
written here from a tiny random transformers model the way llama.cpp's converter writes one (norms
stored as ``1 + weight``, ``-exp(A_log)``, qwen35's value heads tiled over the key heads, Qwen3-Next's
fused ``ssm_ba``, stacked experts; F32: the block types' dequantization is tested with the
other families) converts to a config and HF-named
tensors our model loads; its prefill and decode logits equal transformers' on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmkit.core.engine.builder import build_model
from llmkit.core.model import quantize
from llmkit.core.plugins import registry

from model_utils import save_tiny_model
from paged_runner import PagedRunner

gguf = pytest.importorskip("gguf")

IDS = [(37 * i + 11) % 512 for i in range(30)]
_ARCH = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
_PLAIN = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.norm": "ssm_norm",
}
_CENTRED = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_V_ROWS = {"linear_attn.in_proj_z": ("attn_gate", 0), "linear_attn.out_proj": ("ssm_out", 1)}


def _tile(w: np.ndarray, axis: int, nk: int, per_k: int, head: int) -> np.ndarray:
    """llama.cpp's qwen35 value-head order: grouped by key head -> tiled over the key heads."""
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(nk, per_k, head, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(w, 0, axis))


def _write_gguf(ref, path, arch: str, q8: bool = False) -> None:
    """``q8``: the projections (columns a multiple of 32) as Q8_0 blocks, as a published GGUF's."""
    cfg, name = ref.config, _ARCH[arch]
    tiled = name != "qwen3next"
    nk, nv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    per_k, qk = nv // nk, 2 * nk * dk
    tile = (lambda w, axis, head: _tile(w, axis, nk, per_k, head)) if tiled else (lambda w, axis, head: w)
    w = gguf.GGUFWriter(str(path), name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    w.add_full_attention_interval(4)
    w.add_uint32(f"{name}.ssm.conv_kernel", cfg.linear_conv_kernel_dim)
    w.add_uint32(f"{name}.ssm.state_size", dk)
    w.add_uint32(f"{name}.ssm.group_count", nk)
    w.add_uint32(f"{name}.ssm.time_step_rank", nv)
    w.add_uint32(f"{name}.ssm.inner_size", nv * dv)
    w.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "num_experts", None):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
    sd = {k: v.detach().float().numpy() for k, v in ref.state_dict().items()}

    def add(tname, t):
        t = np.ascontiguousarray(t, dtype=np.float32)
        if q8 and t.ndim == 2 and t.shape[1] % 32 == 0 and "token_embd" not in tname and "conv1d" not in tname:
            from gguf.quants import quantize

            w.add_tensor(tname, quantize(t, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(tname, t)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"] + 1)
    add("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, g in _PLAIN.items():
            if p + hf + ".weight" in sd:
                add(f"blk.{i}.{g}.weight", sd[p + hf + ".weight"])
        for hf, g in _CENTRED.items():
            if p + hf + ".weight" in sd:
                add(f"blk.{i}.{g}.weight", sd[p + hf + ".weight"] + 1)
        la = p + "linear_attn."
        if la + "A_log" in sd:
            if la + "in_proj_qkvz.weight" in sd:  # qwen3next: split into qkv and the gate, per key head
                t = sd[la + "in_proj_qkvz.weight"].reshape(nk, -1, cfg.hidden_size)
                q, k, v, z = np.split(t, np.cumsum([dk, dk, per_k * dv]), axis=1)
                flat = lambda x: x.reshape(-1, cfg.hidden_size)  # noqa: E731
                add(f"blk.{i}.attn_qkv.weight", np.concatenate([flat(q), flat(k), flat(v)]))
                add(f"blk.{i}.attn_gate.weight", flat(z))
            else:
                qkv = sd[la + "in_proj_qkv.weight"]
                add(f"blk.{i}.attn_qkv.weight", np.concatenate([qkv[:qk], tile(qkv[qk:], 0, dv)]))
                add(f"blk.{i}.ssm_beta.weight", tile(sd[la + "in_proj_b.weight"], 0, 1))
                add(f"blk.{i}.ssm_alpha.weight", tile(sd[la + "in_proj_a.weight"], 0, 1))
            for hf, (g, axis) in _V_ROWS.items():
                add(f"blk.{i}.{g}.weight", tile(sd[p + hf + ".weight"], axis, dv)) if p + hf + ".weight" in sd else None
            conv = sd[la + "conv1d.weight"].squeeze(1)
            add(f"blk.{i}.ssm_conv1d.weight", np.concatenate([conv[:qk], tile(conv[qk:], 0, dv)]))
            add(f"blk.{i}.ssm_a", tile(-np.exp(sd[la + "A_log"]), 0, 1))
            add(f"blk.{i}.ssm_dt.bias", tile(sd[la + "dt_bias"], 0, 1))
        if p + "mlp.experts.gate_up_proj" in sd:
            gate_up, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
            inter = gate_up.shape[1] // 2
            add(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :inter])
            add(f"blk.{i}.ffn_up_exps.weight", gate_up[:, inter:])
            add(f"blk.{i}.ffn_down_exps.weight", down)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", list(_ARCH))
def test_hybrid_gguf_matches_transformers(tmp_path, arch):
    from llmkit.core.model.loader.gguf_loader import gguf_config, gguf_tensors

    ref = save_tiny_model(arch, tmp_path / "hf")
    _write_gguf(ref, tmp_path / "tiny.gguf", arch)
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = gguf_config(reader)
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    model_cls = registry().model(registry().architecture_for_model_type(config["model_type"]))
    model = build_model(model_cls, config, torch.device("cpu"), torch.float32)
    model.load_weights(gguf_tensors(reader, config))
    quantize.finalize_weights(model)
    runner = PagedRunner(model, 1)
    row = runner.new_seq()
    (prefill,) = runner.step([(row, IDS)])
    (decode,) = runner.step([(row, [7])])
    with torch.no_grad():
        logits = ref(torch.tensor([IDS + [7]])).logits[0]
    torch.testing.assert_close(prefill, logits[:-1], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(decode[0], logits[-1], atol=2e-4, rtol=2e-4)


def test_served_gguf_is_requantized_to_its_precision(tmp_path):
    """A Q8_0 ``qwen35`` GGUF served as it is (no --quantization): its layers cannot keep GGUF blocks,
    so it is dequantized and quantized again to int8 (one byte a weight, as the file), not served in
    fp32, and generates."""
    from model_utils import copy_embedded_tokenizer, start_engine

    ref = save_tiny_model("qwen3_5", tmp_path / "hf")
    _write_gguf(ref, tmp_path / "tiny.gguf", "qwen3_5", q8=True)
    copy_embedded_tokenizer(tmp_path)
    engine = start_engine(model_path=str(tmp_path / "tiny.gguf"), device="cpu", max_total_tokens=1024)
    try:
        model = engine.runner.model
        assert model.layers[0].mixer.in_proj.format.name == "int8"
        assert model.layers[3].mixer.qkv_proj.format.name == "int8"
        from hybrid_utils import run_prompts

        ((tokens, _),) = run_prompts(engine, [IDS], 6)
        assert len(tokens) == 6
    finally:
        engine.shutdown()
