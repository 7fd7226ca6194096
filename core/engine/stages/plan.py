"""Stage 1 of building an engine: what the configuration resolves to (device, dtypes, attention
backend, grammar, model source and class), before the (slow) model construction. The options
themselves are checked by ``core/refusals.py``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmkit.core.engine.config import EngineConfig
from llmkit.core.kvcache.kv_pool import resolve_kv_cache_dtype
from llmkit.core.model.attention import TOKEN_SLOTS
from llmkit.core.model.loader.compressed_tensors import checkpoint_quantization
from llmkit.core.model.loader.source import gguf_path_of, load_config, resolve_model_dir
from llmkit.core.plugins import PluginError, registry

log = logging.getLogger("llmkit")

# --load-format values: "auto" loads the checkpoint; "dummy" fills random weights (benchmarks).
LOAD_FORMATS = ("auto", "dummy")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# --dtype's values (and "auto").
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 math is slow on CPUs without AVX512-BF16/AMX; fp32 is the fast path there.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}'; valid: auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def select_attention(name: str, device: torch.device):
    """Return (name, backend class); fail with the valid names if unknown or unavailable."""
    reg = registry()
    names = reg.names("attention")
    candidates = reg.auto_attention(device.type) if name == "auto" else [name]
    reasons = []
    for cand in candidates:
        if cand not in names:
            if name != "auto":
                raise PluginError(f"unknown attention backend '{cand}'; valid names: {', '.join(names)}")
            continue
        try:
            cls = reg.attention_backend(cand)
        except PluginError as exc:
            reasons.append(f"{cand}: {exc}")
            continue
        why = cls.availability(device)
        if why is None:
            return cand, cls
        reasons.append(f"{cand}: {why}")
    usable = [n for n in names if _usable(reg, n, device)]
    raise PluginError(
        f"attention backend '{name}' cannot run on {device.type} ({'; '.join(reasons)}); "
        f"backends that work here: {', '.join(usable) or 'none'}"
    )


def _usable(reg, name: str, device: torch.device) -> bool:
    try:
        return reg.attention_backend(name).availability(device) is None
    except Exception:
        return False


def _refuse_on_fallback(config: EngineConfig, quant: str | None) -> None:
    """What the transformers fallback's layers (transformers' own) do not run, refused before loading."""
    lacking = [
        flag
        for flag, asked in (
            ("--quantization", quant),
            ("--lora-paths / --enable-lora", config.enable_lora or config.lora_paths),
            ("--speculative-algorithm", config.speculative_algorithm),
        )
        if asked
    ]
    if lacking:
        raise ValueError(
            f"{', '.join(lacking)}: not available on the transformers fallback (its layers are transformers' "
            "own); a native model class has them"
        )


# --model-impl values (vLLM's and SGLang's option; "llmkit" is their "vllm"/"sglang")
MODEL_IMPLS = ("auto", "llmkit", "transformers")
FALLBACK = "TransformersForCausalLM"  # the registered model plugin that runs transformers' code


def architecture_of(hf_config: dict) -> str:
    archs = hf_config.get("architectures")
    if archs:
        return archs[0]
    # config.json files written by ``PretrainedConfig.save_pretrained`` on a bare config carry no
    # "architectures"; the model type still names the causal LM (model plugins declare theirs).
    model_type = hf_config.get("model_type", "?")
    arch = registry().architecture_for_model_type(model_type)
    if arch is None:
        raise ValueError(
            f"config.json names no 'architectures' and no model plugin declares its model_type '{model_type}'"
        )
    return arch


def model_class(hf_config: dict, tp_size: int = 1, model_impl: str = "auto"):
    """The model plugin serving ``hf_config``. Under tensor parallelism an image-text model whose
    vision tower is not sharded is served as its language model alone (its ``text_model``, images
    refused), as it was before it took images, rather than not at all. ``model_impl``: see
    ``--model-impl``; "auto" takes the transformers fallback only where no plugin has the class."""
    reg = registry()
    if model_impl == "transformers":
        fallback = reg.model(FALLBACK)
        why = fallback.unsupported(hf_config)
        if why:
            raise ValueError(f"--model-impl transformers cannot serve this model: {why}")
        return fallback
    try:
        arch = architecture_of(hf_config)
        cls = reg.model(arch)
        declared = reg.entry("model", arch).meta.get("model_types", ())
        model_type = hf_config.get("model_type")
        if model_impl == "auto" and declared and model_type and model_type not in declared:
            # a transformers model saved under its parent's class name (Exaone as LlamaForCausalLM):
            # the native class would not fit its weights; the fallback runs its own code
            fallback = reg.model(FALLBACK) if FALLBACK in reg.names("model") else None
            if fallback is not None and fallback.unsupported(hf_config) is None:
                log.info(
                    "%s: model_type '%s' is not %s's; serving it with the transformers fallback", arch, model_type, arch
                )
                return fallback
    except (PluginError, ValueError) as exc:
        if model_impl != "auto" or FALLBACK not in reg.names("model"):
            raise
        fallback = reg.model(FALLBACK)
        why = fallback.unsupported(hf_config)
        if why:
            raise ValueError(f"{exc}; the transformers fallback cannot serve it either: {why}") from None
        log.info("%s: no native llmkit class; serving it with the transformers fallback", exc)
        return fallback
    if tp_size > 1 and not cls.supports_tp and getattr(cls, "text_model", None) is not None:
        return cls.text_model
    return cls


NATIVE_GGUF_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3")


def native_gguf(config: EngineConfig, device: torch.device, gguf_path: Path | None) -> bool:
    """Whether a GGUF is served at its native (quantized) precision, as llama.cpp serves it.

    The default for a GGUF on CPU; ``--quantization none`` or an explicit ``--dtype`` serves the
    dequantized weights, and so does CUDA (int4 has a Triton kernel there, but a GGUF's int8 types
    and quantized embedding tables have no CUDA path yet). ``--quantization gguf`` asks
    for it explicitly (``core/refusals.py`` refuses it where it cannot be had)."""
    explicit = config.quantization == "gguf"
    if not explicit and (config.quantization or config.dtype != "auto" or device.type != "cpu"):
        return False
    return gguf_path is not None and config.load_format != "dummy"


@dataclass
class Plan:
    """What the configuration resolves to, checked before anything slow runs."""

    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    attn_name: str
    attn_cls: Any
    grammar_name: str
    quant: str | None
    gguf_path: Path | None
    native: bool  # a GGUF served at its own precision
    model_dir: Path
    hf_config: dict
    arch: str
    model_cls: Any
    int4_method: str | None
    loader: str  # the row of loader.loaders.LOADERS that fills the model


def draft_device(config: EngineConfig, target: torch.device) -> torch.device:
    """Where the speculative proposer runs: ``--speculative-draft-device``, else the target's device."""
    return torch.device(config.speculative_draft_device) if config.speculative_draft_device else target


def resolve_plan(config: EngineConfig, leader: bool = True) -> Plan:
    """Stage 1: device, dtypes, attention backend, grammar, model source and class. The options
    were checked by ``core/refusals.py``; what needs the model's class (the attention features it
    uses, the K/V dtypes its backend reads) is refused here, before the (slow) model construction."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    attn_name, attn_cls = select_attention(config.attention, device)
    grammar_name = (config.grammar_backend or registry().default("grammar")) if leader else "none"
    registry().entry("grammar", grammar_name)  # an unknown name fails before loading
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    quant = config.quantization if config.quantization not in (None, "", "none", "gguf") else None
    gguf_path = gguf_path_of(config.model_path)
    native = native_gguf(config, device, gguf_path)
    model_dir = resolve_model_dir(config.model_path, weights=not native)
    hf_config = load_config(model_dir)
    if native and hf_config.get("model_type") not in NATIVE_GGUF_TYPES:
        # an architecture whose layers do not keep GGUF blocks: dequantized, then (by default, as a
        # GGUF is served at about its own precision) quantized again to our int8 or int4 layout
        native = False
        model_dir = resolve_model_dir(config.model_path)
        if config.quantization is None:
            from llmkit.core.model.loader.gguf_file import requantization_of

            quant = requantization_of(gguf_path)
        log.info(
            "%s: native GGUF weights are served for %s only; dequantizing%s",
            hf_config.get("model_type"),
            ", ".join(NATIVE_GGUF_TYPES),
            f", then --quantization {quant} (--quantization none keeps fp32)" if quant else "",
        )
    model_cls = model_class(hf_config, config.tp_size, config.model_impl)
    arch = model_cls.architecture(hf_config) if hasattr(model_cls, "architecture") else architecture_of(hf_config)
    if getattr(model_cls, "is_fallback", False):
        _refuse_on_fallback(config, quant)
    # A plugin may read its own checkpoint quantization (gpt-oss's MXFP4, DeepSeek's FP8); for the
    # others an unsupported one fails here, before the model is built.
    int4_method = None if model_cls.reads_own_quantization else checkpoint_quantization(hf_config)
    needed = frozenset(model_cls.attention_features)
    if (config.speculative_eagle_topk or 1) > 1 and config.speculative_algorithm:
        needed |= {TOKEN_SLOTS}  # tree drafts: each node reads its own path's slots
    if config.attention == "auto" and not needed <= attn_cls.features:
        log.info("attention: %s lacks %s, which %s needs; using torch", attn_name, sorted(needed), arch)
        attn_name, attn_cls = select_attention("torch", device)
    attn_cls.check_features(needed, attn_name)
    why = attn_cls.kv_cache_dtype_support(kv_dtype, device)
    if why and config.attention == "auto":
        log.info(
            "attention: %s cannot serve --kv-cache-dtype %s (%s); using torch", attn_name, config.kv_cache_dtype, why
        )
        attn_name, attn_cls = select_attention("torch", device)
    elif why:
        raise ValueError(
            f"attention backend '{attn_name}' cannot serve --kv-cache-dtype {config.kv_cache_dtype}: {why}; "
            "use --attention torch or another --kv-cache-dtype"
        )
    loader = (
        "dummy" if config.load_format == "dummy"
        else "gguf_native" if native
        else "compressed_tensors" if int4_method == "compressed-tensors"
        else "int4_checkpoint" if int4_method
        else "safetensors"
    )  # fmt: skip
    return Plan(
        device, dtype, kv_dtype, attn_name, attn_cls, grammar_name, quant, gguf_path, native, model_dir,
        hf_config, arch, model_cls, int4_method, loader,
    )  # fmt: skip
