"""How big the KV pool and the running limit are: from the workload on CPU, from the GPU's memory
on CUDA (SGLang's sizing). Explicit flags win."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.stages.windows import split_budget, window_layers
from llmkit.core.kvcache.state_pool import state_bytes
from llmkit.core.model import quantize

log = logging.getLogger("llmkit")


def cpu_pool_tokens(config: EngineConfig, bytes_per_token: int, max_context: int, weight_bytes: int = 0) -> int:
    """The pool on CPU: --max-total-tokens, else --mem-fraction-static of RAM after the weights,
    else the workload's default (at most 65,536 tokens or 20 % of RAM)."""
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


@dataclass
class KVSize:
    tokens: int
    running: int
    bytes_per_token: int
    max_context: int
    state_snapshots: int = 0  # a hybrid model's snapshot slots (its working slots: 2 a request row)
    state_bytes: int = 0  # bytes of one state slot
    # Window layers keeping only their window: (those K/V layers, the largest window) and their
    # pool's tokens (``tokens`` is then the full layers'); see stages/windows.py
    windowed: tuple[list[int], int] | None = None
    window_tokens: int = 0


def snapshot_slots(config: EngineConfig, running: int) -> int:
    """A hybrid model's snapshot slots: --max-mamba-cache-size, else 4 per running request."""
    return config.max_mamba_cache_size or 4 * running


def size_kv(plan, config: EngineConfig, model, tp) -> KVSize:
    """Stage 3: the KV pool's tokens and the running limit (agreed on across tensor-parallel ranks)."""
    max_context = int(config.context_length or plan.hf_config.get("max_position_embeddings", 4096))
    # every K/V layer's own heads and sizes (CausalLM.kv_layer_shapes), from the pool's dtype: a
    # bf16 pool holds twice the tokens of an fp32 one in the same memory
    layer_bytes = [h * (k + v) * plan.kv_dtype.itemsize for h, k, v in model.kv_layer_shapes]
    bytes_per_token = sum(layer_bytes)
    specs = model.state_specs(plan.dtype)
    slot_bytes = state_bytes(specs) if specs else 0
    snapshots = 0
    if plan.device.type == "cuda":
        row_bytes = (max_context + config.page_size) * 8  # a request's row of the slot table (int64)
        # a running request's two working state slots are part of its row's cost
        tokens, running = cuda_sizes(config, bytes_per_token, max_context, row_bytes + 2 * slot_bytes, plan.device)
        if specs:  # snapshots: at most a tenth of the pool's memory, unless asked for
            snapshots = config.max_mamba_cache_size or min(
                snapshot_slots(config, running), tokens * bytes_per_token // 10 // slot_bytes
            )
            tokens -= snapshots * slot_bytes // bytes_per_token
    else:
        weight_bytes = quantize.weight_bytes(model) if config.mem_fraction_static else 0
        tokens = cpu_pool_tokens(config, bytes_per_token, max_context, weight_bytes)
        running = config.max_running_requests or CPU_MAX_RUNNING
        # (on the CPU a slot commits memory once used, as the pool's pages do)
        snapshots = snapshot_slots(config, running) if specs else 0
    windowed = window_layers(plan, config, model, tp) if not specs else None
    window_tokens = 0
    if windowed:  # the same memory, split: the full layers hold more tokens
        tokens, window_tokens = split_budget(tokens, layer_bytes, windowed, config, running, max_context)
    if tp is not None and tp.size > 1:  # every rank's pool holds the same token slots: rank 0's count
        import torch.distributed as dist

        agreed = torch.tensor([tokens], dtype=torch.int64)
        dist.broadcast(agreed, 0, group=tp.group)
        tokens = int(agreed.item())
    max_context = fit_context(max_context, tokens, config)
    return KVSize(tokens, running, bytes_per_token, max_context, snapshots, slot_bytes, windowed, window_tokens)


def fit_context(max_context: int, tokens: int, config: EngineConfig) -> int:
    """The context a request may reach: at most what the pool holds for one request alone (less a
    page and the drafts in flight), as SGLang caps its input length. A longer one could not be
    preempted to room by anything and would wait for ever."""
    drafts = config.speculative_num_draft_tokens if config.speculative_algorithm else 0
    fits = tokens - config.page_size - (drafts or 0)
    if fits >= max_context:
        return max_context
    log.warning(
        "context length %d cut to %d tokens: the KV pool holds %d (raise --max-total-tokens or "
        "--mem-fraction-static for longer requests)",
        max_context,
        fits,
        tokens,
    )
    return max(fits, 1)
