"""The storage tier under the radix cache (``--enable-hierarchical-cache``), built for this model:
its entries keyed by the weights, dtypes and layout, and refused where its blocks cannot hold
what the cache needs yet."""

from __future__ import annotations

import json
import logging

from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.stages.plan import Plan
from llmkit.core.kvcache.radix_cache import RadixCache
from llmkit.core.kvcache.window_radix_cache import WindowRadixCache

log = logging.getLogger("llmkit")


def build_storage_tier(plan: Plan, config: EngineConfig, pool, cache, tp, hybrid: bool):
    """The storage tier under the radix cache (``--enable-hierarchical-cache``), its entries keyed
    by this model's weights, dtypes and layout (``core/kvcache/tier_keys.py``)."""
    from llmkit.core.kvcache.storage_tier import StorageTier
    from llmkit.core.kvcache.tier_keys import random_nonce, weight_files, weights_fingerprint
    from llmkit.core.plugins import registry

    # Not yet: a hybrid model's state snapshots and window layers' pages would need entries of
    # their own; TP ranks each hold a shard of the heads (a write per rank).
    why = (
        "--disable-radix-cache"
        if config.disable_radix_cache
        else "a hybrid model's recurrent state"
        if hybrid
        else "sliding-window layers' own pages (--swa-full serves them)"
        if not isinstance(cache, RadixCache) or isinstance(cache, WindowRadixCache)
        else "tensor parallelism"
        if tp is not None and tp.size > 1
        else None
    )
    if why:
        raise ValueError(f"--enable-hierarchical-cache is not served with {why} yet")
    name = config.hicache_storage_backend or registry().default("kv_storage")
    extra = json.loads(config.hicache_storage_backend_extra_config or "{}")
    store = registry().kv_storage(name)(path=config.hicache_storage_path, **extra)
    if plan.loader == "dummy":  # random weights: no other process computes this K/V
        weights = random_nonce()
    else:
        weights = weights_fingerprint(weight_files(plan.model_dir, plan.gguf_path))
    model = {
        "arch": plan.arch,
        "class": f"{plan.model_cls.__module__}.{plan.model_cls.__qualname__}",
        "weights": weights,
        "dtype": str(plan.dtype),
        "quant": [plan.quant, config.quantization_group_size, plan.native],
        "device": plan.device.type,
        "tp": [1, 0],
    }
    log.info(
        "KV storage tier: %s (%s), write policy %s", name, config.hicache_storage_path, config.hicache_write_policy
    )
    return StorageTier(store, pool, cache, model, name, config.hicache_prefetch_timeout, config.hicache_write_policy)
