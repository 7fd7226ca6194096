"""CPU decode throughput of a Qwen3-MoE-shaped model (random weights, small enough for a laptop)
against transformers on the same weights, measured interleaved in one run.

    python benchmarks/bench_moe_cpu.py [--rounds 2] [--tokens 64] [--threads N]

(a) single stream: one greedy request of ``--tokens`` new tokens;
(b) 16 concurrent: 16 requests at once (llmkit's continuous batching) against transformers'
    batched ``generate`` of the same 16 prompts (equal lengths, so no padding).
Both run in-process in fp32 (llmkit's engine directly, no HTTP), every new token forced (EOS
banned), tokens/s = generated tokens / wall time including the prefill.
The shape keeps Qwen3-30B-A3B's ratios where it matters for MoE: 64 experts, top-8, expert width
a fraction of the hidden size, so most expert weights are idle at each token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
PROMPT_LEN = 32


def build(path: Path):
    import transformers

    from model_utils import copy_embedded_tokenizer

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**SHAPE), dtype=torch.float32)
    model.save_pretrained(str(path))
    copy_embedded_tokenizer(path)
    return model.eval()


def prompts(n: int) -> list[list[int]]:
    return [[(97 * i + 13 * j) % 8000 + 100 for j in range(PROMPT_LEN)] for i in range(n)]


def ours(engine, batch: list[list[int]], tokens: int) -> float:
    from llmkit.core.engine.messages import GenerateRequest, SamplingParams

    left = threading.Semaphore(0)

    def sink(o):
        if o.finished:
            left.release()

    t0 = time.perf_counter()
    for i, ids in enumerate(batch):
        params = SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens, temperature=0)
        engine.submit(GenerateRequest(f"b{time.monotonic_ns()}-{i}", ids, params), sink)
    for _ in batch:
        left.acquire()
    return len(batch) * tokens / (time.perf_counter() - t0)


def theirs(model, batch: list[list[int]], tokens: int) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(
            torch.tensor(batch), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0
        )
    return len(batch) * tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from model_utils import start_engine

    with tempfile.TemporaryDirectory() as d:
        ref = build(Path(d))
        engine = start_engine(model_path=d, device="cpu", max_total_tokens=4096, num_threads=args.threads)
        try:
            ours(engine, prompts(1), 4)  # warm-up both
            theirs(ref, prompts(1), 4)
            rows = {"single": ([], []), "16 concurrent": ([], [])}
            for _ in range(args.rounds):
                for name, n in (("single", 1), ("16 concurrent", 16)):
                    rows[name][0].append(ours(engine, prompts(n), args.tokens))
                    rows[name][1].append(theirs(ref, prompts(n), args.tokens))
        finally:
            engine.shutdown()
    print(f"Qwen3-MoE-shaped, {SHAPE['num_experts']} experts top-{SHAPE['num_experts_per_tok']}, fp32, "
          f"{torch.get_num_threads()} threads, {args.tokens} new tokens, median of {args.rounds} rounds")  # fmt: skip
    print("| workload | llmkit tok/s | transformers tok/s | ratio |")
    print("|---|---|---|---|")
    for name, (a, b) in rows.items():
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"| {name} | {ma:.1f} | {mb:.1f} | {ma / mb:.2f}x |")


if __name__ == "__main__":
    main()
