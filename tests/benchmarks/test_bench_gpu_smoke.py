"""benchmarks/bench_gpu.py runs end to end on CPU (tiny preset) and reports throughputs.
Not a timing test: the numbers only have to exist and be positive."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_gpu_tiny_cpu_smoke(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "benchmarks/bench_gpu.py",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--attention",
        "torch",
        "--num-requests",
        "3",
        "--output-len",
        "8",
        "--prompt-len",
        "16",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "command: " in proc.stdout and "bench_gpu.py --preset tiny" in proc.stdout
    report = json.loads(out.read_text())
    assert report["env"]["torch"] and report["env"]["device"]
    by_engine = {r["engine"]: r for r in report["results"]}
    assert set(by_engine) == {"llmkit", "transformers"}
    for r in by_engine.values():
        assert r["single"]["decode_tok_s"] > 0
        assert r["concurrent"]["output_tok_s"] > 0 and r["concurrent"]["decode_tok_s"] > 0
        assert r["concurrent"]["output_tokens"] == 3 * 8
    assert by_engine["llmkit"]["attention"] == "torch"
    assert report["ratios"] and report["ratios"][0]["single_decode_tok_s"] > 0
