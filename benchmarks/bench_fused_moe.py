"""One MoE layer's experts: the fused-MoE Triton kernel against FusedExperts' torch path (a GEMM per
active expert), on the same random weights and routing, at decode and prefill token counts.

    python benchmarks/bench_fused_moe.py [--preset qwen3-30b-a3b|gpt-oss-20b] [--dtype bfloat16]
        [--tokens 1,16,64,256,2048] [--iters 20] [--markdown]

Needs a CUDA device, except with ``--preset tiny --device cpu``, which runs the kernel in Triton's
interpreter (the script sets ``TRITON_INTERPRET=1`` before triton is imported; a smoke test of the
script, not a measurement). Each row prints the largest difference between the two paths next to
the timings, so a wrong kernel cannot post a number unnoticed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# (hidden, expert intermediate, experts, top-k, biases + clamped SwiGLU)
PRESETS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, False),
    "gpt-oss-20b": (2880, 2880, 32, 4, True),
    "tiny": (32, 24, 8, 2, True),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", default="1,16,64,256,2048")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch

    from llmkit.core.model.moe import FusedExperts, silu_and_mul, softmax_topk

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --preset tiny --device cpu for an interpreted smoke run)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    hidden, inter, experts, top_k, gpt_oss = PRESETS[args.preset]
    if gpt_oss:
        from llmkit.plugins.models.gpt_oss import ClampedSwiGLU

        act = ClampedSwiGLU(alpha=1.702, limit=7.0)
    else:
        act = silu_and_mul
    torch.manual_seed(0)
    layer = FusedExperts(experts, hidden, inter, bias=gpt_oss, activation=act)  # empty: nothing allocated

    def rand(p: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.randn(p.shape, device=dev, dtype=dtype) * scale

    layer.w13.data, layer.w2.data = rand(layer.w13, hidden**-0.5), rand(layer.w2, inter**-0.5)
    if gpt_oss:
        layer.b13.data, layer.b2.data = rand(layer.b13, 0.1), rand(layer.b2, 0.1)

    def timed(n_tokens: int, use_triton: bool, x, w, ids) -> tuple[float, torch.Tensor]:
        layer.use_triton = use_triton
        out = layer(x, w, ids)  # warm-up (compiles the kernel)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            layer(x, w, ids)
        sync()
        return (time.perf_counter() - t0) / args.iters * 1e3, out

    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    print(f"# {args.preset} experts, {args.dtype}, {gpu}, torch {torch.__version__}")
    header = "| tokens | torch ms | triton ms | speed-up | max abs diff |"
    print(header if args.markdown else header.replace("|", " ").strip())
    if args.markdown:
        print("|---|---|---|---|---|")
    for n in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(n, hidden, device=dev).to(dtype)
        weights, ids = softmax_topk(torch.randn(n, experts, device=dev), top_k, renormalize=True)
        ms_ref, ref = timed(n, False, x, weights, ids)
        ms_tri, out = timed(n, True, x, weights, ids)
        diff = (out.float() - ref.float()).abs().max().item()
        row = [str(n), f"{ms_ref:.3f}", f"{ms_tri:.3f}", f"{ms_ref / ms_tri:.2f}x", f"{diff:.3g}"]
        print("| " + " | ".join(row) + " |" if args.markdown else "  ".join(row))
        if diff > 0.05 * max(1.0, ref.float().abs().max().item()):
            print(f"MISMATCH at {n} tokens: the kernel disagrees with the torch path", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
