"""The GGUF side of the Llama-layout families with their own twists (``gguf_loader.py`` calls these):
Mixtral (llama.cpp's ``llama`` with experts), ``phi3`` (fused ``attn_qkv`` and gate/up in ``ffn_up``,
LongRoPE factors as tensors), ``smollm3`` (every fourth layer unrotated, fixed in llama.cpp),
``glm4moe`` (its multi-token-prediction blocks counted in ``block_count``) and ``minimax-m2``
(whole-projection Q/K norms, rotary dimensions as a count). llama.cpp permutes the Q/K rows of the
models its Llama converter writes (Mixtral, SmolLM3); the others are stored as HF has them."""

from __future__ import annotations

import numpy as np

from llmkit.core.model.loader.gguf_file import metadata_field as _field

VARIANT_MODEL_TYPES = {
    "phi3": ("phi3",),
    "smollm3": ("smollm3",),
    "glm4moe": ("glm4_moe",),
    "minimax-m2": ("minimax_m2",),
}
#: model types whose Q/K rows llama.cpp's Llama converter permuted
PERMUTED = ("mixtral", "smollm3")
# tensor kinds beyond the Llama table, per model type
VARIANT_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "glm4_moe": {
        "exp_probs_b": "mlp.gate.e_score_correction_bias",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    },
    "minimax_m2": {"exp_probs_b": "mlp.gate.e_score_correction_bias"},
}


def variant_config(reader, arch: str, p: str, cfg: dict, names: set) -> dict:
    """The config fields of these families that :func:`gguf_config`'s common ones lack (``{}`` for
    another architecture)."""
    rotary = _field(reader, p + "rope.dimension_count")
    experts = _field(reader, p + "expert_count")
    if arch == "llama" and experts:  # Mixtral: softmax top-k over every expert, renormalised
        return {
            "model_type": "mixtral",
            "num_local_experts": int(experts),
            "num_experts_per_tok": int(_field(reader, p + "expert_used_count")),
        }
    if arch == "phi3":
        return _phi3_config(reader, p, cfg, rotary)
    if arch == "smollm3":
        return {"no_rope_layer_interval": 4}
    if arch == "glm4moe":
        nextn = int(_field(reader, p + "nextn_predict_layers", 0))
        return {
            "num_hidden_layers": cfg["num_hidden_layers"] - nextn,  # (the MTP blocks come last)
            "n_routed_experts": int(experts),
            "num_experts_per_tok": int(_field(reader, p + "expert_used_count")),
            "moe_intermediate_size": int(_field(reader, p + "expert_feed_forward_length")),
            "n_shared_experts": int(_field(reader, p + "expert_shared_count", 1)),
            "first_k_dense_replace": int(_field(reader, p + "leading_dense_block_count", 0)),
            "routed_scaling_factor": float(_field(reader, p + "expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(_field(reader, p + "expert_weights_norm", True)),
            "n_group": 1,  # (llama.cpp keeps no expert groups for glm4moe)
            "topk_group": 1,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in names,
            "partial_rotary_factor": int(rotary) / cfg["head_dim"],
        }
    if arch == "minimax-m2":
        return {
            "num_local_experts": int(experts),
            "num_experts_per_tok": int(_field(reader, p + "expert_used_count")),
            "intermediate_size": int(_field(reader, p + "expert_feed_forward_length")),
            "rotary_dim": int(rotary or cfg["head_dim"]),
        }
    return {}


def _phi3_config(reader, p: str, cfg: dict, rotary) -> dict:
    out = {"partial_rotary_factor": int(rotary or cfg["head_dim"]) / cfg["head_dim"]}
    window = _field(reader, p + "attention.sliding_window", 0)
    out["sliding_window"] = int(window) or None  # (0: Phi-4, none)
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if "rope_factors_long.weight" in factors:
        original = int(_field(reader, p + "rope.scaling.original_context_length"))
        rope = {
            "rope_type": "longrope",
            "rope_theta": cfg["rope_theta"],
            "partial_rotary_factor": out["partial_rotary_factor"],
            "original_max_position_embeddings": original,
            "long_factor": np.asarray(factors["rope_factors_long.weight"].data, dtype=np.float32).tolist(),
            "short_factor": np.asarray(factors["rope_factors_short.weight"].data, dtype=np.float32).tolist(),
        }
        attn = _field(reader, p + "rope.scaling.attn_factor")
        if attn is not None:
            rope["attention_factor"] = float(attn)
        out.update(rope_parameters=rope, original_max_position_embeddings=original)
    return out
