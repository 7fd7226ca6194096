"""Soak: mixed load against a real ``llmkit serve`` for a given time, sampled each minute.

    python benchmarks/soak.py --minutes 120 [--concurrency 8] [--interval 60] [-- extra serve flags]

Starts ``llmkit serve`` on a free loopback port (the embedded model unless a flag says otherwise),
runs ``--concurrency`` clients that each loop over a mix of requests (short and long chat and
completions, streaming, JSON-schema output, forced tool calls, a small batch now and then) of which
10% of the streams are dropped after the first chunk (deliberate disconnects), and every
``--interval`` seconds records the server's RssAnon+VmSwap, KV pages in use, running and waiting
requests, requests done and errors. It stops by itself after ``--minutes``, lets the server go idle,
and prints a Markdown table and the verdict: RSS growth after the first ``--warmup-minutes`` < 5%,
no errors other than the deliberate disconnects, KV pages in use back to 0.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

TOPICS = ["the ocean", "volcanoes", "bread", "chess", "the moon", "bicycles", "coffee", "jazz", "glaciers"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def proc_mem_mb(pid: int) -> float:
    """RssAnon + VmSwap: resident anonymous memory, counting what swap hides (one process: the
    engine runs on a thread of the server)."""
    total = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "VmSwap:")):
                total += int(line.split()[1])
    return total / 1024


class Load:
    def __init__(self, base: str, rng: random.Random) -> None:
        self.base = base
        self.rng = rng
        self.done = Counter()  # kind -> requests answered as expected
        self.errors = Counter()  # "kind: what" -> count
        self.disconnects = 0
        self.stop = False

    def chat(self, content: str, **kw) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": content}], **kw}

    async def one(self, c) -> None:
        r = self.rng.random()
        topic = self.rng.choice(TOPICS)
        salt = self.rng.randrange(10**6)  # unique prompts: the radix cache fills and evicts
        if r < 0.25:
            kind, body = "short", self.chat(f"({salt}) One sentence about {topic}.", max_tokens=16)
        elif r < 0.35:
            kind, body = (
                "long",
                {"model": "m", "prompt": f"({salt}) " + f"An essay on {topic}. " * 60, "max_tokens": 128},
            )
            return await self.plain(c, kind, "/v1/completions", body)
        elif r < 0.65:
            kind, body = "stream", self.chat(f"({salt}) Tell me about {topic}.", max_tokens=48, stream=True)
            return await self.stream(c, kind, body, drop=self.rng.random() < 0.10 / 0.30)
        elif r < 0.80:
            kind, body = (
                "json",
                self.chat(
                    f"({salt}) A person who likes {topic}, as JSON.",
                    max_tokens=40,
                    response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
                ),
            )
        elif r < 0.97:
            kind, body = (
                "tools",
                self.chat(f"({salt}) Weather in Paris?", max_tokens=40, tools=TOOLS, tool_choice="required"),
            )
        else:
            return await self.batch(c)
        await self.plain(c, kind, "/v1/chat/completions", body)

    async def plain(self, c, kind: str, path: str, body: dict) -> None:
        try:
            resp = await c.post(path, json=body)
            if resp.status_code == 200:
                self.done[kind] += 1
            else:
                self.errors[f"{kind}: HTTP {resp.status_code}"] += 1
        except Exception as exc:  # noqa: BLE001 - counted, the soak goes on
            self.errors[f"{kind}: {type(exc).__name__}"] += 1

    async def stream(self, c, kind: str, body: dict, drop: bool) -> None:
        try:
            async with c.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    self.errors[f"{kind}: HTTP {resp.status_code}"] += 1
                    return
                last = ""
                async for line in resp.aiter_lines():
                    if drop and line.startswith("data: "):
                        self.disconnects += 1  # leave mid-stream: the server must abort and free
                        return
                    if line:
                        last = line
                if last == "data: [DONE]":
                    self.done[kind] += 1
                else:
                    self.errors[f"{kind}: no [DONE]"] += 1
        except Exception as exc:  # noqa: BLE001
            self.errors[f"{kind}: {type(exc).__name__}"] += 1

    async def batch(self, c) -> None:
        lines = [
            {
                "custom_id": f"s{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": self.chat(f"Say {i}.", max_tokens=8),
            }
            for i in range(4)
        ]
        data = ("\n".join(json.dumps(x) for x in lines) + "\n").encode()
        try:
            f = await c.post("/v1/files", files={"file": ("b.jsonl", io.BytesIO(data))}, data={"purpose": "batch"})
            b = await c.post(
                "/v1/batches",
                json={"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
            )
            bid = b.json()["id"]
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                st = (await c.get(f"/v1/batches/{bid}")).json()
                if st["status"] in ("completed", "failed", "cancelled", "expired"):
                    break
                await asyncio.sleep(1)
            if st["status"] == "completed" and st["request_counts"]["completed"] == 4:
                self.done["batch"] += 1
            else:
                self.errors[f"batch: {st['status']}"] += 1
        except Exception as exc:  # noqa: BLE001
            self.errors[f"batch: {type(exc).__name__}"] += 1

    async def worker(self) -> None:
        import httpx

        async with httpx.AsyncClient(base_url=self.base, timeout=300) as c:
            while not self.stop:
                await self.one(c)


async def run(args, proc, base: str) -> list[dict]:
    import httpx

    load = Load(base, random.Random(args.seed))
    workers = [asyncio.create_task(load.worker()) for _ in range(args.concurrency)]
    rows = []
    t0 = time.monotonic()
    end = t0 + args.minutes * 60

    async def sample(label: str) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            info = (await c.get("/get_server_info")).json()
        rows.append(
            {
                "t": label,
                "rss_mb": proc_mem_mb(proc.pid),
                "kv_in_use": info["kv_pages_in_use"],
                "kv_cached": info["kv_pages_cached"],
                "running": info["num_running_reqs"],
                "waiting": info["num_waiting_reqs"],
                "done": sum(load.done.values()),
                "disconnects": load.disconnects,
                "errors": sum(load.errors.values()),
            }
        )
        print(rows[-1], flush=True)

    await sample("0")
    while time.monotonic() < end:
        await asyncio.sleep(min(args.interval, max(0.0, end - time.monotonic())))
        await sample(f"{(time.monotonic() - t0) / 60:.1f}")
    load.stop = True
    await asyncio.wait(workers, timeout=600)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # idle: aborted and finished requests give their pages back
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            info = (await c.get("/get_server_info")).json()
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["kv_pages_in_use"] == 0:
            break
        await asyncio.sleep(1)
    await sample("end (idle)")
    print("answered by kind:", dict(load.done), "errors:", dict(load.errors) or "none", flush=True)
    return rows, load


def table(rows: list[dict]) -> str:
    head = "| minute | RSS (MB) | KV pages in use | KV pages cached | running | waiting | requests done | disconnects | errors |"
    out = [head, "|" + "---|" * 9]
    for r in rows:
        out.append(
            f"| {r['t']} | {r['rss_mb']:.0f} | {r['kv_in_use']} | {r['kv_cached']} | {r['running']} | "
            f"{r['waiting']} | {r['done']} | {r['disconnects']} | {r['errors']} |"
        )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, required=True, help="how long to run the load")
    ap.add_argument("--interval", type=float, default=60.0, help="seconds between samples")
    ap.add_argument("--warmup-minutes", type=float, default=10.0, help="RSS growth is measured after this")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("serve_args", nargs="*", help="extra llmkit serve flags (after --)")
    args = ap.parse_args()
    import tempfile

    from server_utils import start_server, stop_server

    with tempfile.TemporaryDirectory(prefix="llmkit-soak-") as store:
        proc, base = start_server(["--file-storage-path", store, *args.serve_args])  # 127.0.0.1 only
        try:
            rows, load = asyncio.run(run(args, proc, base))
        finally:
            stop_server(proc)
    print(table(rows))
    after = [r for r in rows[:-1] if r["t"] != "0" and float(r["t"]) >= args.warmup_minutes]
    growth = (rows[-2]["rss_mb"] / after[0]["rss_mb"] - 1) * 100 if len(after) >= 2 else float("nan")
    ok_rss = growth < 5 if growth == growth else None
    ok_err = not load.errors
    ok_kv = rows[-1]["kv_in_use"] == 0
    print(
        f"\nRSS growth after warm-up: {growth:+.1f}% ({'ok' if ok_rss else 'n/a' if ok_rss is None else 'FAIL'}); "
        f"errors besides deliberate disconnects: {sum(load.errors.values())} ({'ok' if ok_err else 'FAIL'}); "
        f"KV pages in use at the end: {rows[-1]['kv_in_use']} ({'ok' if ok_kv else 'FAIL'})"
    )
    return 0 if ok_err and ok_kv and ok_rss is not False else 1


if __name__ == "__main__":
    sys.exit(main())
