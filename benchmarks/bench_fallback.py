"""The transformers fallback against the native class of the same model (issue 51's measurement).

The same Llama (the embedded model's shape, dummy fp32 weights, ``--load-format dummy``) served in
this process twice: by llmkit's own ``LlamaForCausalLM`` and by ``--model-impl transformers``
(transformers' modeling code with llmkit's paged attention). Reported: decode throughput with
``--concurrency`` requests at once and single stream, and the fallback's ratio to native.

    python benchmarks/bench_fallback.py [--concurrency 16] [--new 64] [--prompt 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_presets import make_prompts, write_model_dir  # noqa: E402

from llmkit.core.engine.builder import build_engine_parts  # noqa: E402
from llmkit.core.engine.config import EngineConfig  # noqa: E402
from llmkit.core.engine.loop import Engine  # noqa: E402
from llmkit.core.engine.messages import GenerateRequest, SamplingParams  # noqa: E402


def throughput(engine, prompts: list[list[int]], n: int) -> float:
    """Generated tokens per second with every prompt submitted at once (``n`` tokens each)."""
    done = [threading.Event() for _ in prompts]
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=0)
        engine.submit(
            GenerateRequest(f"b{time.monotonic_ns()}-{i}", ids, params), lambda o, ev=done[i]: o.finished and ev.set()
        )
    for ev in done:
        assert ev.wait(1800)
    return len(prompts) * n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_model_dir("smollm2-135m", Path(tmp))
        rows = {}
        for impl in ("llmkit", "transformers"):
            cfg = EngineConfig(
                model_path=tmp, load_format="dummy", device="cpu", model_impl=impl, grammar_backend="none",
                max_running_requests=args.concurrency, disable_radix_cache=True,
            )  # fmt: skip
            engine = Engine(cfg, build_engine_parts(cfg))
            engine.start()
            try:
                prompts = make_prompts(args.concurrency, args.prompt, 49152, seed=1)
                throughput(engine, prompts[:2], 4)  # warm-up
                single = throughput(engine, prompts[:1], args.new)
                many = throughput(engine, prompts, args.new)
            finally:
                engine.shutdown()
            rows[impl] = (single, many)
            print(
                f"{impl:13s} single {single:7.1f} tok/s   {args.concurrency} concurrent {many:7.1f} tok/s", flush=True
            )
    (s0, m0), (s1, m1) = rows["llmkit"], rows["transformers"]
    print(f"fallback / native: single {s1 / s0:.2f}x, {args.concurrency} concurrent {m1 / m0:.2f}x")


if __name__ == "__main__":
    main()
