"""Which construct makes MLA extend with page size 1 wrong when compiled (issue 34 item 2)?

Each variant runs in its own process (a CUDA fault ends only its own): tests/attention/test_triton_attention.py's
``extend_ps1_latent`` case, with the extend kernel launched under other tile sizes, pipeline
stages or value-block widths. Prints the Triton kernel's max abs error against the torch backend run
on the CPU over the same batch, and the query rows that are off.

    python benchmarks/gpu_check/mla_probe.py            # every variant, one process each
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.attention.test_triton_attention
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "helpers"))

# name: (case overrides, launch overrides)
VARIANTS = {
    "orig": ({}, {}),
    "tiles_16x16": ({}, dict(block_m=16, block_n=16)),
    "tiles_32x32": ({}, dict(block_m=32, block_n=32)),
    "tiles_64x16": ({}, dict(block_m=64, block_n=16)),
    "stages_1": ({}, dict(stages=1)),
    "dv_block_64": ({}, dict(min_block_dv=64)),
    "head_dim_64": (dict(head_dim=64), {}),
    "not_latent": (dict(latent=None), {}),
    "page_16": (dict(page_size=16), {}),
    "fp32": ({}, dict(dtype="float32")),
}


def patched_launcher(over: dict):
    import triton

    from llmkit.plugins.attention import triton_extend as te

    def extend_attention(q, o, k_buf, v_buf, req_to_token, req_pool_indices, q_start_loc, q_lens, kv_lens,
                         max_q_len, scale, sliding_window=None, sinks=None):  # fmt: skip
        num_heads, head_dim = q.shape[1], q.shape[2]
        group = num_heads // k_buf.shape[1]
        dv = o.shape[-1]
        v_buf = k_buf if v_buf is None else v_buf
        block_d = triton.next_power_of_2(head_dim)
        bm, bn, warps = te.extend_config(block_d, q.dtype, False)
        bm, bn = over.get("block_m", bm), over.get("block_n", bn)
        upcast, prec = te.dot_options(q.dtype)
        grid = (q_lens.shape[0], num_heads, triton.cdiv(max_q_len, bm))
        te._extend_kernel[grid](
            q, o, k_buf, v_buf, req_to_token, req_pool_indices, q_start_loc, q_lens, kv_lens, q,
            int(sliding_window or 0), scale * te.LOG2E, q.stride(0), q.stride(1), o.stride(0), o.stride(1),
            k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
            GROUP=group, HEAD_DIM=head_dim, HEAD_DV=dv, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d,
            BLOCK_DV=max(triton.next_power_of_2(dv), over.get("min_block_dv", 0)), UPCAST=upcast,
            DOT_PREC=prec, HAS_SINKS=False, num_warps=warps, num_stages=over.get("stages", 2),
        )  # fmt: skip

    te.extend_attention = extend_attention


def run(name: str) -> dict:
    from llmkit.plugins.attention.torch_backend import TorchAttentionBackend

    from attention_utils import backend_kwargs
    from tests.attention.test_triton_attention import CASES, _backends, _build

    case, over = VARIANTS[name]
    patched_launcher(over)
    spec = {**CASES["extend_ps1_latent"], **case}
    if spec.get("latent") is None:
        spec.pop("latent", None)
    dtype = getattr(torch, over.get("dtype", "float16"))
    b = _build(spec, "cuda" if torch.cuda.is_available() else "cpu", dtype)  # cpu: an interpreter dry run
    tri, _ = _backends(b, spec["heads"][0], v_head_dim=spec.get("latent"))
    got = tri.forward(b.q, b.k, b.v, 0, tri.prepare_metadata(b.md)).float().cpu()
    b = _build(spec, "cpu", dtype)
    ref = TorchAttentionBackend(**backend_kwargs(b, spec["heads"][0], spec.get("latent")))
    want = ref.forward(b.q, b.k, b.v, 0, ref.prepare_metadata(b.md)).float()
    worst = (got - want).abs().amax(dim=(1, 2))
    return {"err": worst.max().item(), "bad_rows": torch.nonzero(worst > 5e-2).flatten().tolist()}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print("RESULT " + json.dumps(run(sys.argv[1])), flush=True)
        sys.exit(0)
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    for name in VARIANTS:
        p = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, env=env, timeout=120)
        line = next((s for s in p.stdout.splitlines() if s.startswith("RESULT ")), None)
        tail = (p.stderr.strip().splitlines() or ["?"])[-1][:160]
        print(f"{name:14s} {line[7:] if line else 'FAILED: ' + tail}", flush=True)
