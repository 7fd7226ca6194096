"""CUDA kernels a decode step launches, eager (no graphs), on a preset's shape with dummy weights:
the fused kernels on, with the decode GEMVs too (LLMKIT_TRITON_GEMV=1), then off
(LLMKIT_DISABLE_FUSED_KERNELS=1), each in its own process.

    python benchmarks/gpu_check/count_kernels.py [--preset qwen2.5-0.5b] [--steps 16]
    python benchmarks/gpu_check/count_kernels.py --cpu [--preset tiny]

``--cpu`` counts the same launches on any machine: the CUDA path's forward runs on the CPU with
the Triton kernels in Triton's interpreter (``kernel_launches.py``), and each aten op that would
launch a kernel on a GPU (not a view or an allocation) and each Triton launch is counted, per
decoder layer and outside the layers. What it cannot see is a library's kernels inside one op
(cuBLAS's split-K reduce after a GEMM).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent


def count(preset: str, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(HERE.parent))
    from gpu_presets import write_model_dir

    from llmkit.core.engine.builder import build_engine_parts
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.engine.loop import Engine
    from llmkit.core.engine.messages import GenerateRequest, SamplingParams

    d = Path(tempfile.mkdtemp())
    write_model_dir(preset, d)
    cfg = EngineConfig(
        model_path=str(d), load_format="dummy", disable_cuda_graph=True, grammar_backend="none",
        max_total_tokens=4096, max_running_requests=4, overlap_schedule=False,
    )  # fmt: skip
    engine = Engine(cfg, build_engine_parts(cfg))
    engine.start()
    got, marks, started, done = [], [], threading.Event(), threading.Event()
    prof = profile(activities=[ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU])

    def sink(o):
        got.extend(o.token_ids)
        if len(got) >= 4 and not started.is_set():  # prefill and the first decodes are behind us
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.start()
            started.set()
            marks.append(len(got))
        elif len(got) >= marks[0] + steps and not done.is_set():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.stop()
            done.set()

    n = 4 + steps + 2
    engine.submit(
        GenerateRequest("k", [5] * 32, SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=0)), sink
    )
    assert done.wait(300)
    engine.shutdown()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    names = Counter(e.name[:60] for e in kernels)
    return {"kernels_per_step": len(kernels) / steps, "top": names.most_common(12)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default=None, help="default: qwen2.5-0.5b, with --cpu tiny")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--cpu", action="store_true", help="count on the CPU, the kernels interpreted")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    preset = args.preset or ("tiny" if args.cpu else "qwen2.5-0.5b")
    if args.child:
        if args.cpu:
            from kernel_launches import count_on_cpu

            print("RESULT " + json.dumps(count_on_cpu(preset, min(args.steps, 4))))
        else:
            print("RESULT " + json.dumps(count(preset, args.steps)))
        return
    out = {}
    variants = (
        ("fused", {"LLMKIT_TRITON_GEMV": "0"}),
        ("fused, decode GEMVs", {"LLMKIT_TRITON_GEMV": "1"}),
        ("unfused", {"LLMKIT_DISABLE_FUSED_KERNELS": "1", "LLMKIT_TRITON_GEMV": "0"}),
    )
    for label, env in variants:
        cmd = [sys.executable, __file__, "--child", "--preset", preset, "--steps", str(args.steps)]
        cmd += ["--cpu"] if args.cpu else []
        env = {**os.environ, **env}
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        line = next((s for s in p.stdout.splitlines() if s.startswith("RESULT ")), None)
        out[label] = json.loads(line[7:]) if line else {"error": p.stderr[-2000:]}
        print(label, json.dumps(out[label], indent=1), flush=True)
    print(json.dumps({k: v.get("kernels_per_step") for k, v in out.items()}))


if __name__ == "__main__":
    main()
