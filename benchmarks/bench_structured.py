"""Structured-output overhead: N concurrent greedy requests with a JSON schema vs the same requests
without one, interleaved in the same run against a running server.

    python benchmarks/bench_structured.py --url http://127.0.0.1:30000 [--concurrency 16] [--rounds 3]

Prints a markdown table; the issue's bar is constrained throughput >= 80 % of unconstrained.
Throughput is completion tokens per wall-clock second over the whole wave of requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import openai

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genres": {
            "type": "array",
            "items": {"enum": ["drama", "comedy", "action", "horror", "sci-fi"]},
            "maxItems": 3,
        },
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "summary": {"type": "string", "maxLength": 300},
    },
    "required": ["title", "year", "genres", "rating", "summary"],
}
TOPICS = [
    "space",
    "pirates",
    "a detective",
    "robots",
    "a cook",
    "dragons",
    "a heist",
    "time travel",
    "a lighthouse",
    "twins",
    "a marathon",
    "a volcano",
    "ghosts",
    "a chess player",
    "the sea",
    "a train",
]


async def one(client: openai.AsyncOpenAI, args, i: int, constrained: bool) -> tuple[int, float]:
    extra = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "film", "schema": SCHEMA, "strict": True}}
    }
    start = time.perf_counter()
    resp = await client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": f"Describe a film about {TOPICS[i % len(TOPICS)]} as JSON."}],
        max_tokens=args.max_tokens,
        temperature=0,
        **(extra if constrained else {}),
    )
    if constrained and resp.choices[0].finish_reason == "stop":
        json.loads(resp.choices[0].message.content)  # a broken constraint must not pass as fast
    return resp.usage.completion_tokens, time.perf_counter() - start


async def wave(client, args, constrained: bool) -> dict:
    start = time.perf_counter()
    results = await asyncio.gather(*(one(client, args, i, constrained) for i in range(args.concurrency)))
    wall = time.perf_counter() - start
    tokens = sum(t for t, _ in results)
    return {
        "tokens": tokens,
        "wall": wall,
        "tps": tokens / wall,
        "latency": statistics.median(lat for _, lat in results),
    }


async def main_async(args) -> None:
    base = args.url.rstrip("/")
    client = openai.AsyncOpenAI(
        base_url=base if base.endswith("/v1") else base + "/v1", api_key=args.api_key, max_retries=0, timeout=600
    )
    await wave(client, args, True)  # warm-up: compiles (and caches) the grammar, warms the server
    await wave(client, args, False)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(args.rounds):  # interleaved, alternating which goes first, so drift hits both
        for constrained in (False, True) if r % 2 == 0 else (True, False):
            runs[constrained].append(await wave(client, args, constrained))

    def summary(rows: list[dict]) -> dict:
        return {k: statistics.median(r[k] for r in rows) for k in ("tokens", "wall", "tps", "latency")}

    free, constrained = summary(runs[False]), summary(runs[True])
    print(
        f"{args.concurrency} concurrent greedy requests, max_tokens={args.max_tokens}, median of {args.rounds} rounds\n"
    )
    print("| requests | completion tokens | wall s | tokens/s | median latency s |")
    print("|---|---:|---:|---:|---:|")
    for name, s in (("no grammar", free), ("JSON schema", constrained)):
        print(f"| {name} | {s['tokens']:.0f} | {s['wall']:.2f} | {s['tps']:.1f} | {s['latency']:.2f} |")
    print(f"\nconstrained / unconstrained throughput: **{constrained['tps'] / free['tps']:.2f}** (target >= 0.80)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:30000")
    parser.add_argument("--model", default="default")
    parser.add_argument("--api-key", default="None")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
