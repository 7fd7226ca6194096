"""The weight-format kernels of one decode step of the embedded model, per row count.

Times the GEMMs of a full step (30 layers x {qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576}, distinct weights per layer, plus the LM head 576->49152) through the Linear layer
in each candidate format: fp32 (oneDNN below 256 rows, MKL above), and each quantized format with
its kernel forced at every row count or dequantized per call then multiplied in fp32. With
``LLMKIT_NATIVE=0`` the int8 and int4 candidates are torch's ``_weight_int8pack_mm`` and
``_weight_int4pack_mm_for_cpu`` instead of our C kernels. This picks ``INT4_MAX_ROWS`` /
``INT8_MAX_ROWS`` (above them a quantized layer dequantizes and multiplies in fp32) and the GGUF
type -> format mapping. ``--int4-kernels`` instead times the int4 kernels themselves on the same
30 layers' int4 shapes: torch's ``_weight_int4pack_mm_for_cpu`` (bf16 activations) against our C
kernel's AVX2 build and, where the CPU has it, its VNNI build (bit for bit the same results).
Usage::

    python benchmarks/bench_kernels.py [--rows 1,16,64,512] [--rounds 3] [--int4-kernels]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmkit.core.model.linear import Linear
from llmkit.core.model.quant import int4_format
from llmkit.core.model.quant.int4_format import Int4Format
from llmkit.core.model.quant.int8 import Int8Format

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
    # our C integer-dot kernel where it builds (core/model/cpu/cpu_quant.py), else torch's bf16 one
    "int8/ch kernel (C where it builds)": lambda: Int8Format(keep_dense=False),
    "int4 g32 kernel, bf16 act": lambda: Int4Format(32),
    "int4 g64 kernel, bf16 act": lambda: Int4Format(64),
}


def _forced(name):
    """Context: force the kernel (0 rows -> always dequantize) of a quantized candidate."""
    from contextlib import contextmanager

    from llmkit.core.model.quant import int8 as weight_formats

    @contextmanager
    def force(limit):
        names = ("INT8_MAX_ROWS", "INT8_NO_DENSE_MAX_ROWS")
        saved = int4_format.INT4_MAX_ROWS, *(getattr(weight_formats, n) for n in names)
        int4_format.INT4_MAX_ROWS = limit
        for n in names:
            setattr(weight_formats, n, limit)
        try:
            yield
        finally:
            int4_format.INT4_MAX_ROWS = saved[0]
            for n, v in zip(names, saved[1:]):
                setattr(weight_formats, n, v)

    return force


def _int4_kernels(rows: list[int], rounds: int) -> None:
    from llmkit.core.model.cpu import cpu_quant
    from llmkit.core.model.quant.int4_format import pack_int4

    group, layers = 32, []
    for _ in range(LAYERS):  # distinct weights per layer: they stream from memory as in a step
        for k, n in SHAPES:
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            scale, zero = torch.rand(n, k // group) * 0.01, torch.randn(n, k // group) * 0.01
            sz = torch.stack((scale, zero), -1).transpose(0, 1).contiguous().bfloat16()
            layers.append((k, n, pack_int4(q), sz, *cpu_quant.q4_pack(q, scale, zero)))
    isas = ["avx2"] + (["avx512vnni"] if cpu_quant.isa() == "avx512vnni" else [])
    kernels = {"torch `_weight_int4pack_mm_for_cpu`, bf16 act": None} | {f"C, {isa} build": isa for isa in isas}
    res = {(name, m): [] for name in kernels for m in rows}
    for _ in range(rounds):
        for m in rows:
            x = {k: torch.randn(m, k) for k, _ in SHAPES}
            for name, isa in kernels.items():
                for _ in range(2):  # warm-up, then timed
                    t = time.perf_counter()
                    for k, n, packed, sz, q4, q4_sz in layers:
                        if isa is None:
                            torch._weight_int4pack_mm_for_cpu(x[k].bfloat16(), packed, group, sz).float()
                        else:
                            cpu_quant.q4_linear(x[k], q4, q4_sz, group, n, isa)
                    elapsed = time.perf_counter() - t
                res[(name, m)].append(elapsed * 1e3)
    print(f"int4 g32 layers of one decode step (30 x 4), ms, best of {rounds} interleaved rounds")
    print("| kernel | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for name in kernels:
        print(f"| {name} | " + " | ".join(f"{min(res[(name, m)]):.1f}" for m in rows) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int4-kernels", action="store_true", help="torch's int4 kernel against our C builds")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    if args.int4_kernels:
        return _int4_kernels(rows, args.rounds)
    step = {name: _layers(f, SHAPES * LAYERS) + _layers(f, [HEAD]) for name, f in CANDIDATES.items()}
    force = _forced(None)
    variants = []  # (label, layers, forced row limit or None)
    for name, layers in step.items():
        if name.startswith("fp32"):
            variants.append((name, layers, None))
        else:
            variants.append((name + " (kernel at every M)", layers, 1 << 30))
            variants.append((name.split(" kernel")[0] + " dequant -> fp32 GEMM", layers, 0))
    res = {(v[0], m): [] for v in variants for m in rows}
    for _ in range(args.rounds):  # interleaved: a drift of the shared machine hits every candidate
        for m in rows:
            for label, layers, limit in variants:
                with force(limit if limit is not None else 1 << 30):
                    res[(label, m)].append(_time(layers, m, 1))
    print(f"GEMMs of one decode step (30 layers + LM head), ms, median of {args.rounds} interleaved rounds")
    print("| candidate | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for label, _, _ in variants:
        print(f"| {label} | " + " | ".join(f"{statistics.median(res[(label, m)]):.1f}" for m in rows) + " |")


if __name__ == "__main__":
    main()
