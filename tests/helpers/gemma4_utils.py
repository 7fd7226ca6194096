"""Tiny random-weight Gemma 4 checkpoints from transformers' own ``Gemma4TextConfig`` /
``Gemma4Config``: a text model (dense, K = V full layers, K/V shared, MoE, per-layer inputs, or
all at once) and the multimodal class, servable (tokenizer and generation config beside them)."""

from __future__ import annotations

from pathlib import Path

import torch

import gemma3_utils as g3

VOCAB = g3.VOCAB
WINDOW = 8  # shorter than the tests' prompts

# each feature of the family on its own, and all together (the served model)
VARIANTS = {
    "dense": {},
    "k_eq_v": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    "kv_shared": dict(
        num_kv_shared_layers=3,
        use_double_wide_mlp=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"] * 2,
    ),
    "moe": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
    "per_layer_input": dict(hidden_size_per_layer_input=8),
}
VARIANTS["all"] = {k: v for d in VARIANTS.values() for k, v in d.items()}


def text_config_kwargs(**overrides) -> dict:
    """6 layers, 5:1 sliding/full; the full layers' heads twice as wide (``global_head_dim``)."""
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=WINDOW,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB,
        final_logit_softcapping=30.0,
        pad_token_id=g3.PAD,
        bos_token_id=g3.BOS,
        eos_token_id=[g3.EOS, g3.END_OF_TURN],
    )
    kw.update(overrides)
    return kw


def _widen(model) -> None:
    """Random init is tiny and Gemma 4's norms start at one: spread them so logits differ."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif "norm" in name or "scale" in name:
                p.normal_(1, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.9)


def _finish(model, path: Path):
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="200KB")
    g3.write_tokenizer(path)
    g3._write_generation_config(path)
    return model.eval()


def save_tiny_gemma4_text(path, variant: str = "dense", **overrides):
    """A servable random-weight ``Gemma4ForCausalLM`` (model_type gemma4_text) at ``path``;
    returns the transformers model (fp32, eval)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma4TextConfig(**text_config_kwargs(**{**VARIANTS[variant], **overrides}))
    model = transformers.Gemma4ForCausalLM(cfg).to(torch.float32)
    _widen(model)
    return _finish(model, Path(path))


def save_tiny_gemma4(path, variant: str = "dense"):
    """A random-weight ``Gemma4ForConditionalGeneration`` (model_type gemma4: a tiny vision tower
    beside the text model, no audio tower); returns the transformers model (fp32, eval)."""
    import transformers

    torch.manual_seed(0)
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    cfg = transformers.Gemma4Config(
        text_config=transformers.Gemma4TextConfig(**text_config_kwargs(**VARIANTS[variant])),
        vision_config=vision,
        audio_config=None,
    )
    model = transformers.Gemma4ForConditionalGeneration(cfg).to(torch.float32)
    _widen(model)
    return _finish(model, Path(path))
