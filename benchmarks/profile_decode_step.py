"""Where one decode step's time goes, on the embedded model, in-process (no HTTP).

    python benchmarks/profile_decode_step.py [--quant none,gguf] [--batch 1,16] [--steps 200] [--rounds 3]
    python benchmarks/profile_decode_step.py --threads 1 --cpu-time  # A/B on a busy machine
    python benchmarks/profile_decode_step.py --torch-profile     # + torch.profiler's top ops
    python benchmarks/profile_decode_step.py --layer --threads 1 --cpu-time  # one layer vs its GEMMs
    python benchmarks/profile_decode_step.py --python-layers  # the Python layers, not the C stack

Builds the engine (no engine thread), prefills ``--batch`` requests, then drives
``Engine.step()`` by hand. Each round runs ``--steps`` decode steps twice: bare (the step wall
that counts) and with timers wrapped around the pieces (schedule, runner inputs/metadata, model
forward, every Linear call, attention, LM head, sampling, output processing). The GEMM floor is the
same step's Linear inputs (captured once) fed to the bare kernels in a loop, so "outside GEMMs" =
bare step wall - GEMM floor. Median over rounds; per-step milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict

import torch

from llmkit.core.engine.builder import build_engine_parts
from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.loop import Engine
from llmkit.core.engine.messages import GenerateRequest, SamplingParams
from llmkit.core.model.linear import Linear, _gemm
from llmkit.core.model.quant.int4_format import Int4Format
from llmkit.core.model.quant.int8 import Int8Format

ACC: dict[str, float] = defaultdict(float)
PYTHON_LAYERS = [False]  # --python-layers
# --cpu-time: this thread's CPU time instead of wall time. With --threads 1 all the work runs on
# this thread, and CPU time barely moves when other processes share the cores (wall time does).
CLOCK = [time.perf_counter]


def timed(name, fn):
    def wrapper(*a, **kw):
        t = CLOCK[0]()
        try:
            return fn(*a, **kw)
        finally:
            ACC[name] += CLOCK[0]() - t

    return wrapper


def instrument(engine: Engine):
    """Wrap the step's pieces (instance attributes shadow the methods); returns an undo."""
    r = engine.runner
    targets = [
        (engine, "step", "step"),
        (engine.scheduler, "schedule", "schedule"),
        (r, "step_inputs", "step_inputs"),
        (r, "build_metadata", "build_metadata"),
        (r.attn, "prepare_metadata", "attn.prepare_metadata"),
        (r.model, "forward", "model forward"),
        (r.attn, "forward", "  attention (backend)"),
        (r.attn, "forward_qkv", "  attention (backend)"),
        (r.model, "compute_logits", "LM head (compute_logits)"),
        (engine.sampler, "sample", "sample"),
        (engine.output, "process", "output (detok+emit)"),
    ]
    plan = getattr(r.model, "_native_plan", None)
    if plan:  # the blocks run as one C call (cpu_decoder.py): time that and its attention setup
        targets += [(plan, "run", "  C decoder stack (all blocks)"), (r.attn, "native_attend", "  attn.native_attend")]
    for obj, attr, name in targets:
        setattr(obj, attr, timed(name, getattr(obj, attr)))
    layers = [m for m in r.model.modules() if isinstance(m, Linear)]
    for m in layers:
        m.forward = timed("  Linear calls", m.forward)

    def undo():
        for obj, attr, _ in targets:
            delattr(obj, attr)
        for m in layers:
            del m.forward

    return undo


def gemm_floor(engine: Engine, reps: int) -> float:
    """ms per step of the bare GEMM kernels on the inputs this step's Linear layers see (the
    LM head included): what no amount of Python trimming can remove."""
    calls = []
    model, head = engine.runner.model, engine.runner.model.lm_head
    lm = head.fmt_layer or head._table().qtable  # a quantized LM head is a Linear (maybe not a child module)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    linears += [lm] if lm is not None and lm not in linears else []
    for m in linears:  # (Linear is a HotModule: no forward hooks; record through forward)
        m.forward = lambda x, *a, m=m, fwd=m.forward: (calls.append((m, x)), fwd(x, *a))[1]
    with python_layers(model):  # (the C decoder stack calls no Linear.forward)
        engine.step()
    for m in linears:
        del m.forward
    if lm is None:  # a dense LM head multiplies the embedding table directly
        w = head._table().weight
        calls.append((w, torch.randn(calls[0][1].shape[0], w.shape[1])))
    jobs = []
    for m, x in calls:
        if isinstance(m, Linear) and isinstance(m.format, Int4Format):
            jobs.append(lambda m=m, x=x: m.format._kernel(m, x))  # the C kernel where it builds
        elif isinstance(m, Linear) and isinstance(m.format, Int8Format):
            jobs.append(lambda m=m, x=x: Int8Format._kernel(m, x))  # the C kernel where it builds
        else:
            w = m if isinstance(m, torch.Tensor) else m.weight
            jobs.append(lambda x=x.to(w.dtype), w=w: _gemm(x, w, None))
    with torch.inference_mode():
        for j in jobs:
            j()
        ts = []
        for _ in range(reps):
            t = CLOCK[0]()
            for j in jobs:
                j()
            ts.append(CLOCK[0]() - t)
    return statistics.median(ts) * 1e3


@contextlib.contextmanager
def python_layers(model, on: bool = True):
    """Run the model's Python layers instead of its C decoder stack (cpu_decoder.py) inside."""
    was = getattr(model, "native_stack", None)
    if on and was is not None:
        model.native_stack, model._native_plan = False, False
    try:
        yield
    finally:
        if on and was is not None:
            model.native_stack, model._native_plan = was, False


def make_engine(quant: str, batch: int) -> Engine:
    cfg = EngineConfig(quantization=quant, grammar_backend="none", max_running_requests=max(batch, 16))
    engine = Engine(cfg, build_engine_parts(cfg))
    engine.batch, engine.phase = batch, 0
    return engine


def fresh(engine: Engine) -> None:
    """Replace the running requests with ``engine.batch`` new ones (prefilled, warmed up), so
    every measured phase decodes at the same context lengths (a ~12-token prompt onwards)."""
    for r in list(engine.scheduler.running):
        engine.abort(r.rid)
    engine.phase += 1
    n = 1_000_000  # never finishes inside a phase
    for i in range(engine.batch):
        ids = engine.tokenizer.encode(f"Write a short essay about topic number {i}.")
        params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
        engine.submit(GenerateRequest(f"p{engine.phase}r{i}", ids, params), lambda o: None)
    engine.drain()
    while engine.scheduler.waiting or any(len(r.output_ids) == 0 for r in engine.scheduler.running):
        engine.step()  # prefill
    for _ in range(3):
        engine.step()  # warm-up


def run_steps(engine: Engine, steps: int) -> float:
    fresh(engine)
    ACC.clear()  # the timers count only the measured steps
    t = CLOCK[0]()
    for _ in range(steps):
        engine.step()
    return (CLOCK[0]() - t) / steps * 1e3


def one_layer(engine: Engine, reps: int = 300) -> None:
    """Layer 0's decode forward in a loop (its weights stay in cache, so memory noise drops out)
    against its four GEMM kernels alone on the same inputs: the per-layer cost outside the GEMMs."""
    fresh(engine)
    model, cap = engine.runner.model, {}
    model.native_stack = False  # layer 0 as the Python path runs it
    layer = model.layers[0]
    layer.forward = lambda *a, fwd=layer.forward: (cap.setdefault("args", a), fwd(*a))[1]
    lins = [m for m in layer.modules() if isinstance(m, Linear)]
    for m in lins:
        m.forward = lambda x, *a, m=m, fwd=m.forward: (cap.setdefault(m, x), fwd(x, *a))[1]
    engine.step()
    for m in [layer, *lins]:
        del m.forward
    fresh(engine)  # (the loop below rewrites the captured step's KV slots: leave that request behind)
    jobs = {"layer": lambda: layer(*cap["args"]), "GEMMs": lambda: [m(cap[m]) for m in lins]}
    if all(isinstance(m.format, Int4Format) for m in lins):
        jobs["GEMMs"] = lambda: [m.format._kernel(m, cap[m]) for m in lins]
    else:
        jobs["GEMMs"] = lambda: [_gemm(cap[m], m.weight, None) for m in lins]
    best = defaultdict(lambda: float("inf"))
    with torch.inference_mode():
        for _ in range(5):
            for name, fn in jobs.items():
                t = CLOCK[0]()
                for _ in range(reps):
                    fn()
                best[name] = min(best[name], (CLOCK[0]() - t) / reps * 1e6)
    out = best["layer"] - best["GEMMs"]
    print(
        f"layer 0: {best['layer']:.1f} us, its GEMMs {best['GEMMs']:.1f} us, outside them {out:.1f} us (x30 = {out * 0.03:.2f} ms)"
    )


def profile(quant: str, batch: int, steps: int, rounds: int, torch_profile: bool, layer: bool = False) -> None:
    engine = make_engine(quant, batch)
    if PYTHON_LAYERS[0]:
        engine.runner.model.native_stack = False
    if layer:
        print(f"\n## quantization={quant} batch={batch}, best of 5 x 300 calls")
        return one_layer(engine)
    bare, parts, floors = [], defaultdict(list), []
    for _ in range(rounds):
        bare.append(run_steps(engine, steps))
        undo = instrument(engine)
        run_steps(engine, steps)
        undo()
        for k, v in ACC.items():
            parts[k].append(v / steps * 1e3)
        fresh(engine)
        floors.append(gemm_floor(engine, steps))
    med = {k: statistics.median(v) for k, v in parts.items()}
    wall, floor = statistics.median(bare), statistics.median(floors)
    print(f"\n## quantization={quant} batch={batch}: {steps} steps x {rounds} rounds, ms/step (median)")
    print(f"{'bare step wall':34s} {wall:8.2f}   runs {' '.join(f'{x:.2f}' for x in bare)} (min {min(bare):.2f})")
    print(f"{'GEMM kernels alone (floor)':34s} {floor:8.2f}")
    print(f"{'=> outside the GEMMs':34s} {wall - floor:8.2f}")
    print("instrumented step (timers add a little):")
    for k in ("schedule", "step_inputs", "build_metadata", "attn.prepare_metadata", "model forward"):
        print(f"  {k:32s} {med.get(k, 0):8.3f}")
    for k in ("  Linear calls", "  attention (backend)", "  attn.native_attend", "  C decoder stack (all blocks)"):
        print(f"  {k:32s} {med.get(k, 0):8.3f}")
    fwd_rest = med.get("model forward", 0) - sum(
        med.get(k, 0)
        for k in ("  Linear calls", "  attention (backend)", "  attn.native_attend", "  C decoder stack (all blocks)")
    )
    print(f"  {'  rest of forward (norms, rope..)':32s} {fwd_rest:8.3f}")
    for k in ("LM head (compute_logits)", "sample", "output (detok+emit)"):
        print(f"  {k:32s} {med.get(k, 0):8.3f}")
    top = ("schedule", "step_inputs", "build_metadata", "attn.prepare_metadata", "model forward")
    rest = med.get("step", 0) - sum(
        med.get(k, 0) for k in top + ("LM head (compute_logits)", "sample", "output (detok+emit)")
    )
    print(f"  {'engine loop rest (+ timers)':32s} {rest:8.3f}")
    print(f"  {'instrumented step total':32s} {med.get('step', 0):8.3f}")
    if torch_profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprof

        with tprof(activities=[ProfilerActivity.CPU]) as prof:
            run_steps(engine, 20)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="none,gguf", help="comma list of --quantization values")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--python-layers", action="store_true", help="the Python layers, not the C decoder stack")
    ap.add_argument("--layer", action="store_true", help="only layer 0's forward against its GEMMs (best of 5)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--cpu-time", action="store_true", help="time with this thread's CPU time (use with --threads 1)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        CLOCK[0] = time.thread_time
    PYTHON_LAYERS[0] = args.python_layers
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {'CPU' if args.cpu_time else 'wall'} time")
    for quant in args.quant.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            profile(quant, batch, args.steps, args.rounds, args.torch_profile, args.layer)


if __name__ == "__main__":
    main()
