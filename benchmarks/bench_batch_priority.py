"""Online latency while a batch runs: TTFT p50 of online chat requests, idle vs during a 500-line
batch on the same server (batch lines run at lower priority, a bounded number in flight).

    python benchmarks/bench_batch_priority.py [--lines 500] [--online 12] [--update-readme]
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))


def ttft(client, i: int) -> float:
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": f"Give me one fact about the number {i}."}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            elapsed = time.perf_counter() - t0
            for _ in stream:
                pass
            return elapsed
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=500)
    ap.add_argument("--online", type=int, default=12)
    ap.add_argument("--update-readme", action="store_true")
    args = ap.parse_args()

    import tempfile

    import openai

    from server_utils import start_server, stop_server

    storage = tempfile.mkdtemp(prefix="llmkit-bench-")
    proc, url = start_server(["--file-storage-path", storage])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        ttft(client, -1)  # warm-up
        idle = [ttft(client, i) for i in range(args.online)]
        lines = [
            json.dumps(
                {
                    "custom_id": f"req-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "m",
                        "max_tokens": 32,
                        "messages": [{"role": "user", "content": f"Write a line about {i}."}],
                    },
                }
            )
            for i in range(args.lines)
        ]
        f = client.files.create(file=("batch.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while client.batches.retrieve(batch.id).status in ("validating",):
            time.sleep(0.2)
        time.sleep(2.0)  # let the runner fill its in-flight window
        busy = [ttft(client, 100 + i) for i in range(args.online)]
        state = client.batches.retrieve(batch.id)
        client.batches.cancel(batch.id)
    finally:
        stop_server(proc)
    p50_idle, p50_busy = statistics.median(idle), statistics.median(busy)
    report = "\n".join(
        [
            "| online TTFT p50 | idle | during a batch | ratio | target |",
            "|---|---:|---:|---:|---|",
            f"| chat, 8 tokens, {args.online} requests | {p50_idle * 1000:.0f} ms | {p50_busy * 1000:.0f} ms | "
            f"{p50_busy / p50_idle:.2f}x | ≤ 2x |",
            "",
            f"Command: `python benchmarks/bench_batch_priority.py --lines {args.lines} --online {args.online}`; "
            f"the batch was `{state.status}` with {state.request_counts.completed}/{state.request_counts.total} lines "
            f"done when the online measurements ended ({time.strftime('%Y-%m-%d')}).",
        ]
    )
    print(report)
    if args.update_readme:
        readme = ROOT / "README.md"
        text = readme.read_text()
        start, end = "<!-- bench_batch:start -->", "<!-- bench_batch:end -->"
        block = f"{start}\n{report}\n{end}"
        if start in text:
            text = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
        else:
            text = text.rstrip() + "\n\nBatch lines yield to online traffic:\n\n" + block + "\n"
        readme.write_text(text)


if __name__ == "__main__":
    main()
