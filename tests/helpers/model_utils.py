"""Build llmkit models outside a server (for comparisons against transformers)."""

from __future__ import annotations

import torch

from llmkit.core.engine.builder import build_engine_parts
from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.loop import Engine
from llmkit.core.model import quantize


def tiny_config(arch: str, **overrides):
    import transformers

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=1000000.0)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
    if arch == "qwen3_moe":
        # layer 0 sparse, layer 1 dense (mlp_only_layers); 4 experts, top-2, renormalised
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        moe.update(decoder_sparse_step=1, mlp_only_layers=[1])
        return transformers.Qwen3MoeConfig(**{**common, **moe, **overrides}, head_dim=32, rope_theta=1000000.0)
    if arch == "gpt_oss":
        # layer 0 sliding (window 16, so the tests' prompts outgrow it), layer 1 full; YaRN rope
        kw = dict(head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=16)
        kw.update(max_position_embeddings=512, rms_norm_eps=1e-5, swiglu_limit=1.0)  # a limit that clamps
        return transformers.GptOssConfig(**{**common, **kw, **overrides})
    if arch == "deepseek_v3":
        # MLA with a q LoRA; layer 0 dense, layer 1 MoE: 8 experts in 4 groups, top-2 of the best 2
        # groups, one shared expert; V3's default interleaved rope
        kw = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8)
        kw.update(v_head_dim=12, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4)
        kw.update(topk_group=2, first_k_dense_replace=1, moe_intermediate_size=32, routed_scaling_factor=2.5)
        return transformers.DeepseekV3Config(**{**common, **kw, **overrides})
    if arch == "glm4_moe_lite":
        # GLM-4.7-Flash's layout: V3's MLA with value heads wider than the no-rope query part, layer
        # 0 dense and 1 sparse by mlp_layer_types, grouped sigmoid routing with a shared expert
        kw = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8)
        kw.update(v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4)
        kw.update(topk_group=2, mlp_layer_types=["dense", "sparse"], moe_intermediate_size=32)
        kw.update(routed_scaling_factor=1.8)
        return transformers.Glm4MoeLiteConfig(**{**common, **kw, **overrides})
    if arch == "deepseek_v2":
        # V2-Lite's layout (no q LoRA), group-limited softmax routing over 4 groups, a shared expert
        kw = dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8)
        kw.update(v_head_dim=12, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4)
        kw.update(topk_group=2, first_k_dense_replace=1, moe_intermediate_size=32, routed_scaling_factor=1.5)
        kw.update(topk_method="group_limited_greedy")
        return transformers.DeepseekV2Config(**{**common, **kw, **overrides})
    if arch == "qwen3_5":
        # hybrid: layers 0-2 Gated DeltaNet, 3 full attention (gated, rotary on a quarter of each head);
        # 2 key heads serve 4 value heads
        kw = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4)
        kw.update(linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
        kw.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
        return transformers.Qwen3_5TextConfig(**{**common, **kw, **overrides})
    if arch in ("qwen3_5_moe", "qwen3_next"):
        # as qwen3_5 (Qwen3-Next's DeltaNet projections fused per key head), every layer a routed
        # MoE of 4 experts, top-2, with a gated shared expert
        kw = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4)
        kw.update(linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
        kw.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
        if arch == "qwen3_next":
            kw.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
            return transformers.Qwen3NextConfig(**{**common, **kw, **overrides})
        return transformers.Qwen3_5MoeTextConfig(**{**common, **kw, **overrides})
    if arch == "lfm2":
        # hybrid: conv, conv, attention, conv, attention (Q/K norms, 2 KV heads for 4); kernel 3;
        # tied embeddings; the feed-forward width adjusted as LFM2's: 2/3 of 128 is 85, times 1.5
        # is 127, rounded up to a multiple of 32: 128
        kw = dict(num_hidden_layers=5, layer_types=["conv", "conv", "full_attention", "conv", "full_attention"])
        kw.update(conv_L_cache=3, norm_eps=1e-5, tie_word_embeddings=True, block_multiple_of=32)
        kw.update(block_ffn_dim_multiplier=1.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        base = {k: v for k, v in common.items() if k != "rms_norm_eps"}
        return transformers.Lfm2Config(**{**base, **kw, **overrides})
    if arch == "nemotron_h":
        # hybrid: Mamba2, attention (no rotary), Mamba2, ReLU² MLP, MoE, attention; 8 Mamba heads in
        # 2 groups of B/C, SSD chunks of 8 tokens (the tests' prompts span several); kernel 4; the
        # MoE: 4 ReLU² experts in 2 groups (top-2 of the best group), a shared expert, scaled by 2.5
        types = ["linear_attention", "full_attention", "linear_attention", "mlp", "moe", "full_attention"]
        kw = dict(layers_block_type=types, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        kw.update(moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=2.5)
        kw.update(head_dim=16, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4)
        kw.update(chunk_size=8, layer_norm_epsilon=1e-5, use_conv_bias=True)
        base = {k: v for k, v in common.items() if k not in ("rms_norm_eps", "num_hidden_layers")}
        return transformers.NemotronHConfig(**{**base, **kw, **overrides})
    if arch == "granitemoehybrid":
        # hybrid: Mamba2, attention (rotary), Mamba2, Mamba2; 8 Mamba heads in 2 groups, SSD chunks
        # of 8; every layer a routed MoE (4 SwiGLU experts, top-2) plus a shared expert; Granite's
        # multipliers away from 1
        kw = dict(num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"], intermediate_size=32)
        kw.update(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4)
        kw.update(mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48)
        kw.update(position_embedding_type="rope", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        kw.update(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0)
        return transformers.GraniteMoeHybridConfig(**{**common, **kw, **overrides})
    raise ValueError(arch)


def save_tiny_model(arch: str, path, **overrides) -> "torch.nn.Module":
    """A random-weight HF model saved as safetensors, with the embedded model's tokenizer files."""
    import transformers

    torch.manual_seed(0)
    cfg = tiny_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so logits differ meaningfully
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif arch == "gpt_oss" and "norm" not in name:  # biases and sinks start at ~0: make them count
                p.normal_(0, 1.0 if name.endswith("sinks") else 0.2)
            elif arch in ("nemotron_h", "granitemoehybrid") and name.endswith(
                ("dt_bias", ".D")
            ):  # time steps that decay the state
                p.normal_(0, 1.0)
        if arch in ("deepseek_v3", "glm4_moe_lite"):  # the routing bias is a buffer, zero at init
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
        if arch == "nemotron_h":  # (as DeepSeek-V3's)
            for layer in model.model.layers:
                if hasattr(layer.mixer, "gate"):
                    layer.mixer.gate.e_score_correction_bias.normal_(0, 0.5)
    # small shards: loading must walk a sharded checkpoint
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="200KB")
    return model.eval()


def copy_embedded_tokenizer(path) -> None:
    """The embedded model's tokenizer files into ``path``, so a saved tiny model can be served.

    Where its package is not installed (a GPU machine), ``LLMKIT_TEST_TOKENIZER_DIR`` names a
    folder holding those files (``benchmarks/gpu_check/prepare.sh`` writes one)."""
    import os
    import shutil
    from pathlib import Path

    from llmkit.core.model.loader.source import resolve_model_dir

    src = os.environ.get("LLMKIT_TEST_TOKENIZER_DIR")
    for f in Path(src).iterdir() if src else resolve_model_dir(None).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, Path(path) / f.name)


def tiny_model_dir(path, arch: str = "llama", **overrides):
    """A tiny random-weight model at ``path`` with a tokenizer of its own (the GPU benchmarks'
    byte-level one, 512 ids): servable where the embedded model's package is not installed (a
    GPU machine). Returns ``path``."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from gpu_presets import write_model_dir

    write_model_dir("tiny", Path(path))  # its tokenizer; the config is replaced below
    save_tiny_model(arch, path, **overrides)
    return path


def start_engine(**kwargs) -> Engine:
    kwargs.setdefault("grammar_backend", "none")  # no compiler workers unless a test needs them
    cfg = EngineConfig(**kwargs)
    engine = Engine(cfg, build_engine_parts(cfg))
    engine.start()
    return engine


def load_ours(path, dtype=torch.float32):
    """Our model plugin for the checkpoint at ``path``, weights loaded, on CPU."""
    from llmkit.core.engine.builder import architecture_of, build_model
    from llmkit.core.model.loader.source import iter_safetensors, load_config
    from llmkit.core.plugins import registry

    config = load_config(path)
    model = build_model(registry().model(architecture_of(config)), config, torch.device("cpu"), dtype)
    model.load_weights(iter_safetensors(path))
    quantize.finalize_weights(model)
    return model


def _greedy(engine, rid: str, ids: list[int], n: int) -> tuple[list[int], int]:
    """Greedy tokens (EOS banned, as min_new_tokens does) and the prompt tokens the prefix cache served."""
    import threading

    from llmkit.core.engine.messages import GenerateRequest, SamplingParams

    done, out, cached = threading.Event(), [], []

    def sink(o):
        out.extend(o.token_ids)
        if o.finished:
            cached.append(o.cached_tokens)
            done.set()

    engine.submit(GenerateRequest(rid, ids, SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=0)), sink)
    assert done.wait(300)
    return out, cached[0]


def assert_greedy_matches_generate(ref, model_dir, prompts: list[list[int]], n: int = 32, **engine_kw) -> list[int]:
    """Run ``prompts`` one after another through the real engine on ``model_dir`` (page size 16,
    prefill chunks of 16 tokens, radix cache) and compare ``n`` greedy tokens with transformers'
    ``generate`` on ``ref``: equal, or diverging only where the reference's top-2 logits tie.
    Returns the cached prompt tokens of each request."""
    kw = dict(page_size=16, chunked_prefill_size=16, max_total_tokens=1024, device="cpu", **engine_kw)
    engine = start_engine(model_path=str(model_dir), **kw)
    cached_counts = []
    try:
        for i, ids in enumerate(prompts):
            ours, cached = _greedy(engine, f"greedy-{i}", ids, n)
            cached_counts.append(cached)
            assert_same_as_generate(ref, ids, ours, f"prompt {i}")
    finally:
        engine.shutdown()
    return cached_counts


def assert_same_as_generate(ref, ids: list[int], ours: list[int], label: str) -> None:
    """``ours`` equals ``len(ours)`` greedy tokens of transformers' ``generate`` on ``ref`` after
    ``ids``, or diverges only where the reference's top-2 logits tie."""
    n = len(ours)
    with torch.no_grad():
        gen = ref.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    theirs = gen.sequences[0, len(ids) :].tolist()
    if ours != theirs:
        step = next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        top2 = torch.topk(gen.scores[step][0], 2).values
        assert (top2[0] - top2[1]).item() < 1e-3, f"{label} diverged at step {step} without a tie"
