"""llmkit workers behind SGLang's Model Gateway: the cache-aware policy against round-robin on a
shared-prefix workload, and three workers against one. Runs on CPU with the embedded model.

    python benchmarks/bench_gateway.py [--workers 3] [--systems 8] [--turns 64] [--concurrency 12]

The workload: ``--systems`` long system prompts (distinct from their first word), each followed by
``--turns`` short user turns, sent as streamed chat completions in a shuffled order, at most
``--concurrency`` at once. For each policy a fresh gateway fronts the same workers, whose prefix
caches are flushed first; the hit rate is the workers' own (``llmkit:prefix_cache_hits_total`` /
``..._queries_total``, summed over workers, this run only) and TTFT is measured by the client.
"one worker" sends the same workload to one worker directly. On this machine's 2 cores three
workers share what one had, so their throughput is reported, not expected to triple.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

WORDS = (
    "invoice shipment customer refund warranty account billing ledger order carrier parcel region "
    "policy escalation priority ticket schedule delivery pricing discount contract renewal audit "
    "compliance inventory supplier forecast quota margin payroll onboarding support feedback"
).split()


def workload(systems: int, turns: int, system_words: int, seed: int) -> list[tuple[int, list[dict]]]:
    rng = random.Random(seed)
    prompts = []
    for s in range(systems):
        body = " ".join(rng.choice(WORDS) for _ in range(system_words))
        prompts.append(f"Desk {s}: you are the assistant of team {s}. Follow these notes closely. {body}")
    reqs = []
    for s, system in enumerate(prompts):
        for t in range(turns):
            question = f"Question {t}: what should I do about {rng.choice(WORDS)} number {rng.randint(1, 999)}?"
            reqs.append((s, [{"role": "system", "content": system}, {"role": "user", "content": question}]))
    rng.shuffle(reqs)
    return reqs


async def run_load(url: str, reqs, concurrency: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = failed = 0

    async def one(messages):
        nonlocal tokens, failed
        async with gate:
            start = time.perf_counter()
            first = None
            try:
                stream = await client.chat.completions.create(
                    model="m",
                    messages=messages,
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter() - start
                    if chunk.usage:
                        tokens += chunk.usage.completion_tokens
            except openai.APIError:
                failed += 1
                return
            if first is not None:
                ttfts.append(first)

    start = time.perf_counter()
    await asyncio.gather(*(one(m) for _, m in reqs))
    wall = time.perf_counter() - start
    await client.close()
    ttfts.sort()
    return {
        "requests": len(reqs),
        "failed": failed,
        "wall_s": round(wall, 2),
        "req_s": round(len(reqs) / wall, 2),
        "output_tok_s": round(tokens / wall, 1),
        "ttft_mean_ms": round(1000 * statistics.fmean(ttfts), 1),
        "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2], 1),
        "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
    }


def cache_counters(urls: list[str]) -> tuple[float, float]:
    from metrics_utils import parse_metrics, value

    queries = hits = 0.0
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            samples = parse_metrics(r.read().decode())
        queries += value(samples, "llmkit:prefix_cache_queries_total")
        hits += value(samples, "llmkit:prefix_cache_hits_total")
    return queries, hits


def flush(urls: list[str]) -> None:
    for url in urls:
        urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST"), timeout=30).read()


def measure(target: str, urls: list[str], reqs, args) -> dict:
    flush(urls)
    asyncio.run(run_load(target, reqs[: 2 * len(urls)], len(urls), 2))  # warm-up: compiled paths, sockets
    flush(urls)
    q0, h0 = cache_counters(urls)
    out = asyncio.run(run_load(target, reqs, args.concurrency, args.max_tokens))
    q1, h1 = cache_counters(urls)
    out["prefix_hit_rate"] = round((h1 - h0) / (q1 - q0), 3) if q1 > q0 else 0.0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--systems", type=int, default=8)
    p.add_argument("--turns", type=int, default=64)
    p.add_argument("--system-words", type=int, default=300, help="words per system prompt (~1.3 tokens each)")
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args()

    from gateway_utils import start_router
    from server_utils import start_server, stop_server

    reqs = workload(args.systems, args.turns, args.system_words, args.seed)
    # one engine thread each: the workers share this machine's cores
    common = ["--num-threads", "1", "--batch-storage", "none", "--disable-web-ui", "--max-running-requests", "16"]
    workers = [start_server(common) for _ in range(args.workers)]
    urls = [url for _, url in workers]
    results: dict[str, dict] = {}
    try:
        for policy in args.policies:
            router, gw = start_router(urls, policy=policy)
            try:
                results[f"{args.workers} workers, {policy}"] = measure(gw, urls, reqs, args)
            finally:
                stop_server(router, timeout=10)
            print(json.dumps({policy: results[f"{args.workers} workers, {policy}"]}), flush=True)
        results["1 worker, direct"] = measure(urls[0], urls[:1], reqs, args)
    finally:
        for proc, _ in workers:
            stop_server(proc)
    cmd = "python benchmarks/bench_gateway.py " + " ".join(sys.argv[1:])
    print(f"\n{cmd}\n{args.systems} system prompts x {args.turns} turns, concurrency {args.concurrency}\n")
    print("| setup | prefix hit rate | TTFT mean / p50 / p99 (ms) | req/s | output tok/s | failed |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        ttft = f"{r['ttft_mean_ms']:.0f} / {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}"
        print(f"| {name} | {r['prefix_hit_rate']:.1%} | {ttft} | {r['req_s']} | {r['output_tok_s']} | {r['failed']} |")
    if args.json:
        args.json.write_text(json.dumps({"command": cmd, "results": results}, indent=1))


if __name__ == "__main__":
    main()
