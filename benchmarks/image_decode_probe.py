"""Time and memory of large images through the media threads: decode, reduce, the processor.

    python benchmarks/image_decode_probe.py [--size 4000] [--images 14] [--max-pixels 50176] [--full]

One request's worth of single-colour PNGs of ``--size`` x ``--size`` (a few KB each) go through
``load_images`` in-process with a Qwen2-VL processor keeping at most ``--max-pixels`` (50176: the
tests' tiny Qwen; 12845056: Qwen2.5-VL's own). Prints seconds per request, the process's RSS
before (after a warm-up with small images) and after (what stays resident) and its peak. ``--full`` decodes at full size (no target
size), as before images were reduced toward the processor's size.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import resource
import time


def rss_mb() -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) // 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=4000)
    ap.add_argument("--images", type=int, default=14)
    ap.add_argument("--max-pixels", type=int, default=50176)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--full", action="store_true")
    args = ap.parse_args()

    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from llmkit.core.model.qwen_vl.processor import QwenVLProcessor
    from llmkit.core.multimodal.media import MediaPolicy
    from llmkit.core.server.prompts.images import load_images

    pixels = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, min_pixels=3136, max_pixels=args.max_pixels)
    proc = QwenVLProcessor(pixels, {"image_token_id": 506, "vision_config": {"spatial_merge_size": 2}})
    if args.full:
        proc.target_size = lambda w, h: None
    buf = io.BytesIO()
    Image.new("RGB", (args.size, args.size), (9, 9, 9)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    policy = MediaPolicy(max_images=args.images, max_pixels=args.size * args.size)
    small = io.BytesIO()
    Image.new("RGB", (64, 64), (9, 9, 9)).save(small, format="PNG")
    warm = "data:image/png;base64," + base64.b64encode(small.getvalue()).decode()
    asyncio.run(load_images([(warm, "p", False)] * 4, policy, proc, "p"))  # imports, threads
    before, start = rss_mb(), time.monotonic()
    for _ in range(args.rounds):
        asyncio.run(load_images([(url, "p", False)] * args.images, policy, proc, "p"))
    took = (time.monotonic() - start) / args.rounds
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(
        f"{args.images} x {args.size}x{args.size} PNG ({len(buf.getvalue())} bytes each): {took:.2f} s per request, "
        f"RSS {before} -> {rss_mb()} MB, peak {peak} MB"
    )


if __name__ == "__main__":
    main()
