"""benchmarks/bench_fused_moe.py runs end to end (on CPU: the tiny preset, kernel interpreted) and
reports agreement between the fused-MoE kernel and the torch path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_fused_moe_tiny_on_cpu():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_fused_moe.py"), "--preset", "tiny", "--device", "cpu"]
    cmd += ["--dtype", "float32", "--tokens", "1,9", "--iters", "1", "--markdown"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1 ") or line.startswith("| 9 ")]
    assert len(rows) == 2, proc.stdout
    assert all(float(r.strip("| ").split(" | ")[-1]) < 1e-4 for r in rows), proc.stdout
