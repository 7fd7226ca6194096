"""The weight-format kernels of one decode step of the embedded model, per row count.

Times the GEMMs of a full step (30 layers x {qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576}, distinct weights per layer, plus the LM head 576->49152) through the Linear layer
in each candidate format, and the LM head alone. This picks ``INT4_MAX_ROWS`` /
``INT8_MAX_ROWS`` (above them a quantized layer dequantizes and multiplies in fp32) and the GGUF
type -> format mapping. Usage::

    python benchmarks/bench_kernels.py [--rows 1,16,32,64,128,512] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmkit.core.model import int4_format
from llmkit.core.model.int4_format import Int4Format
from llmkit.core.model.linear import Linear
from llmkit.core.model.weight_formats import Int8Format

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
LAYERS = 30
HEAD = (576, 49152)


def _layers(fmt_factory, shapes):
    out = []
    for k, n in shapes:
        layer = Linear(k, n)
        layer.load(torch.randn(n, k) * 0.05)
        fmt = fmt_factory()
        if fmt is not None:
            layer.set_format(fmt)
        out.append(layer)
    return out


def _time(layers, m, reps):
    x = {k: torch.randn(m, k) for k in {layer.in_features for layer in layers}}
    with torch.inference_mode():
        for layer in layers:  # warm-up
            layer(x[layer.in_features])
        runs = []
        for _ in range(reps):
            t = time.perf_counter()
            for layer in layers:
                layer(x[layer.in_features])
            runs.append(time.perf_counter() - t)
    return statistics.median(runs) * 1e3


CANDIDATES = {
    "fp32 (oneDNN/MKL)": lambda: None,
    "int8/ch kernel, bf16 act": lambda: Int8Format(keep_dense=False),
    "int4 g32 kernel, bf16 act": lambda: Int4Format(32),
    "int4 g64 kernel, bf16 act": lambda: Int4Format(64),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,32,64,128,512")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    print(f"step GEMMs, ms (median of {args.reps}); 'dequant' = the layer dequantized per call, then fp32")
    print("| format | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for name, factory in CANDIDATES.items():
        layers = _layers(factory, SHAPES * LAYERS) + _layers(factory, [HEAD])
        cells = []
        for m in rows:
            cells.append(f"{_time(layers, m, args.reps):.1f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
        if "int4" in name or "int8" in name:
            saved = int4_format.INT4_MAX_ROWS
            int4_format.INT4_MAX_ROWS = 0
            from llmkit.core.model import weight_formats

            saved8, weight_formats.INT8_MAX_ROWS = weight_formats.INT8_MAX_ROWS, 0
            try:
                cells = [f"{_time(layers, m, args.reps):.1f}" for m in rows]
            finally:
                int4_format.INT4_MAX_ROWS, weight_formats.INT8_MAX_ROWS = saved, saved8
            print(f"| {name.split(' kernel')[0]} dequant -> fp32 | " + " | ".join(cells) + " |")
        del layers
    print("\nLM head 576->49152 alone, ms")
    print("| format | " + " | ".join(f"M={m}" for m in rows[:3]) + " |")
    print("|---|" + "---:|" * len(rows[:3]))
    for name, factory in CANDIDATES.items():
        head = _layers(factory, [HEAD])
        print(f"| {name} | " + " | ".join(f"{_time(head, m, args.reps * 4):.2f}" for m in rows[:3]) + " |")
    bf16 = Linear(*HEAD)
    bf16.weight.data = (torch.randn(HEAD[1], HEAD[0]) * 0.05).bfloat16()
    t = []
    for m in rows[:3]:
        x = torch.randn(m, HEAD[0]).bfloat16()
        with torch.inference_mode():
            bf16(x)
            s = time.perf_counter()
            for _ in range(args.reps * 4):
                bf16(x)
            t.append((time.perf_counter() - s) / (args.reps * 4) * 1e3)
    print("| bf16 F.linear | " + " | ".join(f"{v:.2f}" for v in t) + " |")


if __name__ == "__main__":
    main()
