"""Tiny random-weight checkpoints of the 2026 breadth families (Mistral, Mixtral, Phi-3, SmolLM3,
OLMo 2/3, Granite, GLM-4.5, MiniMax-M2), from the installed transformers' own configs."""

from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    pad_token_id=None,
    bos_token_id=1,
    eos_token_id=2,  # (the engine bans EOS in these tests, as generate does with min_new_tokens)
)


def tiny_config(arch: str, **overrides):
    import transformers

    c = dict(COMMON)
    if arch == "mistral":
        # a window of 16: the tests' prompts outgrow it
        return transformers.MistralConfig(**{**c, "sliding_window": 16, **overrides})
    if arch in ("mistral3", "ministral3-vl"):
        # Mistral Small 3.1's layout: a Mistral text model behind a (tiny) Pixtral tower, untied;
        # Ministral 3's: its own text model there
        if arch == "mistral3":
            text = transformers.MistralConfig(**{**c, "sliding_window": None, **overrides}).to_dict()
        else:
            text = tiny_config("ministral3", **overrides).to_dict()
        vision = transformers.PixtralVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ).to_dict()
        return transformers.Mistral3Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if arch == "ministral3":
        # Ministral 3's YaRN rope and Llama 4 query scaling, from position 16 on (the prompts pass it)
        rope = dict(rope_type="yarn", rope_theta=10000.0, factor=16.0, original_max_position_embeddings=16)
        rope.update(beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)
        return transformers.Ministral3Config(**{**c, "sliding_window": None, "rope_parameters": rope, **overrides})
    if arch == "mixtral":
        kw = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=None)
        return transformers.MixtralConfig(**{**c, **kw, **overrides})
    if arch == "phi3":
        # Phi-4-mini's shape: rotary on 3/4 of each head, LongRoPE with per-channel factors (the
        # short ones apply within original_max_position_embeddings, where the tests stay)
        rot = 12  # of head_dim 16
        short = [1.0 + 0.25 * i for i in range(rot // 2)]
        long = [2.0 + 0.5 * i for i in range(rot // 2)]
        rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75)
        rope.update(short_factor=short, long_factor=long, original_max_position_embeddings=64)
        kw = dict(rope_parameters=rope, original_max_position_embeddings=64, max_position_embeddings=256)
        return transformers.Phi3Config(**{**c, **kw, **overrides})
    if arch == "smollm3":
        # 4 layers: the 4th unrotated (NoPE); tied embeddings as SmolLM3-3B
        kw = dict(num_hidden_layers=4, no_rope_layer_interval=4, tie_word_embeddings=True)
        return transformers.SmolLM3Config(**{**c, **kw, **overrides})
    if arch == "olmo2":
        return transformers.Olmo2Config(**{**c, **overrides})
    if arch == "olmo3":
        # sliding, full, sliding (window 16, the prompts outgrow it); the full layer's rope scaled
        types = ["sliding_attention", "full_attention", "sliding_attention"]
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
        kw = dict(num_hidden_layers=3, layer_types=types, sliding_window=16, rope_parameters=rope)
        return transformers.Olmo3Config(**{**c, **kw, **overrides})
    if arch == "granite":
        kw = dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0)
        return transformers.GraniteConfig(**{**c, **kw, **overrides})
    if arch == "glm4_moe":
        # layer 0 dense, layers 1-2 MoE: 8 experts in 4 groups, top-2 within the best 2 groups, a
        # shared expert, scaled by 2.5; Q/K/V bias, per-head Q/K norms, rotary on half of each head
        kw = dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
        kw.update(n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, n_shared_experts=1)
        kw.update(attention_bias=True, use_qk_norm=True, head_dim=32)
        return transformers.Glm4MoeConfig(**{**c, **kw, **overrides})
    if arch == "minimax_m2":
        # head_dim 32 with rotary on 16 of it (the released rotary_dim field), 4 experts, top-2
        kw = dict(head_dim=32, rotary_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
        return transformers.MiniMaxM2Config(**{**c, **kw, **overrides})
    raise ValueError(arch)


def save_tiny(arch: str, path, **overrides):
    """The tiny model saved as safetensors (small shards) with the embedded model's tokenizer, so
    the engine can serve it; returns transformers' model (eval mode)."""
    import transformers

    from model_utils import copy_embedded_tokenizer

    torch.manual_seed(0)
    config = tiny_config(arch, **overrides)
    vl = arch in ("mistral3", "ministral3-vl")
    auto = transformers.AutoModelForImageTextToText if vl else transformers.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so logits differ meaningfully
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5)
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="200KB")
    copy_embedded_tokenizer(path)
    return model.eval()


IDS = [(37 * i + 11) % 512 for i in range(56)]
