"""Read a GGUF file into a Hugging Face layout: ``config.json`` fields and HF-named fp32 tensors.

llama.cpp's converter permutes the Q and K projection rows of Llama-family models to match its
rotary layout; we undo that here so the weights fit HF-style (rotate-half) rotary embeddings.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

# GGUF architectures whose tensors this converter maps to the HF llama layout. The config it writes
# names only the model_type; the model plugin that declares that type serves it.
_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gpt-oss")
# GGUF architecture -> HF model_type, where they differ
_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
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


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader) -> dict:
    """The HF ``config.json`` equivalent of a GGUF's metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"GGUF architecture '{arch}' is not supported; supported: {sorted(_ARCHS)}")
    p = f"{arch}."
    names = {t.name for t in reader.tensors}
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    vocab = _field(reader, p + "vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {
        "model_type": _MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
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


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (interleaved pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(reader, config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, fp32 tensor)`` for every weight, dequantized."""
    from gguf.quants import dequantize

    permute = config["model_type"] == "llama"
    names = {**_LAYER_NAMES, **(_GPT_OSS_NAMES if config["model_type"] == "gpt_oss" else {})}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
        name = t.name
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, kind, suffix = name.split(".", 3)
            if kind in _EXPERT_NAMES:
                for e in range(w.shape[0]):
                    yield (
                        f"model.layers.{idx}.mlp.experts.{e}.{_EXPERT_NAMES[kind]}.{suffix}",
                        torch.from_numpy(w[e].copy()),
                    )
                continue
            if kind == "attn_sinks":  # one logit per head, no ".weight" in HF's name
                hf = f"model.layers.{idx}.self_attn.sinks"
            elif kind not in names:
                continue
            else:
                hf = f"model.layers.{idx}.{names[kind]}.{suffix}"
            if permute and kind == "attn_q" and suffix == "weight":
                w = _unpermute(w, config["num_attention_heads"])
            elif permute and kind == "attn_k" and suffix == "weight":
                w = _unpermute(w, config["num_key_value_heads"])
        else:
            continue
        w = np.ascontiguousarray(w)
        if not w.flags.writeable:  # an F32 tensor is a read-only view of the memory-mapped file
            w = w.copy()  # (torch.from_numpy would warn about it at every first start)
        yield hf, torch.from_numpy(w)
