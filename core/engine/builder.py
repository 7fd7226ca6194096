"""Assemble an engine from an :class:`EngineConfig`: model, KV pool, prefix cache, backend."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.model_runner import ModelRunner
from llmkit.core.engine.scheduler import Scheduler
from llmkit.core.engine.stages.plan import (  # noqa: F401 (names other modules and tests import from here)
    LOAD_FORMATS,
    NATIVE_GGUF_TYPES,
    Plan,
    architecture_of,
    draft_device,
    native_gguf,
    resolve_device,
    resolve_dtype,
    resolve_plan,
    select_attention,
)
from llmkit.core.engine.stages.sizing import CUDA_MEM_FRACTION, TOKENS_PER_RUNNING_REQUEST, KVSize, size_kv
from llmkit.core.engine.stages.tier import build_storage_tier
from llmkit.core.kvcache.kv_pool import KVCachePool, ReqToTokenPool
from llmkit.core.kvcache.prefix_cache import NoPrefixCache
from llmkit.core.kvcache.radix_cache import RadixCache
from llmkit.core.kvcache.state_pool import StatePool
from llmkit.core.kvcache.state_radix_cache import StateRadixCache
from llmkit.core.kvcache.window_pages import WindowPages
from llmkit.core.kvcache.window_radix_cache import WindowRadixCache
from llmkit.core.model import quantize
from llmkit.core.model.grouped_attention import build_attention
from llmkit.core.model.loader.loaders import WeightSource, get_loader
from llmkit.core.speculative.speculator import build_speculator

log = logging.getLogger("llmkit")


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
    grammar: Any = None  # the grammar backend (the ``none`` plugin's when structured output is off)


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
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        add(tokenizer.eos_token_id)
    return frozenset(ids)


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


def _load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def build_engine_parts(config: EngineConfig, tp=None) -> EngineParts:
    """The engine's parts, in stages (as SGLang's ``ModelRunner.initialize``): resolve every choice
    that can fail fast, load the model, size the KV pool, build the pool, scheduler, attention
    backend and runner, capture CUDA graphs, then the grammar backend. ``tp``: this rank's
    tensor-parallel group (every rank calls this in the same order: the pool size is agreed on
    with a collective)."""
    t0 = time.monotonic()
    leader = tp is None or tp.rank == 0
    plan = resolve_plan(config, leader)
    # Only rank 0 sees text: a follower never imports the tokenizer stack. Rank 0 loads it on a
    # thread beside the weights: it is ~1.5 s of imports (transformers' config classes pull in
    # torch.distributed.tensor and sympy) that the load's torch work leaves the other core for.
    tokenizer = None
    with ThreadPoolExecutor(1, thread_name_prefix="llmkit-tokenizer") as pool:
        loading = pool.submit(_load_tokenizer, plan.model_dir) if leader else None
        model = load_model(plan, config, tp)  # (a failure here waits for the tokenizer, then is raised)
        if loading is not None:
            tokenizer = loading.result()
    lora = build_lora(config, model)  # (its CUDA slots come out of the memory the KV pool is sized from)
    kv = size_kv(plan, config, model, tp)
    explicit_running = config.max_running_requests
    config = dataclasses.replace(config, max_running_requests=kv.running)  # the scheduler's limit
    scheduler, runner = build_runner(plan, config, model, kv, tp, leader)
    runner.lora = lora
    if runner.lora is not None:  # from here on, rank 0's run-time loads reach every rank
        runner.lora.channel = runner.broadcaster
    if getattr(model, "multimodal", False):  # images: encoded on this side, kept by content hash
        from llmkit.core.multimodal.step_rows import EncoderCache

        runner.encoder = EncoderCache(model)
    capture_graphs(plan, config, model, runner, kv, tp)
    _log_loaded(plan, config, kv, tp, leader, explicit_running, time.monotonic() - t0)
    vocab_size = int(plan.hf_config.get("vocab_size") or model.vocab_size)  # (a VL config may nest it)
    eos_ids = _eos_ids(plan.model_dir, plan.hf_config, tokenizer)
    return EngineParts(
        model_dir=plan.model_dir,
        hf_config=plan.hf_config,
        tokenizer=tokenizer,
        model=model,
        scheduler=scheduler,
        runner=runner,
        vocab_size=vocab_size,
        eos_token_ids=eos_ids,
        max_context=kv.max_context,
        grammar=build_grammar_backend(plan.grammar_name, tokenizer, vocab_size, eos_ids),
    )


def build_lora(config: EngineConfig, model):
    """Stage 4b: the LoRA manager over the loaded model, with the start-up adapters, when LoRA is
    served (``--lora-paths`` or ``--enable-lora``); None otherwise (the model stays unwrapped)."""
    if not (config.enable_lora or config.lora_paths):
        return None
    from llmkit.core.lora.manager import LoRAManager
    from llmkit.core.lora.options import parse_lora_paths

    manager = LoRAManager(
        model,
        max_rank=config.max_lora_rank,
        max_per_batch=config.max_loras_per_batch,
        targets=config.lora_target_modules,
    )
    for name, path in parse_lora_paths(config.lora_paths):
        manager.load(name, path)
    return manager


def load_model(plan: Plan, config: EngineConfig, tp):
    """Stage 2: build the model on its device and fill it (the checkpoint, or dummy weights), then
    finalize and quantize."""
    model = build_model(plan.model_cls, plan.hf_config, plan.device, plan.dtype, tp)
    if plan.quant and plan.loader != "dummy":
        quantize.quantize_experts(model, plan.quant, config.quantization_group_size)  # as they load
    lazy = tp is not None and tp.size > 1
    try:
        get_loader(plan.loader)(model, WeightSource(plan.model_dir, plan.gguf_path, plan.hf_config, lazy))
    except KeyError as exc:  # a missing or unknown tensor: the checkpoint does not fit the class
        if plan.loader != "safetensors":
            raise
        raise ValueError(f"the checkpoint in {plan.model_dir} does not fit {plan.arch}: {exc.args[0]}") from None
    quantize.finalize_weights(model)
    if plan.quant:
        quantize.quantize(model, plan.quant, config.quantization_group_size)
    return model


def build_runner(plan: Plan, config: EngineConfig, model, kv: KVSize, tp, leader: bool):
    """Stage 4: the KV pool, the request table, the prefix cache, the scheduler, the attention
    backend and the model runner."""
    head_dim, v_dim = model.kv_cache_dims
    shapes = model.kv_layer_shapes
    page = config.page_size
    windows = layer_slots = None
    if kv.windowed:  # window layers in pages of their own (core/kvcache/window_pages.py)
        layers, window = kv.windowed
        windows = WindowPages(
            layers=layers,
            window=window,
            num_pages=kv.window_tokens // page + 1,
            page_size=page,
            max_requests=config.max_running_requests + 1,
            max_context=kv.max_context + page,
            device=plan.device,
        )
        full = (kv.tokens // page + 1) * page
        layer_slots = [windows.num_pages * page if i in windows.layers else full for i in range(model.num_kv_layers)]
    pool = KVCachePool(
        num_layers=model.num_kv_layers,
        num_pages=kv.tokens // page + 1,
        page_size=page,
        num_kv_heads=model.local_kv_heads,
        head_dim=head_dim,
        dtype=plan.kv_dtype,
        device=plan.device,
        v_head_dim=v_dim,
        layer_shapes=shapes if len(set(shapes)) > 1 else None,
        layer_slots=layer_slots,
    )
    req_pool = ReqToTokenPool(config.max_running_requests + 1, kv.max_context + page, plan.device)
    if windows is not None:
        windows.buffers = [b for i, b in enumerate(pool.k_buffers) if i in windows.layers]
        windows.buffers += [b for i, b in enumerate(pool.v_buffers) if i in windows.layers]
    states = None
    specs = model.state_specs(plan.dtype)
    if specs:  # a hybrid model: its state layers' slots, two a request row, and the cache's snapshots
        if config.speculative_algorithm and (config.speculative_eagle_topk or 1) > 1:
            raise ValueError(
                f"{plan.arch} keeps recurrent state: tree drafts (--speculative-eagle-topk > 1) are not served on it"
            )
        states = StatePool(specs, config.max_running_requests + 1, kv.state_snapshots, plan.device)
    if config.disable_radix_cache:
        cache = NoPrefixCache()
    elif windows is not None:
        cache = windows.cache = WindowRadixCache(pool, windows)
    else:
        cache = RadixCache(pool) if states is None else StateRadixCache(pool, states)
    scheduler = Scheduler(config, pool, req_pool, cache, kv.max_context)
    scheduler.windows = windows
    if leader and (config.enable_hierarchical_cache or config.hicache_storage_backend):
        scheduler.tier = build_storage_tier(plan, config, pool, cache, tp, hybrid=states is not None)
    if states is not None:
        scheduler.use_states(states)
    target_vocab = _gather_target_vocab(config, model, tp, leader, plan.dtype)
    if leader:  # rank 0 schedules: only it drafts
        draft = draft_device(config, plan.device)
        scheduler.speculator = build_speculator(
            config.speculative_algorithm,
            config.speculative_num_steps or config.speculative_num_draft_tokens,
            kv.max_context,
            {
                "min_match": config.speculative_ngram_min_match_window_size,
                "max_match": config.speculative_ngram_max_match_window_size,
                "topk": config.speculative_eagle_topk,
                "draft_model_path": config.speculative_draft_model_path,
                "device": str(draft),
                # a draft model moved to the CPU computes in fp32 (bf16 math is slow there)
                "dtype": plan.dtype if draft.type == plan.device.type else torch.float32,
                "target_vocab_size": int(plan.hf_config["vocab_size"]),
                "target_model": model,
                "target_model_path": str(plan.model_dir),
                "target_vocab": target_vocab,
            },
            max_nodes=config.speculative_num_draft_tokens,  # (a tree's; its depth as a chain's length)
        )
    # the optional arguments only where a model needs them (backends without the features never get them)
    extra = {"scale": model.attention_scale} if getattr(model, "attention_scale", None) else {}
    out_dim = getattr(model, "attention_v_dim", v_dim)
    # (one backend instance per distinct K/V layer shape: core/model/grouped_attention.py)
    attn = build_attention(
        plan.attn_cls, shapes, num_heads=model.local_heads, v_out=out_dim, pool=pool, device=plan.device, **extra
    )
    runner = ModelRunner(model, attn, pool, req_pool, plan.device, config.enable_deterministic_inference)
    runner.states = states
    runner.windows = windows
    proposer = scheduler.speculator.proposer if scheduler.speculator is not None else None
    layers = getattr(proposer, "feature_layers", None)
    if layers:  # a draft head that reads the target's hidden states (EAGLE-3)
        runner.features = (tuple(layers), proposer.observe)
    if tp is not None and tp.size > 1 and leader:
        from llmkit.core.engine.step_wire import StepBroadcaster

        runner.broadcaster = StepBroadcaster(tp)
        req_pool.write_log = []
        if states is not None:
            states.copy_log = []
    return scheduler, runner


def _gather_target_vocab(config: EngineConfig, model, tp, leader: bool, dtype):
    """Under tensor parallelism, for a draft head that reads the target's embedding or LM head:
    whole copies for rank 0, which drafts alone (every rank takes part; None elsewhere)."""
    if tp is None or tp.size == 1 or not config.speculative_algorithm:
        return None
    from llmkit.core.plugins import registry

    if not getattr(registry().speculative_algorithm(config.speculative_algorithm), "reads_target_vocab", False):
        return None
    from llmkit.core.speculative.target_vocab import gather_target_vocab

    return gather_target_vocab(model, leader, dtype)


def capture_graphs(plan: Plan, config: EngineConfig, model, runner: ModelRunner, kv: KVSize, tp) -> None:
    """Stage 5: CUDA graphs for decode batches up to min(--cuda-graph-max-bs or 256, running)."""
    if plan.device.type != "cuda" or config.disable_cuda_graph or not runner.attn.supports_cuda_graph:
        return
    if not model.supports_cuda_graph:
        log.info("CUDA graphs off: %s's forward cannot be captured (it sizes work on the host)", plan.arch)
        return
    if tp is not None and tp.size > 1:  # graph replay would skip the step broadcast: eager for now
        return
    from llmkit.core.engine.cuda_graph import CudaGraphRunner

    runner.graphs = CudaGraphRunner(
        model,
        runner.attn,
        max_bs=min(config.cuda_graph_max_bs or 256, config.max_running_requests),
        max_context=kv.max_context + config.page_size,
        device=plan.device,
        deterministic=config.enable_deterministic_inference,
        lora=runner.lora,  # (adapter rows replay only through the Triton kernels; else eager)
    )
    runner.graphs.capture()


def _log_loaded(plan: Plan, config: EngineConfig, kv: KVSize, tp, leader: bool, explicit_running, seconds) -> None:
    tokens, gb = kv.tokens, kv.tokens * kv.bytes_per_token / 1e9
    log.info(
        "Loaded %s (%s) on %s in %.1f s: dtype %s%s%s%s, attention %s, KV pool %d tokens (%.2f GB, %s), context %d",
        plan.arch,
        plan.model_dir,
        plan.device,
        seconds,
        str(plan.dtype).removeprefix("torch."),
        ", dummy weights" if config.load_format == "dummy" else "",
        f" + {plan.quant} weights" if plan.quant else " + native GGUF weights" if plan.native else "",
        f", tensor-parallel rank {tp.rank} of {tp.size}" if tp is not None and tp.size > 1 else "",
        plan.attn_name,
        tokens,
        gb,
        str(plan.kv_dtype).removeprefix("torch."),
        kv.max_context,
    )
    if not config.max_total_tokens and leader:
        if plan.device.type == "cuda":
            frac = config.mem_fraction_static or CUDA_MEM_FRACTION
            how = f"{frac:g} of the GPU's memory less what was in use after the weights"
        elif config.mem_fraction_static:
            how = f"--mem-fraction-static {config.mem_fraction_static}"
        else:
            how = (
                f"max(2 x context, {TOKENS_PER_RUNNING_REQUEST} x --max-running-requests {kv.running})"
                ", at most 65,536 tokens or 20% of RAM"
            )
        log.info("KV pool: %d tokens (%.2f GB) from %s; set it with --max-total-tokens N", tokens, gb, how)
    if leader and plan.device.type == "cuda":
        log.info("max running requests: %d%s", kv.running, "" if explicit_running else " (from the KV pool)")


def build_grammar_backend(name: str, tokenizer, vocab_size: int, eos_ids):
    """The structured-output backend the plugin ``name`` registers (``none``'s refuses every
    constraint with a 400)."""
    from llmkit.core.grammar.contract import create_grammar_backend

    # The compile workers start with the first constrained request (a few seconds, once), so a
    # server that never sees one does not carry them.
    return create_grammar_backend(name, tokenizer=tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_ids))
