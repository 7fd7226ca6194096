"""Assemble an engine from an :class:`EngineConfig`: model, KV pool, prefix cache, backend."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.model_runner import ModelRunner
from llmkit.core.engine.scheduler import Scheduler
from llmkit.core.kvcache.kv_pool import KVCachePool, ReqToTokenPool, resolve_kv_cache_dtype
from llmkit.core.kvcache.prefix_cache import NoPrefixCache
from llmkit.core.kvcache.radix_cache import RadixCache
from llmkit.core.model.loader.int4_checkpoints import int4_checkpoint_weights, quant_method
from llmkit.core.model.loader.source import (
    gguf_path_of,
    iter_gguf_native,
    iter_safetensors,
    load_config,
    resolve_model_dir,
)
from llmkit.core.plugins import PluginError, registry

log = logging.getLogger("llmkit")

# --load-format values: "auto" loads the checkpoint; "dummy" fills random weights (benchmarks).
LOAD_FORMATS = ("auto", "dummy")


@dataclass
class EngineParts:
    model_dir: Path
    hf_config: dict
    tokenizer: Any
    model: Any
    scheduler: Scheduler
    runner: ModelRunner
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_context: int
    grammar: Any = None  # the grammar backend; None when structured output is disabled


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 math is slow on CPUs without AVX512-BF16/AMX; fp32 is the fast path there.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if name not in table:
        raise ValueError(f"unknown dtype '{name}'; valid: auto, {', '.join(sorted(table))}")
    return table[name]


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


def _eos_ids(model_dir: Path, hf_config: dict, tokenizer) -> frozenset[int]:
    ids: set[int] = set()

    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)

    add(hf_config.get("eos_token_id"))
    gen = model_dir / "generation_config.json"
    if gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    if tokenizer.eos_token_id is not None:
        add(tokenizer.eos_token_id)
    return frozenset(ids)


def _pool_tokens(
    config: EngineConfig, bytes_per_token: int, max_context: int, device=None, weight_bytes: int = 0
) -> int:
    if config.max_total_tokens:
        return config.max_total_tokens
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 16 << 30
    if config.mem_fraction_static:
        budget = int(total * config.mem_fraction_static) - weight_bytes
        if budget < bytes_per_token * min(max_context, 4096):
            raise ValueError(
                f"--mem-fraction-static {config.mem_fraction_static} leaves too little memory for "
                "the KV pool after the weights; raise it or use --max-total-tokens"
            )
        return budget // bytes_per_token
    by_memory = int(total * 0.2) // bytes_per_token
    running = config.max_running_requests or CPU_MAX_RUNNING
    return max(min(65536, by_memory, default_pool_tokens(max_context, running)), min(max_context, 4096))


TOKENS_PER_RUNNING_REQUEST = 512
CPU_MAX_RUNNING = 64  # --max-running-requests' default on CPU (on CUDA: from the pool, below)
# On CUDA, weights + KV pool + every other allocation so far may take this share of the GPU's
# memory (SGLang's --mem-fraction-static); the rest is for activations, logits and CUDA graphs.
CUDA_MEM_FRACTION = 0.88
# The default pool's ceiling: the free-page list is a Python list (4M tokens ~ 150 MB of host
# memory); past it the memory would idle anyway (4M tokens = 32 full 128k contexts).
CUDA_MAX_POOL_TOKENS = 1 << 22


def default_pool_tokens(max_context: int, max_running: int) -> int:
    """The default KV pool, sized from the workload rather than the machine: room for two
    full-context requests, or 512 tokens for each of --max-running-requests, whichever is more
    (more than that only idles memory: 3 GB for a 135M model before)."""
    return max(2 * max_context, TOKENS_PER_RUNNING_REQUEST * max_running)


def cuda_sizes(config: EngineConfig, bytes_per_token: int, max_context: int, row_bytes: int, device) -> tuple[int, int]:
    """(KV pool tokens, max running requests) on CUDA, from the GPU's memory after the weights
    (SGLang's sizing): the pool gets ``--mem-fraction-static`` (default 0.88) of the GPU less
    what is already in use (weights, the CUDA context, other processes) and less the request
    table's ``row_bytes`` a running request; the running limit follows the pool (512 running
    per full context of tokens, 64 to 2048). Explicit flags win."""
    free, total = torch.cuda.mem_get_info(device)
    frac = config.mem_fraction_static or CUDA_MEM_FRACTION
    budget = int(total * frac) - (total - free)
    guess = max(budget, 0) // bytes_per_token
    running = config.max_running_requests or min(max(guess * 512 // max_context, CPU_MAX_RUNNING), 2048)
    if config.max_total_tokens:
        return config.max_total_tokens, running
    tokens = (budget - (running + 1) * row_bytes) // bytes_per_token
    if tokens < min(max_context, 4096):
        raise ValueError(
            f"the GPU has too little free memory for the KV pool after the weights "
            f"({free / 2**30:.1f} of {total / 2**30:.1f} GiB free, fraction {frac}); "
            "raise --mem-fraction-static or set --max-total-tokens"
        )
    if not config.mem_fraction_static:
        tokens = min(tokens, CUDA_MAX_POOL_TOKENS)
    return tokens, running


def build_model(model_cls, hf_config: dict, device: torch.device, dtype: torch.dtype, tp=None):
    """Instantiate a model plugin with parameters of ``dtype`` on ``device`` (weights not loaded);
    ``tp``: the tensor-parallel group it shards over (a plugin without ``supports_tp`` is refused)."""
    if tp is not None and tp.size > 1 and not model_cls.supports_tp:
        raise ValueError(f"{model_cls.__name__} does not support tensor parallelism (--tp-size {tp.size})")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(hf_config, tp=tp) if tp is not None and tp.size > 1 else model_cls(hf_config)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


# GGUF architectures whose weights serve quantized (Linear layers and FusedExperts; gpt-oss's
# MXFP4 experts are dequantized at load, as from its safetensors checkpoints)
NATIVE_GGUF_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3")


def native_gguf(config: EngineConfig, device: torch.device, gguf_path: Path | None) -> bool:
    """Whether a GGUF is served at its native (quantized) precision, as llama.cpp serves it.

    The default for a GGUF on CPU; ``--quantization none`` or an explicit ``--dtype`` serves the
    dequantized weights, and so does CUDA (int4 has a Triton kernel there, but a GGUF's int8 types
    and quantized embedding tables have no CUDA path yet). ``--quantization gguf`` asks
    for it explicitly and fails where it cannot be had."""
    explicit = config.quantization == "gguf"
    if explicit and gguf_path is None:
        raise ValueError("--quantization gguf serves a GGUF's own quantized weights: give a .gguf --model-path")
    if explicit and device.type != "cpu":
        raise ValueError("--quantization gguf is a CPU path; on CUDA leave it out (GGUFs are dequantized)")
    if not explicit and (config.quantization or config.dtype != "auto" or device.type != "cpu"):
        return False
    return gguf_path is not None and config.load_format != "dummy"


def build_engine_parts(config: EngineConfig, tp=None) -> EngineParts:
    """The engine's parts; ``tp``: this rank's tensor-parallel group (every rank calls this in
    the same order: the pool size is agreed on with a collective)."""
    from transformers import AutoTokenizer

    t0 = time.monotonic()
    leader = tp is None or tp.rank == 0
    if config.load_format not in LOAD_FORMATS:  # fail before any (slow) model construction
        raise ValueError(f"unknown load format '{config.load_format}'; valid: {', '.join(LOAD_FORMATS)}")
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    attn_name, attn_cls = select_attention(config.attention, device)
    grammar_name = (config.grammar_backend or registry().default("grammar")) if leader else "none"
    if grammar_name != "none":
        registry().entry("grammar", grammar_name)  # an unknown name fails before loading
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    quant = config.quantization if config.quantization not in (None, "", "none", "gguf") else None
    gguf_path = gguf_path_of(config.model_path)
    native = native_gguf(config, device, gguf_path)
    model_dir = resolve_model_dir(config.model_path, weights=not native)
    hf_config = load_config(model_dir)
    if native and hf_config.get("model_type") not in NATIVE_GGUF_TYPES:
        # an architecture whose layers have no quantized format: served dequantized
        log.info(
            "%s: native GGUF weights are served for %s only; dequantizing",
            hf_config.get("model_type"),
            ", ".join(NATIVE_GGUF_TYPES),
        )
        native = False
        model_dir = resolve_model_dir(config.model_path)
    arch = architecture_of(hf_config)
    model_cls = registry().model(arch)
    # A plugin may read its own checkpoint quantization (gpt-oss's MXFP4, DeepSeek's FP8); for the
    # others an unsupported one fails here, before the model is built.
    int4_method = None if model_cls.reads_own_quantization else quant_method(hf_config)
    needed = frozenset(model_cls.attention_features)
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
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if quant and device.type != "cpu" and quant != "int4":  # int4 has a Triton kernel on CUDA, int8 none
        raise ValueError(f"--quantization {quant} is a CPU decode path; on CUDA use int4 or the model's dtype")
    model = build_model(model_cls, hf_config, device, dtype, tp)
    if quant and config.load_format != "dummy":
        model.quantize_experts(quant, config.quantization_group_size)  # quantized as they load
    if config.load_format == "dummy":
        from llmkit.core.model.loader.dummy_weights import fill_dummy_weights

        fill_dummy_weights(model)
    elif native:
        model.load_weights(iter_gguf_native(gguf_path, hf_config))
    elif int4_method:
        model.load_weights(int4_checkpoint_weights(iter_safetensors(model_dir), hf_config))
    else:
        try:
            model.load_weights(iter_safetensors(model_dir, lazy=tp is not None and tp.size > 1))
        except KeyError as exc:  # a missing or unknown tensor: the checkpoint does not fit the class
            raise ValueError(f"the checkpoint in {model_dir} does not fit {arch}: {exc.args[0]}") from None
    if hasattr(model, "finalize_weights"):
        model.finalize_weights()
    if quant:
        model.quantize(quant, config.quantization_group_size)

    max_context = int(config.context_length or hf_config.get("max_position_embeddings", 4096))
    n_kv, n_layers = model.local_kv_heads, model.num_layers
    head_dim, v_dim = model.kv_cache_dims
    # from the pool's dtype: a bf16 pool holds twice the tokens of an fp32 one in the same memory
    bytes_per_token = n_layers * n_kv * (head_dim + v_dim) * kv_dtype.itemsize
    page = config.page_size
    if device.type == "cuda":
        row_bytes = (max_context + page) * 8  # a request's row of the slot table (int64)
        tokens, running = cuda_sizes(config, bytes_per_token, max_context, row_bytes, device)
    else:
        weight_bytes = model.weight_bytes() if config.mem_fraction_static else 0
        tokens = _pool_tokens(config, bytes_per_token, max_context, device, weight_bytes)
        running = config.max_running_requests or CPU_MAX_RUNNING
    config_running = config.max_running_requests
    config = dataclasses.replace(config, max_running_requests=running)  # the scheduler's limit
    if tp is not None and tp.size > 1:  # every rank's pool holds the same token slots: rank 0's count
        import torch.distributed as dist

        agreed = torch.tensor([tokens], dtype=torch.int64)
        dist.broadcast(agreed, 0, group=tp.group)
        tokens = int(agreed.item())
    pool = KVCachePool(
        num_layers=n_layers,
        num_pages=tokens // page + 1,
        page_size=page,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        dtype=kv_dtype,
        device=device,
        v_head_dim=v_dim,
    )
    req_pool = ReqToTokenPool(config.max_running_requests + 1, max_context + page, device)
    cache = NoPrefixCache() if config.disable_radix_cache else RadixCache(pool)
    scheduler = Scheduler(config, pool, req_pool, cache, max_context)
    # the optional arguments only where a model needs them (backends without the features never get them)
    extra = {"scale": model.attention_scale} if getattr(model, "attention_scale", None) else {}
    out_dim = getattr(model, "attention_v_dim", v_dim)
    if out_dim != head_dim:
        extra["v_head_dim"] = out_dim
    attn = attn_cls(
        num_heads=model.local_heads, num_kv_heads=n_kv, head_dim=head_dim, pool=pool, device=device, **extra
    )
    runner = ModelRunner(model, attn, pool, req_pool, device, config.enable_deterministic_inference)
    if tp is not None and tp.size > 1 and leader:
        from llmkit.core.engine.step_wire import StepBroadcaster

        runner.broadcaster = StepBroadcaster(tp)
        req_pool.write_log = []
    # Graph replay would skip the step broadcast: tensor-parallel decode runs eagerly for now.
    tp_eager = tp is not None and tp.size > 1
    graphs = attn.supports_cuda_graph and model.supports_cuda_graph
    if device.type == "cuda" and attn.supports_cuda_graph and not graphs and not config.disable_cuda_graph:
        log.info("CUDA graphs off: %s's forward cannot be captured (it sizes work on the host)", arch)
    if device.type == "cuda" and graphs and not config.disable_cuda_graph and not tp_eager:
        from llmkit.core.engine.cuda_graph import CudaGraphRunner

        runner.graphs = CudaGraphRunner(
            model,
            attn,
            max_bs=min(config.cuda_graph_max_bs or 256, config.max_running_requests),
            max_context=max_context + page,
            device=device,
            deterministic=config.enable_deterministic_inference,
        )
        runner.graphs.capture()
    log.info(
        "Loaded %s (%s) on %s in %.1f s: dtype %s%s%s%s, attention %s, KV pool %d tokens (%.2f GB, %s), context %d",
        arch,
        model_dir,
        device,
        time.monotonic() - t0,
        str(dtype).removeprefix("torch."),
        ", dummy weights" if config.load_format == "dummy" else "",
        f" + {quant} weights" if quant else " + native GGUF weights" if native else "",
        f", tensor-parallel rank {tp.rank} of {tp.size}" if tp is not None and tp.size > 1 else "",
        attn_name,
        tokens,
        tokens * bytes_per_token / 1e9,
        str(kv_dtype).removeprefix("torch."),
        max_context,
    )
    if not config.max_total_tokens and leader:
        if device.type == "cuda":
            frac = config.mem_fraction_static or CUDA_MEM_FRACTION
            how = f"{frac:g} of the GPU's memory less what was in use after the weights"
        elif config.mem_fraction_static:
            how = f"--mem-fraction-static {config.mem_fraction_static}"
        else:
            how = (
                f"max(2 x context, {TOKENS_PER_RUNNING_REQUEST} x --max-running-requests {running})"
                ", at most 65,536 tokens or 20% of RAM"
            )
        log.info(
            "KV pool: %d tokens (%.2f GB) from %s; set it with --max-total-tokens N",
            tokens,
            tokens * bytes_per_token / 1e9,
            how,
        )
    if leader and device.type == "cuda":
        log.info("max running requests: %d%s", running, "" if config_running else " (from the KV pool)")
    vocab_size = int(hf_config["vocab_size"])
    eos_ids = _eos_ids(model_dir, hf_config, tokenizer)
    return EngineParts(
        model_dir=model_dir,
        hf_config=hf_config,
        tokenizer=tokenizer,
        model=model,
        scheduler=scheduler,
        runner=runner,
        vocab_size=vocab_size,
        eos_token_ids=eos_ids,
        max_context=max_context,
        grammar=build_grammar_backend(grammar_name, tokenizer, vocab_size, eos_ids),
    )


def build_grammar_backend(name: str, tokenizer, vocab_size: int, eos_ids):
    """The structured-output backend (``none``: constraint requests get a 400)."""
    if name == "none":
        return None
    from llmkit.core.grammar.contract import create_grammar_backend

    # The compile workers start with the first constrained request (a few seconds, once), so a
    # server that never sees one does not carry them.
    return create_grammar_backend(name, tokenizer=tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_ids))
