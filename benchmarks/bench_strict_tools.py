"""Strict tool calling: how often a tool call fails to parse or validate with and without the
constraint, and what the constraint costs, on one running server.

    llmkit serve --tool-call-parser hermes --disable-strict-tool-calls &
    python benchmarks/bench_strict_tools.py --url http://127.0.0.1:30000 [--requests 200]

With ``--disable-strict-tool-calls`` only tools sent with ``strict: true`` are constrained, so the
same server answers both arms: each wave of ``--concurrency`` seeded requests is sent once with
strict tools and once without (interleaved, so both see the same machine). 4 tools, two example
turns that call tools, then a question; ``tool_choice`` "auto", temperature 1.

A request fails when its content keeps an unparsed ``<tool_call>`` or a call's arguments fail
their tool's schema; those that ended on ``max_tokens`` (a call cut off) are also counted apart.
Cost: wall seconds per completion token and per request, constrained over unconstrained (the
goal is <= 1.1x). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import jsonschema
import openai

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "get_time": {
        "type": "object",
        "properties": {"timezone": {"type": "string"}},
        "required": ["timezone"],
        "additionalProperties": False,
    },
    "search_web": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query", "max_results"],
        "additionalProperties": False,
    },
    "convert_currency": {
        "type": "object",
        "properties": {
            "amount": {"type": "number"},
            "source": {"type": "string", "enum": ["EUR", "USD", "JPY", "GBP"]},
            "target": {"type": "string", "enum": ["EUR", "USD", "JPY", "GBP"]},
        },
        "required": ["amount", "source", "target"],
        "additionalProperties": False,
    },
}
EXAMPLES = [
    {"role": "user", "content": "What's the weather in Paris?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
    },
    {"role": "user", "content": "How much is 20 dollars in euros?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "convert_currency", "arguments": {"amount": 20, "source": "USD", "target": "EUR"}}\n</tool_call>',
    },
]
QUESTIONS = [
    "And the weather in Berlin?",
    "What time is it in Tokyo?",
    "Search the web for the tallest building in the world.",
    "Convert 100 yen to pounds.",
    "Is it raining in London?",
    "Find three articles about volcanoes.",
    "What time is it in New York right now?",
    "How many euros is 5 pounds?",
]


def tools(strict: bool) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {"name": n, "description": n.replace("_", " "), "parameters": s, "strict": strict},
        }
        for n, s in SCHEMAS.items()
    ]


def failed(message) -> bool:
    if "<tool_call>" in (message.content or ""):
        return True
    for tc in message.tool_calls or []:
        try:
            jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS[tc.function.name])
        except (ValueError, KeyError, jsonschema.ValidationError):
            return True
    return False


async def one(client, model: str, seed: int, strict: bool, max_tokens: int) -> tuple[bool, bool, int, int]:
    r = await client.chat.completions.create(
        model=model,
        messages=[*EXAMPLES, {"role": "user", "content": QUESTIONS[seed % len(QUESTIONS)]}],
        tools=tools(strict),
        tool_choice="auto",
        temperature=1,
        seed=seed,
        max_tokens=max_tokens,
    )
    m, bad = r.choices[0].message, failed(r.choices[0].message)
    # a call max_tokens cut off fails too, but no grammar can help it: counted apart
    return bad, bad and r.choices[0].finish_reason == "length", len(m.tool_calls or []), r.usage.completion_tokens


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    client = openai.AsyncOpenAI(base_url=args.url + "/v1", api_key="None", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    stats = {s: {"failed": 0, "cut": 0, "calls": 0, "tokens": 0, "wall": 0.0} for s in (True, False)}
    for start in range(0, args.requests, args.concurrency):
        seeds = range(start, min(start + args.concurrency, args.requests))
        for strict in (True, False):
            t = time.perf_counter()
            results = await asyncio.gather(*(one(client, model, s, strict, args.max_tokens) for s in seeds))
            st = stats[strict]
            st["wall"] += time.perf_counter() - t
            for bad, cut, calls, tokens in results:
                st["failed"] += bad
                st["cut"] += cut
                st["calls"] += calls
                st["tokens"] += tokens
        done = {
            ("strict" if k else "free"): (v["failed"], v["cut"], v["tokens"], round(v["wall"], 1))
            for k, v in stats.items()
        }
        print(f"after {seeds.stop} requests (failed, cut off, tokens, wall s): {done}", file=sys.stderr, flush=True)
    n = args.requests
    print(
        f"| {n} requests, 4 tools, temperature 1, max_tokens={args.max_tokens} | failed | calls | tokens | wall s | ms/token |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for strict, name in ((False, "unconstrained"), (True, "strict (constrained)")):
        st = stats[strict]
        per_token = 1000 * st["wall"] / max(st["tokens"], 1)
        print(
            f"| {name} | {st['failed']} ({100 * st['failed'] / n:.1f} %) | {st['cut']} | {st['calls']} | {st['tokens']} | {st['wall']:.1f} | {per_token:.1f} |"
        )
    c, u = stats[True], stats[False]
    per_token = (c["wall"] / max(c["tokens"], 1)) / (u["wall"] / max(u["tokens"], 1))
    print(
        f"\nConstrained / unconstrained: {per_token:.2f}x per completion token, {c['wall'] / u['wall']:.2f}x per request."
    )


if __name__ == "__main__":
    asyncio.run(main())
