"""The decode GEMVs (``LLMKIT_TRITON_GEMV=1``) against what a step runs without them, per projection.

For each projection of the Qwen2.5-0.5B and Llama-3.1-8B shapes, at 1 and 4 rows, in bf16: the
cuBLAS form (the fused norm or SiLU-and-mul kernel, then cuBLAS through ``F.linear``; for QKV then
the rotate-and-store kernel too) against ``triton_gemv.gemv`` (for QKV with its rotate-and-store
epilogue) at the dispatch's configuration and at four others. Each form is captured in a
CUDA graph of 20 calls (as a decode step runs: no launch gaps on the host) and replayed; microseconds a
call and the weight's bytes a second. Every GEMV result is checked against today's form first.

    python benchmarks/gpu_check/gemv_probe.py [--iters 20] [--replays 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# preset: hidden, intermediate, (query heads, KV heads, head size, QKV bias)
SHAPES = {"qwen2.5-0.5b": (896, 4864, (14, 2, 64, True)), "llama-3.1-8b": (4096, 14336, (32, 8, 128, False))}
# (BLOCK_N, BLOCK_K at one row, num_warps); BLOCK_K shrinks with the rows as gemv_config's does
VARIANTS = ((8, 512, 4), (16, 256, 4), (32, 256, 8), (64, 128, 8))


def timed(fn, iters: int, replays: int) -> float:
    """Microseconds a call of ``fn``, from a CUDA graph of ``iters`` calls replayed ``replays`` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * replays)


def cases(hidden: int, inter: int, heads: tuple):
    """(name, input width, N, K, kind): kind "norm" has a residual, "silu" a gate/up input, "rope"
    is "norm" with the rotate-and-store after it."""
    qkv = (heads[0] + 2 * heads[1]) * heads[2]
    return (
        ("qkv", hidden, qkv, hidden, "rope"),
        ("o", hidden, hidden, hidden, "plain"),
        ("gate_up", hidden, 2 * inter, hidden, "norm"),
        ("down", 2 * inter, hidden, inter, "silu"),
    )


def main() -> None:
    from llmkit.core.model import triton_gemv, triton_pointwise
    from llmkit.core.model.layers import RotaryEmbedding
    from llmkit.plugins.attention.triton_rope_store import rope_store_kv

    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; us a call (weight GB/s); default = gemv_config's choice")
    print("| shape | proj | rows | norm/silu + cuBLAS (+ rotate-and-store) | GEMV default | best GEMV variant |")
    print("|---|---|---:|---:|---:|---|")
    for preset, (hidden, inter, heads) in SHAPES.items():
        num_heads, kv_heads, d, has_bias = heads
        for name, width, n, k, kind in cases(hidden, inter, heads):
            w = torch.randn(n, k, device=dev, dtype=dt, generator=gen) / k**0.5
            nw = 1 + 0.1 * torch.randn(k, device=dev, dtype=dt, generator=gen)
            gbytes = w.numel() * w.element_size() / 1e9
            for rows in (1, 4):
                x = torch.randn(rows, width, device=dev, dtype=dt, generator=gen)
                r = torch.randn(rows, width, device=dev, dtype=dt, generator=gen)
                bias = torch.randn(n, device=dev, dtype=dt, generator=gen) if has_bias else None
                cos2, sin2 = (
                    RotaryEmbedding(d, 4096, {"rope_theta": 1e6})
                    .to(dev)
                    .table(torch.arange(rows, device=dev) * 1000, dt)
                )
                k_buf, v_buf = (torch.zeros(64, kv_heads, d, device=dev, dtype=dt) for _ in range(2))
                store = triton_gemv.RopeStore(cos2, sin2, num_heads, k_buf, v_buf, torch.arange(rows, device=dev), bias)

                def today():
                    if kind == "rope":
                        h, _ = triton_pointwise.rms_norm(x, nw, 1e-6, r)
                        return rope_store_kv(F.linear(h, w), cos2, sin2, num_heads, k_buf, v_buf, store.slots, bias)
                    if kind == "norm":
                        h, _ = triton_pointwise.rms_norm(x, nw, 1e-6, r)
                    elif kind == "silu":
                        h = triton_pointwise.silu_mul(x, k)
                    else:
                        h = x
                    return F.linear(h, w)

                def fused(config=None):
                    if kind == "rope":
                        return triton_gemv.gemv(x, w, norm=(nw, 1e-6), residual=r, rope=store, config=config)[0]
                    if kind == "norm":
                        return triton_gemv.gemv(x, w, norm=(nw, 1e-6), residual=r, config=config)[0]
                    return triton_gemv.gemv(x, w, silu_mul=kind == "silu", config=config)

                want = today()
                scale = want.abs().max().item()
                results = {}
                for variant in (None, *VARIANTS):
                    config = None
                    if variant is not None:
                        bn, bk, warps = variant
                        bm = triton_gemv.gemv_config(rows, n)[0]
                        config = (bm, bn, max(16, bk // bm), warps)
                    try:
                        err = (fused(config).float() - want.float()).abs().max().item() / scale
                        if err > 3e-2:
                            results[config] = f"wrong ({err:.2g})"
                            continue
                        results[config] = timed(lambda c=config: fused(c), args.iters, args.replays)
                    except Exception as exc:  # a configuration that does not compile or launch
                        results[config] = f"{type(exc).__name__}"
                base = timed(today, args.iters, args.replays)
                default = results.pop(None)
                ok = {c: t for c, t in results.items() if isinstance(t, float)}
                best = min(ok, key=ok.get) if ok else None

                def cell(t):
                    return f"{t:.1f} ({gbytes / (t * 1e-6):,.0f})" if isinstance(t, float) else str(t)

                best_cell = f"{cell(ok[best])} at {best}" if best else "-"
                print(f"| {preset} | {name} | {rows} | {cell(base)} | {cell(default)} | {best_cell} |", flush=True)
                bad = {c: t for c, t in results.items() if not isinstance(t, float)}
                if bad:
                    print(f"  not run: {bad}", flush=True)


if __name__ == "__main__":
    main()
