"""Real model shapes for benchmarks/bench_gpu.py: config.json as the checkpoints ship it and a
tokenizer with the model's full vocabulary, so a model directory needs no download."""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS, PAD = "<eos>", "<pad>"  # token ids 0 and 1; the rest are t2 .. t{vocab-1}

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
}


def write_model_dir(preset: str, path: Path) -> None:
    """config.json plus a tokenizer whose vocabulary is exactly the model's vocab_size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = dict(PRESETS[preset], bos_token_id=0, eos_token_id=0, pad_token_id=1)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    n = config["vocab_size"]
    vocab = {EOS: 0, PAD: 1, **{f"t{i}": i for i in range(2, n)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)
    assert len(fast) == n, (len(fast), n)
    fast.save_pretrained(str(path))


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]
