"""Prefix reuse on a hybrid model in a multi-turn agent trace, against a plain-attention model of
about the same size and against the cache off (issue 49's measurement).

Each of ``--turns`` turns sends the conversation so far: a long system prompt, then every earlier
turn's user message and the answer the model gave, then a new user message; the answer is
``--answer`` greedy tokens. Reported per model: the share of prompt tokens served from the prefix
cache over the trace, and the last turn's time to first token with the cache on and off.

    python benchmarks/bench_hybrid_prefix.py                    # qwen3.5-0.8b-like vs qwen3-0.6b
    python benchmarks/bench_hybrid_prefix.py --system 256 --turns 3   # a quick look

Dummy weights at the presets' real shapes (gpu_presets.py), the engine in this process, CPU.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_presets import PRESETS, write_model_dir  # noqa: E402

from llmkit.core.engine.builder import build_engine_parts  # noqa: E402
from llmkit.core.engine.config import EngineConfig  # noqa: E402
from llmkit.core.engine.loop import Engine  # noqa: E402
from llmkit.core.engine.messages import GenerateRequest, SamplingParams  # noqa: E402


def run_turn(engine, rid: str, ids: list[int], n: int) -> tuple[list[int], int, float]:
    """Greedy tokens, cached prompt tokens and time to first token of one request."""
    done, out, first, cached = threading.Event(), [], [], []
    t0 = time.perf_counter()

    def sink(o):
        if o.token_ids and not first:
            first.append(time.perf_counter() - t0)
        out.extend(o.token_ids)
        if o.finished:
            cached.append(o.cached_tokens)
            done.set()

    params = SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=0)
    engine.submit(GenerateRequest(rid, ids, params), sink)
    assert done.wait(3600)
    return out, cached[0], first[0]


def trace(model_dir: Path, args, cache: bool) -> dict:
    cfg = EngineConfig(
        model_path=str(model_dir),
        load_format="dummy",
        device="cpu",
        grammar_backend="none",
        disable_radix_cache=not cache,
        max_total_tokens=args.system + args.turns * (args.user + args.answer) + 256,
        chunked_prefill_size=args.chunk,
    )
    engine = Engine(cfg, build_engine_parts(cfg))
    engine.start()
    vocab = PRESETS[args.preset_of[model_dir.name]]["vocab_size"]
    rng = random.Random(0)
    words = lambda n: [rng.randrange(2, vocab) for _ in range(n)]  # noqa: E731
    history = words(args.system)
    prompt_total = cached_total = 0
    try:
        for turn in range(args.turns):
            prompt = history + words(args.user)
            answer, cached, ttft = run_turn(engine, f"t{turn}", prompt, args.answer)
            prompt_total += len(prompt)
            cached_total += cached
            history = prompt + answer
    finally:
        engine.shutdown()
    return {"reuse": cached_total / prompt_total, "ttft_last": ttft, "last_prompt": len(prompt)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hybrid", default="qwen3.5-0.8b-like")
    ap.add_argument("--plain", default="qwen3-0.6b")
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=2048)
    args = ap.parse_args()
    args.preset_of = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in (args.hybrid, args.plain):
            d = Path(tmp) / preset
            d.mkdir()
            write_model_dir(preset, d)
            args.preset_of[d.name] = preset
            on, off = trace(d, args, True), trace(d, args, False)
            rows.append((preset, on, off))
            print(
                f"{preset}: reuse {on['reuse']:.1%}, last turn TTFT {on['ttft_last']:.3f} s cached vs "
                f"{off['ttft_last']:.3f} s uncached ({off['ttft_last'] / on['ttft_last']:.1f}x), "
                f"last prompt {on['last_prompt']} tokens",
                flush=True,
            )
    (h, hon, hoff), (p, pon, _) = rows
    print(f"\n| model | prefix reuse | vs {p} | last-turn TTFT cache on / off | speed-up |")
    print("|---|---|---|---|---|")
    for name, on, off in rows:
        print(
            f"| {name} | {on['reuse']:.1%} | {on['reuse'] / pon['reuse']:.2f} | "
            f"{on['ttft_last']:.3f} / {off['ttft_last']:.3f} s | {off['ttft_last'] / on['ttft_last']:.1f}x |"
        )


if __name__ == "__main__":
    main()
