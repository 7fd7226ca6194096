"""Embedding throughput and latency: ``llmkit serve`` over HTTP against sentence-transformers'
``encode`` in-process, on the packaged all-MiniLM-L6-v2, measured in one run.

    python benchmarks/bench_embeddings.py [--sentences 2000] [--clients 8] [--json FILE]

The corpus is ``--sentences`` seeded sentences of 8-64 words. The baseline is
``SentenceTransformer.encode(corpus, batch_size=32)`` in this process (it sorts by length, so its
batches carry little padding). llmkit is then served (``--batch-storage none``) and the same
corpus sent over HTTP by ``--clients`` threads, each with its own connection, in two shapes: one
sentence per request (a stream of queries) and 32 per request (a document indexer). Last, one
sentence at a time on the idle server: the p50 and p90 of 50 requests, the client's wall time.
Before all that, a GEMM the size of the model's feed-forward gives the machine's fp32 ceiling: the
encoder is nearly all GEMMs, so neither side can beat it.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be has had "
    "not or have one their new first after who been its also they two more but time other may can into "
    "would such over year during most only when some years three city where people part between river "
    "model search index query document answer music garden winter market station bridge history science"
).split()


def corpus(n: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64))).capitalize() + "." for _ in range(n)]


def gemm_ceiling() -> float:
    """GFLOP/s of a [4096, 384] x [384, 1536] fp32 GEMM, the encoder's largest, best of 5."""
    import torch

    a, w = torch.randn(4096, 384), torch.randn(1536, 384)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(5):
            torch.nn.functional.linear(a, w)
        best = min(best, (time.perf_counter() - t) / 5)
    return 2 * 4096 * 384 * 1536 / best / 1e9


def baseline(sentences: list[str]) -> tuple[float, int]:
    """sentence-transformers' sentences/s at batch 32, and the corpus's token count."""
    from sentence_transformers import SentenceTransformer

    from llmkit.core.model.loader.embedded_encoder import embedded_encoder_dir

    model = SentenceTransformer(str(embedded_encoder_dir()), device="cpu")
    model.encode(sentences[:64], batch_size=32)  # warm-up
    t = time.perf_counter()
    model.encode(sentences, batch_size=32)
    elapsed = time.perf_counter() - t
    tokens = sum(map(len, model.tokenizer(sentences)["input_ids"]))
    return len(sentences) / elapsed, tokens


def over_http(url: str, sentences: list[str], clients: int, per_request: int) -> float:
    """Sentences/s with ``clients`` threads sending ``per_request`` sentences a request."""
    import httpx

    work: queue.Queue = queue.Queue()
    for i in range(0, len(sentences), per_request):
        work.put(sentences[i : i + per_request])
    failures: list[str] = []

    def client() -> None:
        with httpx.Client(base_url=url, timeout=300) as http:
            while True:
                try:
                    chunk = work.get_nowait()
                except queue.Empty:
                    return
                resp = http.post("/v1/embeddings", json={"model": "m", "input": chunk})
                if resp.status_code != 200 or len(resp.json()["data"]) != len(chunk):
                    failures.append(resp.text[:200])

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed: {failures[0]}")
    return len(sentences) / elapsed


def single_latency(url: str, sentences: list[str], n: int = 50) -> tuple[float, float]:
    import httpx

    times = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for s in sentences[:5]:  # warm the connection and the route
            http.post("/v1/embeddings", json={"model": "m", "input": s})
        for s in sentences[:n]:
            t = time.perf_counter()
            http.post("/v1/embeddings", json={"model": "m", "input": s}).raise_for_status()
            times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return statistics.median(times), times[int(0.9 * len(times))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from server_utils import start_server, stop_server

    sentences = corpus(a.sentences)
    ceiling = gemm_ceiling()
    st_rate, tokens = baseline(sentences)
    proc, url = start_server(["--model-path", "all-MiniLM-L6-v2", "--batch-storage", "none"])
    try:
        over_http(url, sentences[:64], a.clients, 1)  # warm-up
        one = over_http(url, sentences, a.clients, 1)
        many = over_http(url, sentences, a.clients, 32)
        p50, p90 = single_latency(url, sentences)
    finally:
        stop_server(proc)
    # MiniLM-L6: 6 layers of 4 x 384^2 + 2 x 384 x 1536 multiply-adds a token (attention aside)
    flops = tokens * 6 * 2 * (4 * 384 * 384 + 2 * 384 * 1536)
    rows = [
        ("sentence-transformers encode, batch 32 (in-process)", st_rate),
        (f"llmkit HTTP, {a.clients} clients, 1 sentence a request", one),
        (f"llmkit HTTP, {a.clients} clients, 32 sentences a request", many),
    ]
    print(f"{a.sentences} sentences, {tokens} tokens; fp32 GEMM ceiling {ceiling:.0f} GFLOP/s\n")
    print("| setup | sentences/s | x sentence-transformers | GEMM GFLOP/s (share of the ceiling) |")
    print("|---|---|---|---|")
    for name, rate in rows:
        gflops = flops * rate / len(sentences) / 1e9
        print(f"| {name} | {rate:.0f} | {rate / st_rate:.2f} | {gflops:.0f} ({gflops / ceiling:.0%}) |")
    print(f"\nsingle sentence on an idle server: p50 {p50:.1f} ms, p90 {p90:.1f} ms")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "sentences": a.sentences,
                    "tokens": tokens,
                    "gemm_ceiling_gflops": ceiling,
                    "rates": dict(rows),
                    "p50_ms": p50,
                    "p90_ms": p90,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
