"""The MoE families from GGUF (llama.cpp's ``qwen3moe``, ``gpt-oss`` and ``deepseek2``): a GGUF
written here from a tiny random transformers model, with llama.cpp's names and its stacked
``ffn_*_exps`` expert tensors (MXFP4 for gpt-oss, as its published GGUFs are), converts to a config
and HF-named tensors our model loads; its logits equal transformers' on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmkit.core.engine.builder import build_model
from llmkit.core.model import quantize
from llmkit.core.model.cpu import cpu_quant
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


def _expert_blocks(t: np.ndarray, qtype: str, seed: int) -> np.ndarray:
    """Stacked expert weights ``[E, rows, cols]`` as ``qtype`` blocks ``[E, rows, bytes]``: the
    ``gguf`` package's quantizer where it has one (Q4_0, Q4_1, Q8_0); for the K-types, which it
    cannot quantize, random blocks with scales that give weights of the same spread, centred (the
    tests compare against the dequantized GGUF, so the blocks need not come from ``t``)."""
    from gguf.quants import quantize

    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        return quantize(np.ascontiguousarray(t), kind)
    rng = np.random.default_rng(seed)
    size = {"Q4_K": 144, "Q6_K": 210}[qtype]
    b = rng.integers(0, 256, (t.size // 256, size), dtype=np.uint8)
    d = rng.uniform(0.5, 1.0, (b.shape[0], 1)) * float(np.abs(t).mean())
    if qtype == "Q4_K":  # w = d * sc * q - dmin * m, sc and m 6-bit, q 4-bit: mean 236 d - 31.5 dmin
        b[:, 0:4] = np.concatenate([d / 120, d / 120 * 7.5], axis=1).astype(np.float16).view(np.uint8)
    else:  # Q6_K: w = d * sc * (q - 32), sc int8, q 6-bit: centred
        b[:, 208:210] = (d / 1200).astype(np.float16).view(np.uint8)
    return b.reshape(*t.shape[:-1], -1)


def _add_experts(w, layer: int, gate_up: np.ndarray, down: np.ndarray, types: dict[str, str]) -> None:
    """llama.cpp's stacked expert tensors from transformers' ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]``, each in its ``types`` entry (F32 where none)."""
    inter = gate_up.shape[1] // 2
    for j, (name, t) in enumerate(
        (("ffn_gate_exps", gate_up[:, :inter]), ("ffn_up_exps", gate_up[:, inter:]), ("ffn_down_exps", down))
    ):
        t = np.ascontiguousarray(t)
        if name in types:
            kind = gguf.GGMLQuantizationType[types[name]]
            w.add_tensor(f"blk.{layer}.{name}.weight", _expert_blocks(t, types[name], 3 * layer + j), raw_dtype=kind)
        else:
            w.add_tensor(f"blk.{layer}.{name}.weight", t)


def _write_gguf(ref, path, experts: dict[str, str] | None = None) -> None:
    """``experts``: the block type of each stacked expert tensor (``ffn_gate_exps``...), F32
    where not given."""
    experts = experts or {}
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
        _add_experts(w, i, sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"], experts)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen3moe_gguf_matches_transformers(tmp_path):
    from llmkit.core.model.loader.gguf_loader import gguf_config, gguf_tensors

    # llama.cpp's qwen3moe: every layer sparse, top-k renormalised
    ref = save_tiny_model("qwen3_moe", tmp_path / "hf", mlp_only_layers=[], norm_topk_prob=True)
    _write_gguf(ref, tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = gguf_config(reader)
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == 4
    assert registry().architecture_for_model_type("qwen3_moe") == "Qwen3MoeForCausalLM"
    model = build_model(registry().model("Qwen3MoeForCausalLM"), config, torch.device("cpu"), torch.float32)
    model.load_weights(gguf_tensors(reader, config))
    quantize.finalize_weights(model)
    with torch.no_grad():
        full = ref(torch.tensor([IDS])).logits[0]
    runner = PagedRunner(model, 16)
    (ours,) = runner.step([(runner.new_seq(), IDS)])
    assert torch.allclose(ours, full, atol=1e-4, rtol=1e-4), (ours - full).abs().max()


# Expert tensor types as llama.cpp writes them: one type for all three; Q4_K_M's mix (gate/up Q4_K,
# down Q6_K); and gate and up of different types, which one gate/up layer per expert holds as int8.
EXPERT_TYPES = {
    "Q4_0": {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q4_0"},
    "Q4_1": {"ffn_gate_exps": "Q4_1", "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q4_1"},
    "Q8_0": {"ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q8_0"},
    "Q4_K": {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q4_K"},
    "Q4_K_M": {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"},
    "gate Q4_0, up Q8_0": {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q4_0"},
}


def _native_and_dequantized(tmp_path, types: dict[str, str], arch: str = "qwen3_moe"):
    """A qwen3moe (or deepseek2) GGUF with its experts in ``types`` (hidden and expert width 256
    where a K-type needs whole 256-column super-blocks), loaded natively and dequantized (what
    ``--quantization none`` serves)."""
    from llmkit.core.model.loader.gguf_loader import gguf_config, gguf_native_tensors, gguf_tensors

    k = any(t.endswith("_K") for t in types.values())
    size = dict(hidden_size=256, moe_intermediate_size=256) if k else {}
    if arch == "qwen3_moe":
        ref = save_tiny_model(arch, tmp_path / "hf", mlp_only_layers=[], norm_topk_prob=True, **size)
        _write_gguf(ref, tmp_path / "tiny.gguf", types)
    else:
        ref = save_tiny_model(arch, tmp_path / "hf", **size)
        _write_deepseek2_gguf(ref, tmp_path / "tiny.gguf", sigmoid=arch == "deepseek_v3", experts=types)
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = gguf_config(reader)
    cls = registry().model(registry().architecture_for_model_type(config["model_type"]))
    models = []
    for stream in (gguf_native_tensors, gguf_tensors):
        model = build_model(cls, config, torch.device("cpu"), torch.float32)
        model.load_weights(stream(reader, config))
        quantize.finalize_weights(model)
        models.append(model)
    return models


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(
    ("arch", "types"), [("qwen3_moe", t) for t in EXPERT_TYPES] + [("deepseek_v3", "Q4_0"), ("deepseek_v3", "Q8_0")]
)
def test_gguf_experts_stay_quantized(tmp_path, arch, types):
    """The experts keep the GGUF's types (int4 groups or int8 rows, no fp32 copy anywhere) and the
    model's logits match the dequantized GGUF's.

    Tolerances. Per expert weight: Q4_0/Q4_1/Q4_K map exactly onto int4 groups, only the bf16
    scale and zero round (2^-9 relative each: measured 0.17 % relative, bound 0.5 %); Q8_0/Q6_K are
    requantized to int8 per row (at most half a row step: measured <= 0.63 %, bound 1 %). On the
    logits, two sparse layers of two quantized projections each, plus the C kernels' int8
    activation blocks (~0.5 % a projection, tests/model/quant/test_gguf_quant.py): measured 0.8-2.3 % (the
    256-wide K-type models the most; 0.3-1.8 % on torch's bf16 kernels), bound 5 %, about twice the
    worst; and the greedy token equal wherever the reference's top-2 margin exceeds twice the error."""
    from llmkit.core.model.moe import FusedExperts

    types = EXPERT_TYPES[types]
    native, dense = _native_and_dequantized(tmp_path, types, arch)
    int4 = {"Q4_0", "Q4_1", "Q4_K"}
    gate_up = "int4" if {types["ffn_gate_exps"], types["ffn_up_exps"]} <= int4 else "int8"
    down = "int4" if types["ffn_down_exps"] in int4 else "int8"
    sparse = [(a, b) for a, b in zip(native.layers, dense.layers) if hasattr(a.mlp, "experts")]
    assert sparse
    for layer, ref_layer in sparse:
        ex, ref = layer.mlp.experts, ref_layer.mlp.experts
        assert isinstance(ex, FusedExperts) and ex.quantized and ex.w13 is None and ex.w2 is None
        assert not [k for k in native.state_dict() if ".experts." in k]  # no dense expert tensor
        stored = ex.weight_tensors()
        assert {t.dtype for t in stored.values()} <= {torch.uint8, torch.int8, torch.bfloat16, torch.float16}
        e, h, i = ex.num_experts, ex.hidden, ex.intermediate
        # Q4_0 alone is symmetric: our C kernel's layout keeps its fp16 scales without zeros
        sym_gate_up = cpu_quant.available() and {types["ffn_gate_exps"], types["ffn_up_exps"]} == {"Q4_0"}
        sym_down = cpu_quant.available() and types["ffn_down_exps"] == "Q4_0"
        for name, fmt, (rows, cols), sym in (
            ("w13", gate_up, (2 * i, h), sym_gate_up),
            ("w2", down, (h, i), sym_down),
        ):
            got = _bytes(t for n, t in stored.items() if f".{name}." in n)
            # int4: half a byte a weight + a bf16 scale and zero (or an fp16 scale) a 32-group;
            # int8: a byte + a bf16 row scale
            want = e * rows * cols * (0.5 + (2 if sym else 4) / 32) if fmt == "int4" else e * (rows * cols + 2 * rows)
            assert got == want, (name, got, want)
        assert _bytes(stored.values()) < _bytes(ref.weight_tensors().values()) / 3.5  # fp32: 4 bytes a weight
        for j in range(e):
            for got, want, fmt in zip(ex.expert_weights(j), ref.expert_weights(j), (gate_up, down)):
                rel = ((got - want).norm() / want.norm()).item()
                assert rel < (0.005 if fmt == "int4" else 0.01), (j, fmt, rel)
    runner, ref_runner = PagedRunner(native, 16), PagedRunner(dense, 16)
    (got,) = runner.step([(runner.new_seq(), IDS)])
    (want,) = ref_runner.step([(ref_runner.new_seq(), IDS)])
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.05, rel
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (got - want).abs().amax(-1)
    assert clear.any()
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_qwen3moe_gguf_loads_one_expert_at_a_time(tmp_path):
    """Loading never holds more than one expert's unpacked staging: each expert's gate and up
    tensors come in turn and its layer packs as soon as both are in (a whole stacked tensor's
    staging would be 1.25 bytes a weight of the layer, int8's 4)."""
    from llmkit.core.model.loader.gguf_loader import gguf_config, gguf_native_tensors
    from llmkit.core.model.moe import FusedExperts

    ref = save_tiny_model("qwen3_moe", tmp_path / "hf", mlp_only_layers=[], norm_topk_prob=True)
    _write_gguf(ref, tmp_path / "tiny.gguf", EXPERT_TYPES["gate Q4_0, up Q8_0"])
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = gguf_config(reader)
    model = build_model(registry().model("Qwen3MoeForCausalLM"), config, torch.device("cpu"), torch.float32)
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]

    def staged():  # expert layers holding unpacked values (int4's _q4, int8's fp32 weight)
        layers = [g for ex in experts for pair in ex._layers for g in pair if g is not None]
        return sum(getattr(g, "_q4", None) is not None or g.weight is not None for g in layers)

    def watched(stream):
        for item in stream:
            yield item
            assert staged() <= 1, item[0]

    model.load_weights(watched(gguf_native_tensors(reader, config)))
    assert staged() == 0 and all(ex.quantized for ex in experts)


def test_qwen3moe_gguf_serves_natively_through_the_engine(tmp_path, monkeypatch):
    """``--model-path x.gguf`` on CPU: the MoE family is served at native precision now, experts
    included, and answers."""
    from model_utils import _greedy, copy_embedded_tokenizer, start_engine

    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(tmp_path / "cache"))
    ref = save_tiny_model("qwen3_moe", tmp_path / "hf", mlp_only_layers=[], norm_topk_prob=True)
    d = tmp_path / "gguf"
    d.mkdir()
    _write_gguf(ref, d / "tiny.gguf", EXPERT_TYPES["Q4_0"])
    copy_embedded_tokenizer(d)
    engine = start_engine(model_path=str(d / "tiny.gguf"), device="cpu", max_total_tokens=256)
    try:
        ex = engine.runner.model.layers[0].mlp.experts
        assert ex.quantized and ex.format.name == "int4"
        out, _ = _greedy(engine, "r", IDS[:12], 6)
        assert len(out) == 6
    finally:
        engine.shutdown()


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


@pytest.mark.parametrize("native", [False, True])
def test_gpt_oss_mxfp4_gguf_matches_transformers(tmp_path, native):
    """Dequantized, and at native precision, where the MXFP4 experts are dequantized at load (no
    int4 or int8 layout holds E2M1 values with power-of-two scales exactly) and the rest loads as
    it is (F32 here)."""
    from llmkit.core.model.loader.gguf_loader import gguf_config, gguf_native_tensors, gguf_tensors

    ref = save_tiny_model("gpt_oss", tmp_path / "hf", swiglu_limit=7.0)  # llama.cpp's fixed clamp
    _write_gpt_oss_gguf(ref, tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = gguf_config(reader)
    assert config["model_type"] == "gpt_oss" and config["rope_scaling"]["rope_type"] == "yarn"
    model = build_model(registry().model("GptOssForCausalLM"), config, torch.device("cpu"), torch.float32)
    model.load_weights((gguf_native_tensors if native else gguf_tensors)(reader, config))
    quantize.finalize_weights(model)
    assert not any(layer.mlp.experts.quantized for layer in model.layers)
    assert [layer.self_attn.sliding_window for layer in model.layers] == [16, None]
    ids = [(37 * i + 11) % 512 for i in range(40)]  # past the 16-token window
    with torch.no_grad():
        full = ref(torch.tensor([ids])).logits[0]
    runner = PagedRunner(model, 16)
    (ours,) = runner.step([(runner.new_seq(), ids)])
    assert torch.allclose(ours, full, atol=1e-4, rtol=1e-4), (ours - full).abs().max()


def _write_deepseek2_gguf(ref, path, sigmoid: bool, experts: dict[str, str] | None = None) -> None:
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
        _add_experts(w, i, sd[f"{p}mlp.experts.gate_up_proj"], sd[f"{p}mlp.experts.down_proj"], experts or {})
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
@pytest.mark.parametrize("native", [False, True])
def test_deepseek2_gguf_matches_transformers(tmp_path, arch, cls, native):
    from llmkit.core.model.loader.gguf_loader import gguf_config, gguf_native_tensors, gguf_tensors

    ref = save_tiny_model(arch, tmp_path / "hf")
    _write_deepseek2_gguf(ref, tmp_path / "tiny.gguf", sigmoid=arch == "deepseek_v3")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = gguf_config(reader)
    assert registry().architecture_for_model_type(config["model_type"]) == cls
    model = build_model(registry().model(cls), config, torch.device("cpu"), torch.float32)
    model.load_weights((gguf_native_tensors if native else gguf_tensors)(reader, config))
    quantize.finalize_weights(model)
    with torch.no_grad():
        full = ref(torch.tensor([IDS])).logits[0]
    runner = PagedRunner(model, 16)
    (ours,) = runner.step([(runner.new_seq(), IDS)])
    assert torch.allclose(ours, full, atol=1e-4, rtol=1e-4), (ours - full).abs().max()


def test_deepseek2_gguf_serves_with_the_tokenizer_beside_it(tmp_path, monkeypatch):
    """transformers cannot rebuild a deepseek2 tokenizer from GGUF metadata: the conversion takes
    the tokenizer files next to the .gguf (and says so when there are none)."""
    from llmkit.core.model.loader.source import resolve_model_dir

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
