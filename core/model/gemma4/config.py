"""Gemma 4's text settings read from a ``config.json`` dict, as transformers' ``Gemma4TextConfig``
resolves them: defaults, the local/global layer table, each layer's head size and K/V heads, the
per-type rope, and which layers store K/V and which read another layer's (``num_kv_shared_layers``)."""

from __future__ import annotations

LAYER_TYPES = ("sliding_attention", "full_attention")

# transformers' Gemma4TextConfig defaults (a checkpoint's text_config may spell out only some)
TEXT_DEFAULTS = dict(
    vocab_size=262_144,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=30,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=False,
    sliding_window=512,
    final_logit_softcapping=None,
    vocab_size_per_layer_input=262_144,
    hidden_size_per_layer_input=256,
    attention_k_eq_v=False,
    num_kv_shared_layers=0,
    enable_moe_block=False,
    use_double_wide_mlp=False,
    global_head_dim=512,
    num_global_key_value_heads=None,
)

DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def text_config(config: dict) -> dict:
    """The text stack's settings with defaults filled in (an explicit null too)."""
    c = dict(TEXT_DEFAULTS)
    c.update({k: v for k, v in config.items() if v is not None or k not in TEXT_DEFAULTS})
    c["num_key_value_heads"] = c["num_key_value_heads"] or c["num_attention_heads"]
    c["layer_types"] = layer_types(c)
    c["rope_parameters"] = {**DEFAULT_ROPE, **(c.get("rope_parameters") or {})}
    check_text_config(c)
    return c


def layer_types(c: dict) -> list[str]:
    n = int(c["num_hidden_layers"])
    types = list(c.get("layer_types") or [LAYER_TYPES[(i + 1) % 6 == 0] for i in range(n)])
    if types:
        types[-1] = "full_attention"  # transformers forces the last layer global
    return types


def layer_heads(c: dict) -> list[tuple[int, int]]:
    """Per layer, ``(K/V heads, head size)``: ``per_layer_config`` where the config carries it
    (transformers 5 writes it), else ``global_head_dim`` for the full-attention layers and, with
    ``attention_k_eq_v``, ``num_global_key_value_heads`` (the published checkpoints' fields)."""
    per_layer = {int(k): v for k, v in (c.get("per_layer_config") or {}).items() if str(k).isdigit()}
    out = []
    for i, kind in enumerate(c["layer_types"]):
        heads, dim = int(c["num_key_value_heads"]), int(c["head_dim"])
        if i in per_layer or "per_layer_config" in c:
            over = per_layer.get(i, {})
            heads, dim = int(over.get("num_key_value_heads", heads)), int(over.get("head_dim", dim))
        elif kind == "full_attention":
            dim = int(c["global_head_dim"])
            if c["attention_k_eq_v"] and c["num_global_key_value_heads"]:
                heads = int(c["num_global_key_value_heads"])
        out.append((heads, dim))
    return out


def kv_sources(c: dict) -> list[int]:
    """Per layer, the layer whose K/V it attends over: itself, or for the last
    ``num_kv_shared_layers`` layers the last earlier storing layer of the same type."""
    n, shared = int(c["num_hidden_layers"]), int(c["num_kv_shared_layers"] or 0)
    types = c["layer_types"]
    first = n - shared
    if shared and first <= 0:
        raise ValueError(f"num_kv_shared_layers {shared} leaves no layer to store K/V ({n} layers)")
    out = []
    for i in range(n):
        if i < first:
            out.append(i)
            continue
        sources = [j for j in range(first) if types[j] == types[i]]
        if not sources:
            raise ValueError(f"layer {i} ({types[i]}) shares K/V, but no earlier layer of its type stores any")
        out.append(sources[-1])
    return out


def rope_config(c: dict, kind: str) -> dict:
    """What :class:`RotaryEmbedding` reads for one layer type."""
    return {"rope_parameters": c["rope_parameters"][kind], "max_position_embeddings": int(c["max_position_embeddings"])}


def check_text_config(c: dict) -> None:
    """Refuse what this implementation does not run, naming the field."""
    if c.get("use_bidirectional_attention") == "all":
        raise ValueError("use_bidirectional_attention 'all' (an embedding model) is not supported for generation")
    act = c.get("hidden_activation")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation '{act}' is not supported for Gemma 4; supported: gelu_pytorch_tanh")
    for i, kind in enumerate(c["layer_types"]):
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] '{kind}' is not one of {', '.join(LAYER_TYPES)}")
    if len(c["layer_types"]) != int(c["num_hidden_layers"]):
        raise ValueError(f"layer_types has {len(c['layer_types'])} entries for {c['num_hidden_layers']} layers")
    if c["enable_moe_block"] and not (
        c.get("num_experts") and c.get("top_k_experts") and c.get("moe_intermediate_size")
    ):
        raise ValueError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
