"""The families' own side of the GGUF converter (``gguf_loader.py``): llama.cpp's metadata for
DeepSeek (``deepseek2``), and its names and metadata for the hybrids (the Qwen hybrids ``qwen35``,
``qwen35moe``, ``qwen3next``; ``lfm2``; ``nemotron_h`` / ``nemotron_h_moe``; ``granitehybrid``),
with the transforms its converter applied to their tensors, undone."""

from __future__ import annotations

import numpy as np

from llmkit.core.model.loader.gguf_file import metadata_field as _field

# The Qwen hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): Gated DeltaNet tensors, gated shared experts
QWEN_HYBRID_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# LFM2: its short convolutions (one GGUF kind, ``shortconv``, for the three tensors), its attention
# and feed-forward under LFM2's own HF names; ``token_embd_norm`` is its final norm (see gguf_tensors)
LFM2_NAMES = {
    "shortconv": "conv",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "attn_norm": "operator_norm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
}
# Nemotron-H: one norm and one mixer a block (Mamba2, attention or the ReLU² MLP), under its HF
# names; ssm_a / ssm_d / ssm_dt have no suffix in HF's names (see mamba2_tensor)
NEMOTRON_H_NAMES = {
    "attn_norm": "norm",
    "ssm_in": "mixer.in_proj",
    "ssm_conv1d": "mixer.conv1d",
    "ssm_dt": "mixer.dt_bias",
    "ssm_a": "mixer.A_log",
    "ssm_d": "mixer.D",
    "ssm_norm": "mixer.norm",
    "ssm_out": "mixer.out_proj",
    "attn_q": "mixer.q_proj",
    "attn_k": "mixer.k_proj",
    "attn_v": "mixer.v_proj",
    "attn_output": "mixer.o_proj",
    "ffn_up": "mixer.up_proj",
    "ffn_down": "mixer.down_proj",
    # nemotron_h_moe: the router, its selection bias, the shared expert, the latent projections
    # (the stacked experts go through _EXPERT_NAMES)
    "ffn_gate_inp": "mixer.gate",
    "exp_probs_b": "mixer.gate.e_score_correction_bias",
    "ffn_up_shexp": "mixer.shared_experts.up_proj",
    "ffn_down_shexp": "mixer.shared_experts.down_proj",
    "ffn_latent_down": "mixer.fc1_latent_proj",
    "ffn_latent_up": "mixer.fc2_latent_proj",
}
# Granite 4.0-H: Mamba2 tensors as Nemotron-H's (see mamba2_tensor), the MoE's router and shared
# expert (a dense model's feed-forward, ffn_gate/up/down, is its shared expert too)
GRANITE_HYBRID_NAMES = {
    **{k: v.replace("mixer.", "mamba.") for k, v in NEMOTRON_H_NAMES.items() if k.startswith("ssm_")},
    "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_gate_shexp": "shared_mlp.gate_proj",
    "ffn_up_shexp": "shared_mlp.up_proj",
    "ffn_down_shexp": "shared_mlp.down_proj",
    "ffn_gate": "shared_mlp.gate_proj",
    "ffn_up": "shared_mlp.up_proj",
    "ffn_down": "shared_mlp.down_proj",
}


def qwen_hybrid_config(reader, p: str, cfg: dict) -> dict:
    """llama.cpp's qwen35 / qwen35moe / qwen3next metadata: the DeltaNet sizes as its ssm.* keys
    (one head size for keys and values), the layer kinds as recurrent flags or an interval, the
    rotary width as a dimension count."""
    n = cfg["num_hidden_layers"]
    recurrent = _field(reader, p + "attention.recurrent_layers")
    if recurrent is None:
        every = int(_field(reader, p + "full_attention_interval", 4))
        recurrent = [(i + 1) % every != 0 for i in range(n)]
    state = int(_field(reader, p + "ssm.state_size"))
    rotary = int(_field(reader, p + "rope.dimension_count", cfg["head_dim"]))
    out = {
        "layer_types": ["linear_attention" if r else "full_attention" for r in list(recurrent)[:n]],
        "linear_conv_kernel_dim": int(_field(reader, p + "ssm.conv_kernel")),
        "linear_key_head_dim": state,
        "linear_value_head_dim": state,
        "linear_num_key_heads": int(_field(reader, p + "ssm.group_count")),
        "linear_num_value_heads": int(_field(reader, p + "ssm.time_step_rank")),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg["rope_theta"],
            "partial_rotary_factor": rotary / cfg["head_dim"],
        },
    }
    experts = _field(reader, p + "expert_count")
    if experts:
        out.update(
            num_experts=int(experts),
            num_experts_per_tok=int(_field(reader, p + "expert_used_count")),
            moe_intermediate_size=int(_field(reader, p + "expert_feed_forward_length")),
            shared_expert_intermediate_size=int(_field(reader, p + "expert_shared_feed_forward_length", 0)),
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return out


def lfm2_config(reader, p: str, cfg: dict, per_layer_kv: list | None) -> dict:
    """llama.cpp's lfm2 metadata: a layer without KV heads is a short convolution; the kernel is
    ``shortconv.l_cache``; the feed-forward width is stored already adjusted (the adjustment off)."""
    n = cfg["num_hidden_layers"]
    kv = per_layer_kv if per_layer_kv else [cfg["num_key_value_heads"]] * n
    return {
        "layer_types": ["full_attention" if h else "conv" for h in kv[:n]],
        "conv_L_cache": int(_field(reader, p + "shortconv.l_cache")),
        "norm_eps": cfg["rms_norm_eps"],
        "block_auto_adjust_ff_dim": False,
    }


def nemotron_h_config(reader, p: str, cfg: dict, per_layer_kv, per_layer_ffn, names: set) -> dict:
    """llama.cpp's nemotron_h / nemotron_h_moe metadata: a layer with KV heads is attention, one with
    a feed-forward width the MLP (the MoE in nemotron_h_moe), any other Mamba2 (as llama.cpp tells
    them); the Mamba2 sizes as its ssm.* keys (``time_step_rank``: the heads, ``inner_size``: heads x
    head size); the MoE's as its expert_* keys (no group limit unless ``expert_group_used_count``
    says one: the converter writes only the group count)."""
    n = cfg["num_hidden_layers"]
    kv = per_layer_kv or [cfg["num_key_value_heads"]] * n
    ffn = per_layer_ffn or [0] * n
    heads = int(_field(reader, p + "ssm.time_step_rank"))
    experts = _field(reader, p + "expert_count")
    ff = "E" if experts else "-"
    moe = {}
    if experts:
        width = _field(reader, p + "expert_feed_forward_length")
        groups = int(_field(reader, p + "expert_group_count", 1) or 1)
        latent = _field(reader, p + "moe_latent_size")
        moe = {
            "n_routed_experts": int(experts),
            "num_experts_per_tok": int(_field(reader, p + "expert_used_count")),
            "moe_intermediate_size": int(max(width) if isinstance(width, list) else width),
            "moe_shared_expert_intermediate_size": int(_field(reader, p + "expert_shared_feed_forward_length")),
            "norm_topk_prob": bool(_field(reader, p + "expert_weights_norm", True)),
            "routed_scaling_factor": float(_field(reader, p + "expert_weights_scale", 1.0)),
            "n_group": groups,
            "topk_group": int(_field(reader, p + "expert_group_used_count", groups) or groups),
            "moe_latent_size": int(latent) if latent else None,
        }
    return {
        **moe,
        "hybrid_override_pattern": "".join("*" if kv[i] else ff if ffn[i] else "M" for i in range(n)),
        "mamba_num_heads": heads,
        "mamba_head_dim": int(_field(reader, p + "ssm.inner_size")) // heads,
        "ssm_state_size": int(_field(reader, p + "ssm.state_size")),
        "n_groups": int(_field(reader, p + "ssm.group_count")),
        "conv_kernel": int(_field(reader, p + "ssm.conv_kernel")),
        "use_conv_bias": any(t.endswith(".ssm_conv1d.bias") for t in names),
        "layer_norm_epsilon": cfg["rms_norm_eps"],
        "mlp_hidden_act": "relu2",
    }


def granite_hybrid_config(reader, p: str, cfg: dict, per_layer_kv, names: set) -> dict:
    """llama.cpp's granitehybrid metadata: a layer with KV heads is attention, any other Mamba2; rope
    only where ``rope.scaling.finetuned`` says so (its default true, as llama.cpp reads it; the
    converter writes false for Granite 4.0-H); Granite's four multipliers as its scale keys; the
    experts' width as the feed-forward length, the shared expert's as the shared one (a dense
    model's: the feed-forward length)."""
    n = cfg["num_hidden_layers"]
    kv = per_layer_kv or [cfg["num_key_value_heads"]] * n
    heads, inner = int(_field(reader, p + "ssm.time_step_rank")), int(_field(reader, p + "ssm.inner_size"))
    experts = int(_field(reader, p + "expert_count", 0) or 0)
    out = {
        "layer_types": ["attention" if kv[i] else "mamba" for i in range(n)],
        "mamba_n_heads": heads,
        "mamba_d_head": inner // heads,
        "mamba_expand": inner // cfg["hidden_size"],
        "mamba_d_state": int(_field(reader, p + "ssm.state_size")),
        "mamba_n_groups": int(_field(reader, p + "ssm.group_count")),
        "mamba_d_conv": int(_field(reader, p + "ssm.conv_kernel")),
        "mamba_conv_bias": any(t.endswith(".ssm_conv1d.bias") for t in names),
        "position_embedding_type": "rope" if _field(reader, p + "rope.scaling.finetuned", True) else "nope",
        "embedding_multiplier": float(_field(reader, p + "embedding_scale", 1.0)),
        "residual_multiplier": float(_field(reader, p + "residual_scale", 1.0)),
        "logits_scaling": float(_field(reader, p + "logit_scale", 1.0)),
        "num_local_experts": experts,
        "shared_intermediate_size": int(
            _field(reader, p + "expert_shared_feed_forward_length", cfg["intermediate_size"])
        ),
    }
    scale = _field(reader, p + "attention.scale")
    if scale:
        out["attention_multiplier"] = float(scale)
    if experts:
        out["num_experts_per_tok"] = int(_field(reader, p + "expert_used_count"))
    return out


def mamba2_tensor(kind: str, w: np.ndarray) -> np.ndarray:
    """A Mamba2 tensor (nemotron_h, granitehybrid) back in the checkpoint's form: ``A_log`` from ``-exp(A_log)``, and ``A``,
    ``D`` and the grouped norm's weight (``[heads, 1]``, ``[groups, channels / groups]``) flat."""
    if kind == "ssm_a":
        return np.log(-w).reshape(-1)
    if kind in ("ssm_d", "ssm_norm"):
        return w.reshape(-1)
    return w


def untile_v_heads(w: np.ndarray, axis: int, num_k: int, per_k: int, head: int) -> np.ndarray:
    """Invert llama.cpp's qwen35 reordering of value heads along ``axis``: it stores them tiled over
    the key heads (v0 of every key head, then v1...) where the checkpoint groups them by key head."""
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(per_k, num_k, head, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(w, 0, axis))


def qwen_hybrid_tensor(kind: str, w: np.ndarray, config: dict, tiled: bool) -> np.ndarray:
    """A qwen35 / qwen3next tensor back in the checkpoint's form: zero-centred norms less the one
    llama.cpp added, ``A_log`` from ``-exp(A_log)``, and (``tiled``: qwen35's) value heads grouped."""
    if kind in ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm"):
        return w - 1.0
    if kind == "ssm_a":
        w = np.log(-w)
    if not tiled or config["linear_num_value_heads"] == config["linear_num_key_heads"]:
        return w
    nk, dv = config["linear_num_key_heads"], config["linear_value_head_dim"]
    per_k = config["linear_num_value_heads"] // nk
    qk = 2 * nk * config["linear_key_head_dim"]
    if kind in ("attn_qkv", "ssm_conv1d"):  # only the value rows (channels) move
        return np.concatenate([w[:qk], untile_v_heads(w[qk:], 0, nk, per_k, dv)])
    if kind == "attn_gate":
        return untile_v_heads(w, 0, nk, per_k, dv)
    if kind in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
        return untile_v_heads(w, 0, nk, per_k, 1)
    if kind == "ssm_out":
        return untile_v_heads(w, 1, nk, per_k, dv)
    return w


def deepseek_config(reader, p: str) -> dict:
    # expert_gating_func 2 (sigmoid) is V3's routing, 1 (softmax) V2's
    sigmoid = int(_field(reader, p + "expert_gating_func", 1)) == 2
    rope = int(_field(reader, p + "rope.dimension_count"))
    key = _field(reader, p + "attention.key_length_mla") or _field(reader, p + "attention.key_length")
    value = _field(reader, p + "attention.value_length_mla") or _field(reader, p + "attention.value_length")
    groups = int(_field(reader, p + "expert_group_count", 1) or 1)
    cfg = {
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "q_lora_rank": int(_field(reader, p + "attention.q_lora_rank", 0)) or None,
        "kv_lora_rank": int(_field(reader, p + "attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(key) - rope,
        "v_head_dim": int(value),
        "n_routed_experts": int(_field(reader, p + "expert_count")),
        "num_experts_per_tok": int(_field(reader, p + "expert_used_count")),
        "moe_intermediate_size": int(_field(reader, p + "expert_feed_forward_length")),
        "n_shared_experts": int(_field(reader, p + "expert_shared_count", 0)),
        "first_k_dense_replace": int(_field(reader, p + "leading_dense_block_count", 0)),
        "routed_scaling_factor": float(_field(reader, p + "expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(_field(reader, p + "expert_weights_norm", False)),
        "n_group": groups,
        "topk_group": int(_field(reader, p + "expert_group_used_count", 1) or 1),
        "topk_method": "noaux_tc" if sigmoid else ("group_limited_greedy" if groups > 1 else "greedy"),
        "scoring_func": "sigmoid" if sigmoid else "softmax",
        "rope_interleave": True,  # llama.cpp's deepseek2 rotates adjacent pairs, as the checkpoints do
    }
    factor = _field(reader, p + "rope.scaling.factor")
    if factor and float(factor) > 1:
        # llama.cpp keeps 0.1 * mscale_all_dim as yarn_log_multiplier
        mscale = float(_field(reader, p + "rope.scaling.yarn_log_multiplier", 0.1)) / 0.1
        cfg["rope_scaling"] = dict(
            type="yarn",
            factor=float(factor),
            original_max_position_embeddings=int(_field(reader, p + "rope.scaling.original_context_length")),
            beta_fast=32,
            beta_slow=1,
            mscale=mscale,
            mscale_all_dim=mscale,
        )
    return cfg
