"""The machine's read bandwidth and the share of it each CPU weight kernel reaches at batch 1.

A single-stream decode step reads every weight once, so its limit is the read bandwidth: this
measures that limit on the machine it runs on (a ``torch.sum`` over 1 GiB, with 1 thread and with
``--threads``) and, for each weight format's kernel, the bytes it reads over the 30 distinct layers
of the embedded model's decoder (576 -> 960 / 576 / 3072, 1536 -> 576: ~70 MB fp32, more than the
last-level cache) and the LM head's 49,152 x 576, as GB/s and as a fraction of the measured limit.
The CPU's vector extensions (AVX2, AVX-512, VNNI, BF16, AMX) are printed with it, since the
kernels' speed depends on which they can use.

    python benchmarks/bench_bandwidth.py [--threads 2] [--rounds 5] [--gib 1]
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_kernels import _layers, _time  # (the same distinct layers and timed passes)

from llmkit.core.model.linear import Linear
from llmkit.core.model.quant.int4_format import Int4Format
from llmkit.core.model.quant.int8 import Int8Format

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30  # (in, out) of one step's GEMMs
HEAD_SHAPE = [(576, 49152)]
FORMATS = {
    "fp32 (oneDNN/MKL)": lambda: None,
    "int8 per channel (C kernel)": lambda: Int8Format(keep_dense=False),
    "int4 group 32 (C kernel)": lambda: Int4Format(32),
}
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def cpu_summary() -> str:
    model, flags = "unknown CPU", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return f"{model}; {' '.join(f for f in FLAGS if f in flags) or 'no AVX2'}"


def read_bandwidth(threads: int, gib: float, rounds: int) -> float:
    """GB/s of a sum over ``gib`` GiB of fp32 (the best of ``rounds``)."""
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()  # touched and warm
    best = min(_timed(x.sum) for _ in range(rounds))
    return x.nbytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def read_bytes(layer: Linear) -> int:
    """Bytes a batch-1 call reads: the quantized buffers, or the dense weight."""
    buffers = [b for _, b in layer.named_buffers()]
    if buffers:
        return sum(b.nbytes for b in buffers)
    return layer.weight.nbytes + (layer.bias.nbytes if layer.bias is not None else 0)


def kernel_rate(factory, shapes, rounds: int) -> tuple[int, float]:
    """(bytes read, median seconds) of one batch-1 pass over ``shapes``' distinct layers."""
    layers = _layers(factory, shapes)
    return sum(read_bytes(layer) for layer in layers), _time(layers, 1, rounds) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gib", type=float, default=1.0)
    args = ap.parse_args()
    print(f"# {cpu_summary()}")
    one = read_bandwidth(1, args.gib, args.rounds)
    limit = read_bandwidth(args.threads, args.gib, args.rounds)
    print(f"read bandwidth: {one:.1f} GB/s (1 thread), {limit:.1f} GB/s ({args.threads} threads: the limit below)")
    print("| kernel, batch 1 | part | MB read | ms | GB/s | share of the limit |")
    print("|---|---|---:|---:|---:|---:|")
    for name, factory in FORMATS.items():
        for part, shapes in (("30 decoder layers", LAYER_SHAPES), ("LM head", HEAD_SHAPE)):
            nbytes, secs = kernel_rate(factory, shapes, args.rounds)
            rate = nbytes / secs / 1e9
            print(f"| {name} | {part} | {nbytes / 1e6:.1f} | {secs * 1e3:.2f} | {rate:.1f} | {rate / limit:.0%} |")


if __name__ == "__main__":
    main()
