"""A KV pool, radix cache and storage tier without a model, and a real ``redis-server`` on
loopback, for the storage tier's tests."""

from __future__ import annotations

import shutil
import subprocess
import time

import torch

from llmkit.core.kvcache.kv_pool import KVCachePool
from llmkit.core.kvcache.radix_cache import RadixCache
from llmkit.core.kvcache.storage_tier import StorageTier

MODEL = {"arch": "TestLM", "weights": "w0", "dtype": "torch.float32"}
REDIS = shutil.which("redis-server") or "/usr/bin/redis-server"


def make_tier(store, *, dtype=torch.float32, model=MODEL, timeout=5.0, pages=64, page_size=16, policy="write_through"):
    """``(pool, cache, tier)``: 2 layers of 2 K/V heads of 4 channels."""
    pool = KVCachePool(
        num_layers=2, num_pages=pages, page_size=page_size, num_kv_heads=2, head_dim=4, dtype=dtype, device="cpu"
    )
    cache = RadixCache(pool)
    return pool, cache, StorageTier(store, pool, cache, model, "test", timeout, policy)


def compute(pool, cache, ids: list[int], seed: int = 0, namespace: int = 0) -> torch.Tensor:
    """Fill pages for ``ids`` with random K/V (as a prefill would) and cache them; their slots."""
    pages = pool.allocate(len(ids) // pool.page_size)
    slots = pool.page_slots(pages)
    g = torch.Generator().manual_seed(seed)
    for buf in pool.k_buffers + pool.v_buffers:
        rows = torch.randn((len(slots), *buf.shape[1:]), generator=g)
        buf.view(torch.uint8)[slots] = rows.to(buf.dtype).view(torch.uint8)
    cache.insert(ids, slots, namespace)
    return slots


def rows(pool, slots: torch.Tensor) -> list[torch.Tensor]:
    """The pages' bytes in every buffer (compared bit for bit)."""
    return [buf.view(torch.uint8)[slots].clone() for buf in pool.k_buffers + pool.v_buffers]


def fetch(tier, ids: list[int], rid: str = "r", namespace: str = "", cache_namespace: int = 0) -> int:
    """Prefetch and load ``ids`` as the scheduler does for a request; the tokens loaded."""
    tier.prefetch(rid, ids, namespace, cache_namespace)
    deadline = time.monotonic() + 30
    while not tier.ready(rid):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return tier.load(rid, ids, cache_namespace)


def start_redis(port: int) -> subprocess.Popen:
    """``redis-server`` on 127.0.0.1:``port``, nothing saved to disk; returns once it answers."""
    import socket

    proc = subprocess.Popen(
        [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")
