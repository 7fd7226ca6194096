"""Read a GGUF file into a Hugging Face layout: ``config.json`` fields and HF-named fp32 tensors.

llama.cpp's converter permutes the Q and K projection rows of Llama-family models to match its
rotary layout; we undo that here so the weights fit HF-style (rotate-half) rotary embeddings.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

# GGUF architectures whose tensors this converter maps to the HF llama layout, and the HF
# model_types each becomes (the first is written; deepseek2 names V3 or V2 by its gating). The config
# it writes names only the model_type; the model plugin that declares that type serves it.
GGUF_MODEL_TYPES = {
    "llama": ("llama",),
    "qwen2": ("qwen2",),
    "qwen3": ("qwen3",),
    "qwen3moe": ("qwen3_moe",),
    "gpt-oss": ("gpt_oss",),
    "deepseek2": ("deepseek_v2", "deepseek_v3"),
    "qwen35": ("qwen3_5_text",),
    "qwen35moe": ("qwen3_5_moe_text",),
    "qwen3next": ("qwen3_next",),
    "lfm2": ("lfm2",),
    "nemotron_h": ("nemotron_h",),
    "nemotron_h_moe": ("nemotron_h",),
    "granitehybrid": ("granitemoehybrid",),
}
QWEN_HYBRID_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
# stacked expert tensors [E, out, in], split into the HF per-expert names
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
}
# gpt-oss names a few of them differently
_GPT_OSS_NAMES = {"ffn_gate_inp": "mlp.router", "post_attention_norm": "post_attention_layernorm"}
# The Qwen hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): Gated DeltaNet tensors, gated shared experts
_QWEN_HYBRID_NAMES = {
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
_LFM2_NAMES = {
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
# names; ssm_a / ssm_d / ssm_dt have no suffix in HF's names (see _mamba2_tensor)
_NEMOTRON_H_NAMES = {
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
# Granite 4.0-H: Mamba2 tensors as Nemotron-H's (see _mamba2_tensor), the MoE's router and shared
# expert (a dense model's feed-forward, ffn_gate/up/down, is its shared expert too)
_GRANITE_HYBRID_NAMES = {
    **{k: v.replace("mixer.", "mamba.") for k, v in _NEMOTRON_H_NAMES.items() if k.startswith("ssm_")},
    "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_gate_shexp": "shared_mlp.gate_proj",
    "ffn_up_shexp": "shared_mlp.up_proj",
    "ffn_down_shexp": "shared_mlp.down_proj",
    "ffn_gate": "shared_mlp.gate_proj",
    "ffn_up": "shared_mlp.up_proj",
    "ffn_down": "shared_mlp.down_proj",
}
# DeepSeek's MLA and shared experts (attn_k_b / attn_v_b, llama.cpp's split of kv_b_proj, are
# joined again in gguf_tensors)
_DEEPSEEK_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader) -> dict:
    """The HF ``config.json`` equivalent of a GGUF's metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_MODEL_TYPES:
        raise ValueError(f"GGUF architecture '{arch}' is not supported; supported: {sorted(GGUF_MODEL_TYPES)}")
    p = f"{arch}."
    names = {t.name for t in reader.tensors}
    heads = _field(reader, p + "attention.head_count")
    heads = int(max(heads) if isinstance(heads, list) else heads)
    hidden = int(_field(reader, p + "embedding_length"))
    vocab = _field(reader, p + "vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    ffn = _field(reader, p + "feed_forward_length", _field(reader, p + "expert_feed_forward_length"))
    kv_heads = _field(reader, p + "attention.head_count_kv", heads)  # (LFM2: one a layer, 0 for a conv)
    per_layer_kv = kv_heads if isinstance(kv_heads, list) else None
    per_layer_ffn = ffn if isinstance(ffn, list) else None  # (Nemotron-H: 0 but for its MLP layers)
    cfg = {
        "model_type": GGUF_MODEL_TYPES[arch][0],
        "hidden_size": hidden,
        "intermediate_size": int(max(ffn)) if per_layer_ffn else int(ffn),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(max(per_layer_kv)) if per_layer_kv else int(kv_heads),
        "head_dim": int(_field(reader, p + "attention.key_length", hidden // heads)),
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        cfg["attention_bias"] = True
    if arch == "gpt-oss":
        # llama.cpp's gpt-oss: YaRN rope, sliding window on even layers, SwiGLU clamp 7 / alpha 1.702
        cfg.update(
            num_local_experts=int(_field(reader, p + "expert_count")),
            num_experts_per_tok=int(_field(reader, p + "expert_used_count")),
            intermediate_size=int(_field(reader, p + "expert_feed_forward_length")),
            sliding_window=int(_field(reader, p + "attention.sliding_window", 128)),
            attention_bias=True,
            swiglu_limit=7.0,
            rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        )
        factor = _field(reader, p + "rope.scaling.factor")
        if factor:
            cfg["rope_scaling"] = dict(
                rope_type="yarn",
                factor=float(factor),
                original_max_position_embeddings=int(_field(reader, p + "rope.scaling.original_context_length")),
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            )
    if arch == "deepseek2":
        cfg.update(_deepseek_config(reader, p))
    if arch in QWEN_HYBRID_ARCHS:
        cfg.update(_qwen_hybrid_config(reader, p, cfg))
    if arch == "lfm2":
        cfg.update(_lfm2_config(reader, p, cfg, per_layer_kv))
    if arch in ("nemotron_h", "nemotron_h_moe"):
        cfg.update(_nemotron_h_config(reader, p, cfg, per_layer_kv, per_layer_ffn, names))
    if arch == "granitehybrid":
        cfg.update(_granite_hybrid_config(reader, p, cfg, per_layer_kv, names))
    if arch == "qwen3moe":
        # llama.cpp's qwen3moe always renormalises the top-k weights (Qwen3-MoE's norm_topk_prob)
        cfg.update(
            num_experts=int(_field(reader, p + "expert_count")),
            num_experts_per_tok=int(_field(reader, p + "expert_used_count")),
            moe_intermediate_size=int(_field(reader, p + "expert_feed_forward_length")),
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return cfg


def _qwen_hybrid_config(reader, p: str, cfg: dict) -> dict:
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


def _lfm2_config(reader, p: str, cfg: dict, per_layer_kv: list | None) -> dict:
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


def _nemotron_h_config(reader, p: str, cfg: dict, per_layer_kv, per_layer_ffn, names: set) -> dict:
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


def _granite_hybrid_config(reader, p: str, cfg: dict, per_layer_kv, names: set) -> dict:
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


def _mamba2_tensor(kind: str, w: np.ndarray) -> np.ndarray:
    """A Mamba2 tensor (nemotron_h, granitehybrid) back in the checkpoint's form: ``A_log`` from ``-exp(A_log)``, and ``A``,
    ``D`` and the grouped norm's weight (``[heads, 1]``, ``[groups, channels / groups]``) flat."""
    if kind == "ssm_a":
        return np.log(-w).reshape(-1)
    if kind in ("ssm_d", "ssm_norm"):
        return w.reshape(-1)
    return w


def _untile_v_heads(w: np.ndarray, axis: int, num_k: int, per_k: int, head: int) -> np.ndarray:
    """Invert llama.cpp's qwen35 reordering of value heads along ``axis``: it stores them tiled over
    the key heads (v0 of every key head, then v1...) where the checkpoint groups them by key head."""
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(per_k, num_k, head, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(w, 0, axis))


def _qwen_hybrid_tensor(kind: str, w: np.ndarray, config: dict, tiled: bool) -> np.ndarray:
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
        return np.concatenate([w[:qk], _untile_v_heads(w[qk:], 0, nk, per_k, dv)])
    if kind == "attn_gate":
        return _untile_v_heads(w, 0, nk, per_k, dv)
    if kind in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
        return _untile_v_heads(w, 0, nk, per_k, 1)
    if kind == "ssm_out":
        return _untile_v_heads(w, 1, nk, per_k, dv)
    return w


def _deepseek_config(reader, p: str) -> dict:
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


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (interleaved pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name.startswith("blk."):
        _, idx, kind, suffix = name.split(".", 3)
        if kind in _LAYER_NAMES:
            return f"model.layers.{idx}.{_LAYER_NAMES[kind]}.{suffix}"
    return None


def gguf_tensors(reader, config: dict, native: bool = False) -> Iterator[tuple[str, object]]:
    """Yield ``(hf_name, fp32 tensor)`` for every weight, dequantized. With ``native``, the weights of
    a type served quantized (:data:`~llmkit.core.model.quant.gguf_quant.SUPPORTED_TYPES`) come as
    :class:`~llmkit.core.model.quant.gguf_quant.GGUFTensor` over the file's blocks instead: Q/K rows
    unpermuted and stacked experts split per expert, both of which move whole rows of blocks, and
    each expert's gate and up tensors yielded in turn (its gate/up layer packs as soon as both are
    in, so one expert's staging is resident at a time, not a whole stacked tensor's)."""
    conv = _Converter(config, native)
    by_name = {t.name: t for t in reader.tensors}
    early: set[str] = set()  # up tensors yielded beside their gate tensors
    for t in reader.tensors:
        if t.name in early:
            continue
        up = by_name.get(t.name.replace(".ffn_gate_exps.", ".ffn_up_exps.")) if ".ffn_gate_exps." in t.name else None
        if up is not None and conv.kept(t) and conv.kept(up):
            for pair in zip(conv(t), conv(up)):
                yield from pair
            early.add(up.name)
            continue
        yield from conv(t)


class _Converter:
    """GGUF tensors to HF-named ones (see :func:`gguf_tensors`); holds the halves of DeepSeek's
    split ``kv_b_proj`` until both are read."""

    def __init__(self, config: dict, native: bool) -> None:
        from llmkit.core.model.quant.gguf_quant import SUPPORTED_TYPES

        self.config, self.native, self.types = config, native, SUPPORTED_TYPES
        self.names = {**_LAYER_NAMES, **(_GPT_OSS_NAMES if config["model_type"] == "gpt_oss" else {})}
        if config["model_type"] in ("deepseek_v2", "deepseek_v3"):
            self.names.update(_DEEPSEEK_NAMES)
        self.lfm2 = config["model_type"] == "lfm2"
        if self.lfm2:
            self.names.update(_LFM2_NAMES)
        self.nemotron_h = config["model_type"] == "nemotron_h"
        if self.nemotron_h:
            self.names.update(_NEMOTRON_H_NAMES)
        self.granite = config["model_type"] == "granitemoehybrid"
        if self.granite:
            self.names.update(_GRANITE_HYBRID_NAMES)
        self.mamba2 = self.nemotron_h or self.granite  # (A, D, the grouped norm: _mamba2_tensor)
        self.hybrid = config["model_type"] in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
        if self.hybrid:
            self.names.update(_QWEN_HYBRID_NAMES)
        self.split_kv_b: dict[str, dict[str, np.ndarray]] = {}  # layer -> attn_k_b / attn_v_b seen so far

    def kept(self, t) -> bool:
        """Whether ``t`` stays quantized: native loading of a served type (llama.cpp's split
        ``attn_k_b`` / ``attn_v_b`` are joined and transposed, so always dequantized)."""
        kind = _block_kind(t.name)
        return self.native and t.tensor_type.name in self.types and kind not in ("attn_k_b", "attn_v_b")

    def __call__(self, t) -> Iterator[tuple[str, object]]:
        """The HF-named tensors of GGUF tensor ``t``: none, one, or one per expert."""
        from gguf.quants import dequantize

        from llmkit.core.model.quant.gguf_quant import GGUFTensor

        config, names = self.config, self.names
        # (llama.cpp permutes Granite's Q/K rows too, whether or not it rotates them)
        permute = config["model_type"] in ("llama", "granitemoehybrid")
        shape = [int(x) for x in reversed(t.shape)]
        kept = self.kept(t)
        if kept:
            w = t.data.reshape(*shape[:-1], -1)  # rows of blocks: [..., rows, bytes a row]
        else:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)

        def out(hf: str, w: np.ndarray):
            if kept:
                return hf, GGUFTensor(t.name, t.tensor_type.name, w, shape[-1])
            w = np.ascontiguousarray(w)
            if not w.flags.writeable:  # an F32 tensor is a read-only view of the memory-mapped file
                w = w.copy()  # (torch.from_numpy would warn about it at every first start)
            return hf, torch.from_numpy(w)

        name = t.name
        if self.hybrid and not kept and name.startswith("blk."):
            tiled = config["model_type"] != "qwen3_next"  # (qwen35's converter reorders value heads)
            w = _qwen_hybrid_tensor(name.split(".")[2], w, config, tiled)
        elif self.mamba2 and not kept and name.startswith("blk."):
            w = _mamba2_tensor(name.split(".")[2], w)
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "token_embd_norm.weight" and self.lfm2:  # (llama.cpp's name for its final norm)
            hf = "model.embedding_norm.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
            if self.hybrid:
                w = w - 1.0
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, kind, *rest = name.split(".", 3)
            suffix = rest[0] if rest else ""  # (llama.cpp's ssm_a has none)
            if kind in _EXPERT_NAMES:
                # (Nemotron-H's MoE is its block's mixer; Granite's stacks them as one tensor in HF)
                block = "mixer" if self.nemotron_h else "block_sparse_moe" if self.granite else "mlp"
                for e in range(w.shape[0]):
                    yield out(f"model.layers.{idx}.{block}.experts.{e}.{_EXPERT_NAMES[kind]}.{suffix}", w[e])
                return
            if kind == "attn_sinks":  # one logit per head, no ".weight" in HF's name
                hf = f"model.layers.{idx}.self_attn.sinks"
            elif kind == "exp_probs_b" or (kind in ("ssm_a", "ssm_dt") and (self.hybrid or self.mamba2)):
                hf = f"model.layers.{idx}.{names[kind]}"  # (no suffix in HF's name)
            elif kind == "ssm_d" and self.mamba2:
                hf = f"model.layers.{idx}.{names[kind]}"
            elif kind in ("attn_k_b", "attn_v_b"):
                # k_b [heads, kv_lora_rank, nope] (kv_b_proj's K rows, transposed), v_b [heads, v, rank]
                halves = self.split_kv_b.setdefault(idx, {})
                halves[kind] = w
                if len(halves) < 2:
                    return
                del self.split_kv_b[idx]
                kb, vb = halves["attn_k_b"].transpose(0, 2, 1), halves["attn_v_b"]
                w = np.concatenate([kb, vb], axis=1).reshape(-1, vb.shape[-1])
                hf = f"model.layers.{idx}.self_attn.kv_b_proj.weight"
            elif kind not in names:
                return
            else:
                hf = f"model.layers.{idx}.{names[kind]}.{suffix}"
            if permute and kind == "attn_q" and suffix == "weight":  # (whole rows: blocks move with them)
                w = np.ascontiguousarray(_unpermute(w, config["num_attention_heads"]))
            elif permute and kind == "attn_k" and suffix == "weight":
                w = np.ascontiguousarray(_unpermute(w, config["num_key_value_heads"]))
        else:
            return
        yield out(hf, w)


def _block_kind(name: str) -> str:
    """A ``blk.N.KIND.suffix`` tensor's KIND (``ffn_gate_exps``...); "" for the others."""
    return name.split(".")[2] if name.startswith("blk.") else ""


def _served(name: str) -> bool:
    """Whether the GGUF tensor ``name`` is one :func:`gguf_tensors` keeps quantized when it can."""
    kind = _block_kind(name)
    return (
        _hf_name(name) is not None
        or kind in _EXPERT_NAMES
        or kind in _DEEPSEEK_NAMES
        or kind in _GPT_OSS_NAMES
        or kind in _LFM2_NAMES
        or kind in _NEMOTRON_H_NAMES
        or kind in _GRANITE_HYBRID_NAMES
    )


# Expert tensor types served dequantized at native precision: gpt-oss's MXFP4 experts (an E2M1
# grid with power-of-two scales, which int4's affine groups do not hold exactly), as its
# safetensors checkpoints are.
DEQUANTIZED_EXPERT_TYPES = ("MXFP4",)


def check_native_types(reader) -> None:
    """Fail before loading anything if a weight's type cannot be served quantized."""
    from llmkit.core.model.quant.gguf_quant import DENSE_TYPES, SUPPORTED_TYPES

    for t in reader.tensors:
        kind = t.tensor_type.name
        if not _served(t.name) or kind in SUPPORTED_TYPES + DENSE_TYPES:
            continue
        if kind in DEQUANTIZED_EXPERT_TYPES and _block_kind(t.name) in _EXPERT_NAMES:
            continue
        raise ValueError(
            f"GGUF tensor '{t.name}' has type {kind}, which llmkit cannot serve quantized; "
            f"supported: {', '.join(SUPPORTED_TYPES + DENSE_TYPES)} (or serve it dequantized: --quantization none)"
        )


def gguf_native_tensors(reader, config: dict) -> Iterator[tuple[str, object]]:
    """Yield ``(hf_name, tensor)``: quantized weights as :class:`GGUFTensor` (still the file's
    blocks), the rest as fp32 tensors (:func:`gguf_tensors` with ``native``)."""
    check_native_types(reader)
    yield from gguf_tensors(reader, config, native=True)
