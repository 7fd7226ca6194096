"""llama.cpp's ``gemma4`` GGUF (its converter's ``Gemma4Model``) read back into Gemma 4's HF config
and tensor names.

Metadata: ``key_length`` is the full layers' head size and ``key_length_swa`` the sliding ones';
``sliding_window_pattern`` one bool a layer (true: sliding); ``head_count_kv`` one count a layer
where the full layers have their own (``attention_k_eq_v`` checkpoints, whose full layers then have
no ``attn_v``); ``feed_forward_length`` one width a layer under ``use_double_wide_mlp``;
``shared_kv_layers``, ``embedding_length_per_layer_input``, the expert counts. The ``proportional``
rope of the full layers is a ``rope_freqs`` tensor there (1 for a rotated frequency, 1e30 for an
unrotated one): its count of ones gives ``partial_rotary_factor``. Norms are stored as they are
(no ``1 +`` shift for Gemma 4), the router's scales as ``ffn_gate_inp.scale`` and
``ffn_down_exps.scale``, the experts' gate/up as one stacked ``ffn_gate_up_exps``.
"""

from __future__ import annotations

import numpy as np

from llmkit.core.model.loader.gguf_file import metadata_field as _field

# per-layer GGUF kinds -> names under model.layers.N (beside the common ones of gguf_loader)
GEMMA4_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "ffn_gate_inp": "router.proj",
}
_TOP = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}


def gemma4_config(reader, p: str, cfg: dict, per_layer_kv, per_layer_ffn, names: set) -> dict:
    """Gemma 4's text config from llama.cpp's gemma4 metadata (``cfg``: the common fields read)."""
    n = cfg["num_hidden_layers"]
    swa = _field(reader, p + "attention.sliding_window_pattern")
    swa = [bool(x) for x in swa] if isinstance(swa, list) else [(i + 1) % int(swa or 6) != 0 for i in range(n)]
    types = ["sliding_attention" if s else "full_attention" for s in swa[:n]]
    full_dim = int(_field(reader, p + "attention.key_length"))
    swa_dim = int(_field(reader, p + "attention.key_length_swa", full_dim))
    kv = per_layer_kv or [cfg["num_key_value_heads"]] * n
    swa_kv = next((int(h) for h, t in zip(kv, types) if t == "sliding_attention"), int(kv[0]))
    full_kv = next((int(h) for h, t in zip(kv, types) if t == "full_attention"), swa_kv)
    k_eq_v = any(t == "full_attention" and f"blk.{i}.attn_v.weight" not in names for i, t in enumerate(types))
    shared = int(_field(reader, p + "attention.shared_kv_layers", 0) or 0)
    ffn = [int(x) for x in per_layer_ffn] if per_layer_ffn else [cfg["intermediate_size"]] * n
    experts = int(_field(reader, p + "expert_count", 0) or 0)
    ple = int(_field(reader, p + "embedding_length_per_layer_input", 0) or 0)
    out = {
        "model_type": "gemma4_text",
        "layer_types": types,
        "head_dim": swa_dim,
        "global_head_dim": full_dim,
        "num_key_value_heads": swa_kv,
        "num_global_key_value_heads": full_kv if k_eq_v else None,
        "attention_k_eq_v": k_eq_v,
        "sliding_window": int(_field(reader, p + "attention.sliding_window", 512)),
        "num_kv_shared_layers": shared,
        "intermediate_size": ffn[0],
        "use_double_wide_mlp": shared > 0 and ffn[-1] == 2 * ffn[0],
        "hidden_size_per_layer_input": ple,
        "final_logit_softcapping": _field(reader, p + "final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(_field(reader, p + "rope.freq_base_swa", 10_000.0)),
            },
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": _rotary_share(reader, full_dim),
                "rope_theta": cfg["rope_theta"],
            },
        },
    }
    if ple:
        table = next(t for t in reader.tensors if t.name == "per_layer_token_embd.weight")
        out["vocab_size_per_layer_input"] = int(table.shape[-1])  # (GGUF shapes are reversed)
    if experts:
        out.update(
            enable_moe_block=True,
            num_experts=experts,
            top_k_experts=int(_field(reader, p + "expert_used_count")),
            moe_intermediate_size=int(_field(reader, p + "expert_feed_forward_length")),
        )
    return out


def _rotary_share(reader, head_dim: int) -> float:
    """The full layers' ``partial_rotary_factor``: the share of ``rope_freqs`` that rotates."""
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return 1.0
    return float(2 * int((np.asarray(freqs.data, dtype=np.float32) < 1e20).sum()) / head_dim)


def gemma4_tensor(name: str, w: np.ndarray) -> tuple[str, np.ndarray] | None:
    """The HF name (and value) of a gemma4 GGUF tensor that the common names do not cover;
    ``("", w)`` for one with no HF counterpart (``rope_freqs``), None for a common one."""
    if name in _TOP:
        return _TOP[name], w
    if name == "rope_freqs.weight":
        return "", w
    if not name.startswith("blk."):
        return None
    _, idx, kind, *rest = name.split(".", 3)
    suffix = rest[0] if rest else ""
    layer = f"model.layers.{idx}."
    if kind == "layer_output_scale":
        return layer + "layer_scalar", w.reshape(1)
    if kind == "ffn_gate_inp" and suffix == "scale":
        return layer + "router.scale", w
    if kind == "ffn_down_exps" and suffix == "scale":
        return layer + "router.per_expert_scale", w
    if kind == "ffn_gate_up_exps":
        return layer + "experts.gate_up_proj", w
    if kind == "ffn_down_exps":
        return layer + "experts.down_proj", w
    if kind in GEMMA4_NAMES:
        return f"{layer}{GEMMA4_NAMES[kind]}.{suffix}", w
    return None
