"""Does memory grow per request once the KV pool is full? tracemalloc and the allocator, in-process.

    python benchmarks/memory_probe.py [--warmup 150] [--requests 300] [--max-total-tokens 4096]

Builds the real server (engine thread, embedded model) with a small KV pool so that it fills and
the radix cache evicts during warm-up, then sends ``--requests`` more (unique prompts, chat and
completions, streaming and not, some JSON-constrained) through the ASGI app. It prints the Python
heap growth per request (tracemalloc, with the top allocation sites), RSS growth per request, and
glibc's malloc statistics (arena bytes vs bytes in use) before and after, which tells a Python
leak from allocator growth.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import os
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def mallinfo() -> dict:
    """glibc's view: arena = bytes obtained from the OS by malloc, uordblks = bytes in use."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        m = libc.mallinfo2()
        return {
            "arena_mb": m.arena / 2**20,
            "in_use_mb": m.uordblks / 2**20,
            "free_mb": m.fordblks / 2**20,
            "mmap_mb": m.hblkhd / 2**20,
        }
    except (OSError, AttributeError):
        return {}


async def load(app, n: int, offset: int) -> int:
    import httpx

    errors = 0
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://probe", timeout=300) as c:

        async def one(i: int) -> None:
            nonlocal errors
            k = offset + i
            text = f"Request {k}: " + " ".join(f"w{(k * 7 + j) % 997}" for j in range(120))
            if k % 4 == 0:
                r = await c.post("/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 8})
            elif k % 4 == 1:
                async with c.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={
                        "model": "m",
                        "stream": True,
                        "max_tokens": 8,
                        "messages": [{"role": "user", "content": text}],
                    },
                ) as r:
                    async for _ in r.aiter_lines():
                        pass
            elif k % 4 == 2:
                r = await c.post(
                    "/v1/chat/completions",
                    json={
                        "model": "m",
                        "max_tokens": 12,
                        "messages": [{"role": "user", "content": text}],
                        "response_format": {"type": "json_object"},
                    },
                )
            else:
                r = await c.post(
                    "/v1/chat/completions",
                    json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}]},
                )
            if r.status_code != 200:
                errors += 1

        for start in range(0, n, 8):  # 8 at a time
            await asyncio.gather(*(one(i) for i in range(start, min(n, start + 8))))
    return errors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    args = ap.parse_args()

    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.launch import build_server
    from llmkit.core.server.config import ServerConfig

    app = build_server(
        EngineConfig(max_total_tokens=args.max_total_tokens), ServerConfig(served_model_name="m", enable_batches=False)
    )
    state = app.state.llmkit
    try:
        errors = asyncio.run(load(app, args.warmup, 0))
        stats = state.client.stats()
        print(
            f"warm-up: {args.warmup} requests, {errors} errors; KV pages free {stats['kv_pages_free']}, "
            f"cached {stats['kv_pages_cached']} of {stats['kv_pages_total']}"
        )
        gc.collect()
        tracemalloc.start(25)
        snap0, rss0, m0 = tracemalloc.take_snapshot(), rss_mb(), mallinfo()
        t0 = time.monotonic()
        errors = asyncio.run(load(app, args.requests, args.warmup))
        gc.collect()
        time.sleep(1.0)  # the engine thread's last frees
        snap1, rss1, m1 = tracemalloc.take_snapshot(), rss_mb(), mallinfo()
        n = args.requests
        py = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
        print(f"measured: {n} requests in {time.monotonic() - t0:.0f} s, {errors} errors")
        print(f"python heap (tracemalloc): {py / 1024:+.0f} KB in all, {py / n / 1024:+.2f} KB per request")
        print(f"RssAnon: {rss0:.0f} -> {rss1:.0f} MB, {(rss1 - rss0) * 1024 / n:+.1f} KB per request")
        if m0:
            print("malloc: " + ", ".join(f"{k} {m0[k]:.0f} -> {m1[k]:.0f}" for k in m0))
        print("top growth by line:")
        for stat in snap1.compare_to(snap0, "lineno")[:12]:
            print("  ", stat)
    finally:
        app.state.shutdown()


if __name__ == "__main__":
    sys.exit(main())
