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
_ARCHS = ("llama", "qwen2", "qwen3")

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
}


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
        "model_type": arch,
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


def _permute_heads(name: str, config: dict) -> int | None:
    """The head count to unpermute a Q/K weight's rows by, or None."""
    if config["model_type"] != "llama" or not name.endswith(".weight"):
        return None
    if ".attn_q." in name:
        return config["num_attention_heads"]
    if ".attn_k." in name:
        return config["num_key_value_heads"]
    return None


def gguf_tensors(reader, config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, fp32 tensor)`` for every weight, dequantized."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        hf = _hf_name(t.name)
        if hf is None:
            continue
        w = dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
        heads = _permute_heads(t.name, config)
        if heads:
            w = _unpermute(w, heads)
        w = np.ascontiguousarray(w)
        if not w.flags.writeable:  # an F32 tensor is a read-only view of the memory-mapped file
            w = w.copy()  # (torch.from_numpy would warn about it at every first start)
        yield hf, torch.from_numpy(w)


def check_native_types(reader) -> None:
    """Fail before loading anything if a weight's type cannot be served quantized."""
    from llmkit.core.model.gguf_quant import DENSE_TYPES, SUPPORTED_TYPES

    for t in reader.tensors:
        kind = t.tensor_type.name
        if _hf_name(t.name) is not None and kind not in SUPPORTED_TYPES + DENSE_TYPES:
            raise ValueError(
                f"GGUF tensor '{t.name}' has type {kind}, which llmkit cannot serve quantized; "
                f"supported: {', '.join(SUPPORTED_TYPES + DENSE_TYPES)} (or serve it dequantized: --quantization none)"
            )


def gguf_native_tensors(reader, config: dict) -> Iterator[tuple[str, object]]:
    """Yield ``(hf_name, tensor)``: quantized weights as :class:`GGUFTensor` (still the file's
    blocks; Q/K rows unpermuted, which moves whole rows of blocks), the rest as fp32 tensors."""
    from llmkit.core.model.gguf_quant import DENSE_TYPES, GGUFTensor

    check_native_types(reader)
    for t in reader.tensors:
        hf = _hf_name(t.name)
        if hf is None:
            continue
        kind = t.tensor_type.name
        if kind in DENSE_TYPES:
            yield from gguf_tensors(_OneTensor(reader, t), config)
            continue
        shape = [int(x) for x in reversed(t.shape)]
        data = t.data.reshape(shape[0], -1)
        heads = _permute_heads(t.name, config)
        if heads:
            data = np.ascontiguousarray(_unpermute(data, heads))
        yield hf, GGUFTensor(t.name, kind, data, shape[1])


class _OneTensor:
    """A reader stand-in holding one tensor (reuses :func:`gguf_tensors` for dense ones)."""

    def __init__(self, reader, tensor) -> None:
        self.tensors = [tensor]
