"""The engine's host time per step, with a forward that does no work: everything a step costs
outside the model, split by phase, at batch 1, 64 and 256. Runs on CPU (no GPU needed).

    python benchmarks/bench_host_overhead.py [--batch 1 64 256] [--steps 200] [--markdown] [--no-phases]

The engine is the real one (scheduler, model runner's input building and attention metadata,
sampler, output processor, detokenizer, the sinks a server's client gets); only the model's forward
is replaced by precomputed logits (random, cycled over 8 sets, so sampled tokens and their text
change every step). The tokenizer and vocabulary (49,152) are the embedded SmolLM2's; its weights
are never used. Phases:

- schedule: ``Scheduler.schedule``
- prepare: ``ModelRunner.step_inputs`` + ``build_metadata`` + the attention backend's metadata
- sample: ``Sampler.sample`` (greedy over the batch's logits), less its argmax
- argmax: the greedy argmax over the logits ([batch, 49152] fp32). On a GPU it is a device kernel the
  host only queues; on this CPU it is the step's one piece of compute (memory-bound, 2-7 ms at 256),
  so it is reported beside the host time, not in it
- detokenize: ``IncrementalDetokenizer.add_token`` (every request's new token)
- output: the output processor around it (stop checks, emitting to each request's sink)
- other: the rest of ``Engine.step`` (the loop's own bookkeeping and the fake forward's slicing)

``--device-picks`` models the GPU more closely: the argmax's results are computed once at set-up
and handed back as a device would (the host reads back ``batch`` token ids), so no 50 MB pass over
the logits evicts the host's caches between steps. The argmax column is then the measured cost of
the real argmax on the same logits, timed apart from the steps. Without it (the default), the host
time is what the engine costs on this CPU, where the argmax runs in the step and the Python after it
runs with cold caches.

The phase timers wrap two calls per request per step (the output processor and the detokenizer),
about 1 us each on the 2-core machine; ``--no-phases`` times the argmax alone, for the host time
without them.

The server's HTTP streaming (SSE formatting and the socket) runs on the event loop thread, not in
the engine step, and is not counted here.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from llmkit.core.engine import sampler as sampler_module
from llmkit.core.engine.builder import build_engine_parts
from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.detokenizer import IncrementalDetokenizer
from llmkit.core.engine.loop import Engine
from llmkit.core.engine.messages import GenerateRequest, SamplingParams

PHASES = ("schedule", "prepare", "sample", "detokenize", "output", "other")
COLUMNS = (*PHASES, "host", "argmax", "total")


class Timers:
    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)

    def wrap(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[phase] += time.perf_counter() - t

        setattr(obj, name, timed)


def measure(batch: int, steps: int, warmup: int = 20, phases: bool = True, picks: bool = False) -> dict[str, float]:
    cfg = EngineConfig(
        load_format="dummy", grammar_backend="none", max_running_requests=max(batch, 1),
        max_total_tokens=batch * (steps + warmup + 64) + 4096, num_threads=None,
    )  # fmt: skip
    parts = build_engine_parts(cfg)
    engine = Engine(cfg, parts)
    runner = engine.runner
    vocab = parts.vocab_size
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(batch, vocab, generator=gen) for _ in range(8)]
    calls = [0]

    def fake_execute(inp, picks=None):  # the inputs are built as for a real forward; the forward does nothing
        runner.build_metadata(inp, picks)
        calls[0] += 1
        return logits[calls[0] % 8][: len(inp.sample_rows)], []

    t = Timers()
    runner.execute = fake_execute
    if phases:
        t.wrap(engine.scheduler, "schedule", "schedule")
        t.wrap(runner, "step_inputs", "prepare")
        t.wrap(runner, "build_metadata", "prepare")
        t.wrap(runner.attn, "prepare_metadata", "prepare")
        t.wrap(engine.sampler, "sample", "sample")
        t.wrap(engine.output, "process", "output")
    detok_add = IncrementalDetokenizer.add_token
    detok_time = [0.0]

    def add_token(self, tok):
        s = time.perf_counter()
        try:
            return detok_add(self, tok)
        finally:
            detok_time[0] += time.perf_counter() - s

    if phases:
        IncrementalDetokenizer.add_token = add_token
    argmax = sampler_module.argmax

    def timed_argmax(x):
        s = time.perf_counter()
        try:
            return argmax(x)
        finally:
            t.step["argmax"] += time.perf_counter() - s

    if picks:  # the device's argmax: its results, looked up by the logits' storage
        chosen = {lg.data_ptr(): argmax(lg) for lg in logits}
        cost = []
        for lg in logits * 4:
            s = time.perf_counter()
            argmax(lg)
            cost.append(time.perf_counter() - s)
        argmax_cost = statistics.median(cost)

        def timed_argmax(x):  # noqa: F811 - replaces the timed argmax above
            return chosen[x.data_ptr()][: len(x)]

    sampler_module.argmax = timed_argmax
    n = steps + warmup + 8
    received = [0]
    for i in range(batch):
        params = SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.0)  # (min_new_tokens masks per row)
        engine.add(GenerateRequest(f"r{i}", [5 + i % 50, 6, 7, 8], params), lambda o: received.__setitem__(0, 1))
    rows = []
    try:
        for k in range(warmup + steps):
            t.step.clear()
            detok_time[0] = 0.0
            s = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - s
            if k >= warmup:
                row = dict(t.step)
                row["detokenize"] = detok_time[0]
                row["output"] = row.get("output", 0.0) - detok_time[0]
                row["sample"] = row.get("sample", 0.0) - row.get("argmax", 0.0)
                row["other"] = wall - sum(row.get(p, 0.0) for p in (*PHASES[:-1], "argmax"))
                row["host"] = wall - row.get("argmax", 0.0)
                if picks:
                    row["argmax"] = argmax_cost
                row["total"] = row["host"] + row.get("argmax", 0.0)
                rows.append(row)
    finally:
        IncrementalDetokenizer.add_token = detok_add
        sampler_module.argmax = argmax
    cols = COLUMNS if phases else ("host", "argmax", "total")
    return {p: statistics.median(r.get(p, 0.0) for r in rows) * 1e3 for p in cols}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--no-phases", action="store_true", help="time the argmax alone (no per-request timers)")
    ap.add_argument(
        "--device-picks", action="store_true", help="the argmax's results precomputed, as a GPU hands them back"
    )
    args = ap.parse_args()
    results = {b: measure(b, args.steps, phases=not args.no_phases, picks=args.device_picks) for b in args.batch}
    cols = COLUMNS if not args.no_phases else ("host", "argmax", "total")
    mode = "picks from the device" if args.device_picks else "argmax on this CPU in the step"
    print(f"host ms per decode step (median of {args.steps}; {mode}), torch threads {torch.get_num_threads()}")
    if args.markdown:
        print("| batch | " + " | ".join(cols) + " |")
        print("|---:|" + "---:|" * len(cols))
        for b, r in results.items():
            print(f"| {b} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    else:
        for b, r in results.items():
            print(f"batch {b:4d}: " + "  ".join(f"{c} {r[c]:.3f}" for c in cols))


if __name__ == "__main__":
    main()
