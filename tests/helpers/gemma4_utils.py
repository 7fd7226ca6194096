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


def write_gguf(ref, path) -> None:
    """``ref`` as llama.cpp's converter writes a ``gemma4`` GGUF (its ``Gemma4Model``): the same
    metadata keys, its tensor names (gguf's name map, and the converter's own for the layer scalar
    and the router's scales), the proportional rope as ``rope_freqs``; F32."""
    import gguf
    import numpy as np

    c = ref.config
    swa_dim, swa_kv = c.per_layer_config[0].head_dim, c.per_layer_config[0].num_key_value_heads  # (layer 0 slides)
    n, types = c.num_hidden_layers, list(c.layer_types)
    full = next(i for i, t in enumerate(types) if t == "full_attention")
    full_dim, full_kv = c.per_layer_config[full].head_dim, c.per_layer_config[full].num_key_value_heads
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_block_count(n)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    wide = [
        c.intermediate_size * (2 if c.use_double_wide_mlp and i >= n - c.num_kv_shared_layers else 1) for i in range(n)
    ]
    w.add_feed_forward_length(wide if c.use_double_wide_mlp else c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    swa = [t == "sliding_attention" for t in types]
    w.add_head_count_kv([swa_kv if s else full_kv for s in swa] if c.attention_k_eq_v else swa_kv)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)
    w.add_shared_kv_layers(c.num_kv_shared_layers)
    w.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input or 0)
    w.add_sliding_window_pattern(swa)
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(swa_dim)
    w.add_value_length_swa(swa_dim)
    w.add_rope_dimension_count(full_dim)
    w.add_rope_dimension_count_swa(swa_dim)
    if c.enable_moe_block:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.top_k_experts)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    rotated = int(full_dim * c.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (full_dim // 2 - rotated), dtype=np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n)
    for name, t in ref.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = np.ascontiguousarray(t.detach().float().numpy())
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("router.scale"):
            w.add_tensor(f"blk.{layer}.ffn_gate_inp.scale", t)
        elif name.endswith("router.per_expert_scale"):
            w.add_tensor(f"blk.{layer}.ffn_down_exps.scale", t)
        else:
            full_name = name + ".weight" if name.endswith("layer_scalar") or name.endswith("_proj") else name
            w.add_tensor(names.get_name(full_name, try_suffixes=(".weight", ".bias")), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
