"""Time to first token of a long shared prefix found in the storage tier, against recomputing it
(issue 53's measurement).

A ``--prefix``-token document (4,096 by default) followed by a short question, on the embedded
model (CPU, the default attention backend, the engine in this process):

1. recompute: a fresh engine with the tier on computes the prompt (and writes its blocks);
2. after a restart: a fresh engine on the same store finds the prefix there;
3. second replica (``--backend redis`` only): another engine beside the first, sharing the store.

Each row is the median of ``--repeats`` engines (each request on a cold device cache), all in this
run, so the ratio compares like with like.

    python benchmarks/bench_kv_tiers.py                    # file tier in a temporary folder
    python benchmarks/bench_kv_tiers.py --backend redis    # Debian's redis-server on a free port
    python benchmarks/bench_kv_tiers.py --tenants --prefix 1024   # what timing tells another owner

``--tenants`` measures the timing side channel instead (no tier): owner A sends the prompt twice,
then owner B sends the same prompt twice. With isolation B's first request takes as long as A's
first (B learns nothing about A's prompts); shared, it would take as long as A's second.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import tempfile
import threading
import time

from llmkit.core.engine.builder import build_engine_parts
from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.loop import Engine
from llmkit.core.engine.messages import GenerateRequest, SamplingParams


def ttft(engine: Engine, rid: str, ids: list[int], salt: str | None = None) -> tuple[float, int]:
    """Seconds to the first token, and the prompt tokens served from cache."""
    done, first, cached = threading.Event(), [], []
    t0 = time.perf_counter()

    def sink(o):
        if o.token_ids and not first:
            first.append(time.perf_counter() - t0)
        if o.finished:
            cached.append(o.cached_tokens)
            done.set()

    params = SamplingParams(max_new_tokens=1, temperature=0)
    engine.submit(GenerateRequest(rid, ids, params, cache_salt=salt), sink)
    assert done.wait(3600)
    return first[0], cached[0]


def start(**kw) -> Engine:
    cfg = EngineConfig(page_size=16, device="cpu", grammar_backend="none", **kw)
    engine = Engine(cfg, build_engine_parts(cfg))
    engine.start()
    return engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tenants(ids: list[int], attention: str) -> None:
    """TTFT of owner A's prompt sent by A twice, then by B twice (salts as the server gives them)."""
    engine = start(attention=attention, max_total_tokens=len(ids) * 4)
    try:
        runs = [
            ("A, first", ttft(engine, "a1", ids, "owner:A")),
            ("A, again", ttft(engine, "a2", ids, "owner:A")),
            ("B, same prompt", ttft(engine, "b1", ids, "owner:B")),
            ("B, again", ttft(engine, "b2", ids, "owner:B")),
            ("no keys (shared)", ttft(engine, "s1", ids)),
            ("no keys, again", ttft(engine, "s2", ids)),
        ]
    finally:
        engine.shutdown()
    print(f"\n{len(ids)}-token prompt, embedded model, CPU: the prefix cache across owners")
    print(f"{'':18} {'TTFT (s)':>9} {'cached':>7}")
    for name, (t, cached) in runs:
        print(f"{name:18} {t:9.3f} {cached:7d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=4096, help="tokens of the shared prefix")
    ap.add_argument("--backend", choices=("file", "redis"), default="file")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--attention", default="auto", help="the attention backend (auto: the C kernels on CPU)")
    ap.add_argument("--tenants", action="store_true", help="measure the timing side channel across owners")
    args = ap.parse_args()
    doc = [(i * 7919) % 30000 + 100 for i in range(args.prefix)]
    question = [(i * 104729) % 30000 + 100 for i in range(24)]
    if args.tenants:
        return tenants(doc + question, args.attention)
    redis = None
    with tempfile.TemporaryDirectory() as folder:
        tier = dict(
            enable_hierarchical_cache=True,
            hicache_storage_path=folder,
            max_total_tokens=args.prefix * 2,
            attention=args.attention,
        )
        if args.backend == "redis":
            port = free_port()
            redis = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"])
            time.sleep(0.5)
            extra = json.dumps({"url": f"redis://127.0.0.1:{port}/0", "timeout": 10})
            tier.update(hicache_storage_backend="redis", hicache_storage_backend_extra_config=extra)
        try:
            rows = {"recompute": [], "after a restart": [], "second replica": []}
            for r in range(args.repeats):
                salt = [r + 1]  # a prefix of its own each repeat: the store starts without it
                ids = salt + doc + question
                engine = start(**tier)
                rows["recompute"].append(ttft(engine, f"cold-{r}", ids))
                engine.scheduler.tier.flush()
                if args.backend == "redis":  # a replica beside it, sharing the store
                    other = start(**tier)
                    rows["second replica"].append(ttft(other, f"replica-{r}", ids))
                    other.shutdown()
                engine.shutdown()
                engine = start(**tier)
                rows["after a restart"].append(ttft(engine, f"warm-{r}", ids))
                engine.shutdown()
        finally:
            if redis is not None:
                redis.terminate()
    base = statistics.median(t for t, _ in rows["recompute"])
    print(f"\n{args.prefix}-token prefix + 24-token question, embedded model, CPU, {args.backend} tier")
    print(f"{'':18} {'TTFT (s)':>9} {'cached':>7} {'speed-up':>9}")
    for name, got in rows.items():
        if got:
            t = statistics.median(x for x, _ in got)
            print(f"{name:18} {t:9.3f} {got[0][1]:7d} {base / t:8.1f}x")


if __name__ == "__main__":
    main()
