"""The kernels a decode step of the CUDA path launches, counted on the CPU: the forward runs the forms
it runs on CUDA (the fused Triton kernels interpreted, the Triton attention backend, torch ops
elsewhere) and ``benchmarks/gpu_check/kernel_launches.py`` counts each launch. A layer that gains a
kernel (a fused op falling back to its torch form, a new pointwise op) fails here, without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A Qwen2 decoder layer (QKV bias), one decode step: every kernel it launches, in order.
LAYER = [
    "triton:_rms_norm_kernel",  # the residual add and the input norm
    "gemm",  # Q, K, V
    "triton:_rope_store_kernel",  # the bias, the rotation, the K/V write
    "triton:_decode_split_kernel",
    "gemm",  # O
    "triton:_rms_norm_kernel",  # the residual add and the post-attention norm
    "gemm",  # gate and up
    "triton:_silu_mul_kernel",
    "gemm",  # down
]


# With LLMKIT_TRITON_GEMV=1: the norms and SiLU-and-mul folded into the GEMVs in front of them, the
# rotate-and-store into the QKV GEMV behind it.
GEMV_LAYER = [
    "triton:_gemv_kernel",  # the residual add, the input norm, Q, K, V, the bias, the rotation, the K/V write
    "triton:_decode_split_kernel",
    "triton:_gemv_kernel",  # O
    "triton:_gemv_kernel",  # the residual add, the post-attention norm, gate and up
    "triton:_gemv_kernel",  # SiLU-and-mul, down
]


@pytest.mark.parametrize("gemv", ["0", "1"], ids=["fused", "decode_gemvs"])
def test_a_decode_layer_launches_its_kernels(gemv: str):
    env = {k: v for k, v in os.environ.items() if k != "LLMKIT_DISABLE_FUSED_KERNELS"}
    env["LLMKIT_TRITON_GEMV"] = gemv
    layer = GEMV_LAYER if gemv == "1" else LAYER
    cmd = [sys.executable, "benchmarks/gpu_check/count_kernels.py", "--cpu", "--child", "--steps", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))
    got = json.loads(line[len("RESULT ") :])
    assert got["layer_ops"] == layer
    # the embedding, the rotary table's cos and sin rows, the final norm, the LM head
    assert got["outside_ops"] == ["embedding", "index", "index", "triton:_rms_norm_kernel", "gemm"]
    assert got["kernels_per_step"] == got["layers"] * len(layer) + 5
    assert got["syncs"] == 0  # nothing in the forward waits for the device
