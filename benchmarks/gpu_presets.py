"""Real model shapes for benchmarks/bench_gpu.py: config.json as the checkpoints ship it and a
tokenizer with the model's full vocabulary, so a model directory needs no download."""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS, PAD = "<eos>", "<pad>"  # token ids 0 and 1; then the 256 byte symbols, then t258 .. t{vocab-1}

# config.json as the checkpoints ship it (Qwen/Qwen2.5-0.5B-Instruct, meta-llama/Llama-3.1-8B-Instruct),
# with token ids moved to our tokenizer's. Qwen2 has Q/K/V biases by architecture (no config key).
PRESETS = {
    "tiny": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_act="silu",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        use_sliding_window=False,
    ),
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_act="silu",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=21,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        torch_dtype="bfloat16",
    ),
    "smollm2-135m": dict(  # the embedded model's shape, as a Llama safetensors checkpoint
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
            rope_type="llama3",
        ),
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        pretraining_tp=1,
        use_cache=True,
        torch_dtype="bfloat16",
    ),
    # Qwen/Qwen3-30B-A3B
    # Qwen3.5-small-like hybrid (three Gated DeltaNet layers to each gated full-attention one) and
    # Qwen3-0.6B: the hybrid and plain models of about 0.6-0.8B that bench_hybrid_prefix.py compares
    "qwen3.5-0.8b-like": dict(
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        hidden_act="silu",
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True,
    ),
    # Qwen3.6-27B's published trunk (64 layers, hidden 5120, 24 attention heads / 4 KV heads of 256,
    # intermediate 17408); its DeltaNet head counts here (16 key, 48 value heads of 128) as the
    # Qwen3.5 family's larger models have them: "like", not the checkpoint's config
    "qwen3.6-27b-like": dict(
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        hidden_act="silu",
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
    ),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_act="silu",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_act="silu",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        torch_dtype="bfloat16",
    ),
    # openai/gpt-oss-20b (its experts as bf16: --load-format dummy never sees the MXFP4 blocks)
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        attention_bias=True,
        swiglu_limit=7.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling=dict(
            rope_type="yarn",
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
        ),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    # deepseek-ai/DeepSeek-V3 with 5 of its 61 layers (its 3 dense + 2 MoE: 26.6B, fits one 80 GB GPU)
    "deepseek-v3-5l": dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        hidden_act="silu",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=5,
        first_k_dense_replace=3,
        moe_layer_freq=1,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=4096,
        ),
        tie_word_embeddings=False,
        attention_bias=False,
        torch_dtype="bfloat16",
    ),
}


def _byte_symbols() -> list[str]:
    """The 256 characters a byte-level BPE writes for bytes 0-255 (GPT-2's table)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def write_model_dir(preset: str, path: Path) -> None:
    """config.json plus a byte-level BPE tokenizer whose vocabulary is exactly the model's vocab_size.

    Every text tokenizes (a token for each of the 256 bytes) and every id decodes (the rest are
    filler words ``t<id>``), under the tokenizer class transformers picks for the config's
    model_type too: transformers 5 builds a Qwen2Tokenizer for ``qwen2`` from the file's vocab and
    merges with its own byte-level pre-tokenizer, which turned the word-level vocabulary this
    wrote before into zero tokens for any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = dict(PRESETS[preset], bos_token_id=0, eos_token_id=0, pad_token_id=1)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    n = config["vocab_size"]
    symbols = _byte_symbols()
    vocab = {EOS: 0, PAD: 1, **{c: 2 + i for i, c in enumerate(symbols)}}
    vocab.update({f"t{i}": i for i in range(len(vocab), n)})
    tok = Tokenizer(models.BPE(vocab, [], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=PAD)
    assert len(fast) == n, (len(fast), n)
    fast.save_pretrained(str(path))


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]
