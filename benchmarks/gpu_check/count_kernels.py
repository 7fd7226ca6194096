"""CUDA kernels a decode step launches, eager (no graphs), on a preset's shape with dummy weights:
the fused kernels on, then off (LLMKIT_DISABLE_FUSED_KERNELS=1), each in its own process.

    python benchmarks/gpu_check/count_kernels.py [--preset qwen2.5-0.5b] [--steps 16]
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
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(count(args.preset, args.steps)))
        return
    out = {}
    for label, env in (("fused", {}), ("unfused", {"LLMKIT_DISABLE_FUSED_KERNELS": "1"})):
        cmd = [sys.executable, __file__, "--child", "--preset", args.preset, "--steps", str(args.steps)]
        p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
        line = next((s for s in p.stdout.splitlines() if s.startswith("RESULT ")), None)
        out[label] = json.loads(line[7:]) if line else {"error": p.stderr[-2000:]}
        print(label, json.dumps(out[label], indent=1), flush=True)
    print(json.dumps({k: v.get("kernels_per_step") for k, v in out.items()}))


if __name__ == "__main__":
    main()
