"""Read a GGUF file into a Hugging Face layout: ``config.json`` fields and HF-named fp32 tensors.

llama.cpp's converter permutes the Q and K projection rows of Llama-family models to match its
rotary layout; we undo that here so the weights fit HF-style (rotate-half) rotary embeddings.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from llmkit.core.model.loader.gguf_families import (
    GRANITE_HYBRID_NAMES,
    LFM2_NAMES,
    NEMOTRON_H_NAMES,
    QWEN_HYBRID_NAMES,
    deepseek_config,
    granite_hybrid_config,
    lfm2_config,
    mamba2_tensor,
    nemotron_h_config,
    qwen_hybrid_config,
    qwen_hybrid_tensor,
)
from llmkit.core.model.loader.gguf_file import metadata_field as _field
from llmkit.core.model.loader.gguf_gemma4 import gemma4_config, gemma4_tensor
from llmkit.core.model.loader.gguf_llama_variants import (
    PERMUTED,
    VARIANT_MODEL_TYPES,
    VARIANT_NAMES,
    variant_config,
)

# GGUF architectures whose tensors this converter maps to the HF llama layout, and the HF
# model_types each becomes (the first is written; deepseek2 names V3 or V2 by its gating). The config
# it writes names only the model_type; the model plugin that declares that type serves it.
GGUF_MODEL_TYPES = {
    "llama": ("llama", "mixtral"),  # (Mixtral: llama with experts, see gguf_llama_variants.py)
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
    "gemma4": ("gemma4_text",),
    **VARIANT_MODEL_TYPES,
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
        cfg.update(deepseek_config(reader, p))
    if arch in QWEN_HYBRID_ARCHS:
        cfg.update(qwen_hybrid_config(reader, p, cfg))
    if arch == "lfm2":
        cfg.update(lfm2_config(reader, p, cfg, per_layer_kv))
    if arch in ("nemotron_h", "nemotron_h_moe"):
        cfg.update(nemotron_h_config(reader, p, cfg, per_layer_kv, per_layer_ffn, names))
    if arch == "granitehybrid":
        cfg.update(granite_hybrid_config(reader, p, cfg, per_layer_kv, names))
    if arch == "gemma4":
        cfg.update(gemma4_config(reader, p, cfg, per_layer_kv, per_layer_ffn, names))
    cfg.update(variant_config(reader, arch, p, cfg, names))
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
            self.names.update(LFM2_NAMES)
        self.nemotron_h = config["model_type"] == "nemotron_h"
        if self.nemotron_h:
            self.names.update(NEMOTRON_H_NAMES)
        self.granite = config["model_type"] == "granitemoehybrid"
        if self.granite:
            self.names.update(GRANITE_HYBRID_NAMES)
        self.mamba2 = self.nemotron_h or self.granite  # (A, D, the grouped norm: mamba2_tensor)
        self.hybrid = config["model_type"] in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
        if self.hybrid:
            self.names.update(QWEN_HYBRID_NAMES)
        self.names.update(VARIANT_NAMES.get(config["model_type"], {}))
        self.split_kv_b: dict[str, dict[str, np.ndarray]] = {}  # layer -> attn_k_b / attn_v_b seen so far
        self.gemma4 = config["model_type"] == "gemma4_text"  # (its own names: gguf_gemma4.py)

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
        permute = config["model_type"] in ("llama", "granitemoehybrid", *PERMUTED)
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
        mapped = gemma4_tensor(name, w) if self.gemma4 and not kept else None
        if mapped is not None:
            if mapped[0]:  # ("": rope_freqs, the proportional rope the config already holds)
                yield out(*mapped)
            return
        if self.hybrid and not kept and name.startswith("blk."):
            tiled = config["model_type"] != "qwen3_next"  # (qwen35's converter reorders value heads)
            w = qwen_hybrid_tensor(name.split(".")[2], w, config, tiled)
        elif self.mamba2 and not kept and name.startswith("blk."):
            w = mamba2_tensor(name.split(".")[2], w)
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
        or kind in LFM2_NAMES
        or kind in NEMOTRON_H_NAMES
        or kind in GRANITE_HYBRID_NAMES
        or any(kind in names for names in VARIANT_NAMES.values())
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
