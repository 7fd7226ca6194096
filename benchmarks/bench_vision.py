"""Time to first token for one image, split into where the time goes, on the tiny random-weight
vision-language models of the tests (CPU), against transformers on the same inputs in one run.

    python benchmarks/bench_vision.py [--size 448] [--reps 5] [--json FILE]

For each family (Qwen2.5-VL, Gemma 3), with a ``--size`` x ``--size`` PNG and a short question:
- decode: PNG bytes to pixels (``decode_image``) and the model's preprocessing, as the server
  does in its media threads;
- encoder: ``encode_images`` on those pixels;
- prefill: the engine's time to first token with the image's encoder rows already cached and
  the prefix cache flushed (the prompt's forward and the sampling);
- TTFT: the engine's time to first token for an image it has not seen (encoder + prefill);
- transformers: the same prompt's first token with ``generate(max_new_tokens=1)`` from
  preprocessed inputs (its encoder + prefill), the baseline for TTFT.
Medians of ``--reps``. The tiny models make the split, not the absolute figures, the point: on
real shapes the encoder and the prefill grow, the decode does not.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))


def _png(size: int, seed: int) -> bytes:
    from PIL import Image

    data = bytes((i * (31 + seed) + seed * 97) % 251 for i in range(size * size * 3))
    buf = io.BytesIO()
    Image.frombytes("RGB", (size, size), data).save(buf, format="PNG")
    return buf.getvalue()


def _median_ms(fn, reps: int) -> float:
    times = []
    for i in range(reps):
        t = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def _first_token_ms(engine, ids, mm) -> float:
    from llmkit.core.engine.messages import GenerateRequest, SamplingParams

    done = threading.Event()
    t = time.perf_counter()
    engine.submit(
        GenerateRequest(f"b{time.monotonic_ns()}", ids, SamplingParams(max_new_tokens=1, temperature=0), mm=mm),
        lambda o: done.set() if o.token_ids or o.finished else None,
    )
    done.wait(120)
    return (time.perf_counter() - t) * 1000


def run_family(name: str, save, size: int, reps: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    from llmkit.core.model.loader.source import load_config
    from llmkit.core.multimodal.media import MediaPolicy, decode_image
    from llmkit.core.plugins import registry

    from model_utils import start_engine

    path = Path(tempfile.mkdtemp()) / name
    ref = save(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    cfg = load_config(path)
    proc = registry().model(cfg["architectures"][0]).processor(str(path), cfg, tok)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    base_ids = tok(text, add_special_tokens=False)["input_ids"]
    pngs = [_png(size, s) for s in range(reps + 2)]
    policy = MediaPolicy()

    decode = _median_ms(lambda i: proc.preprocess(decode_image(pngs[i], policy)), reps)
    engine = start_engine(model_path=str(path))
    model = engine.runner.model
    items = [proc.preprocess(decode_image(p, policy)) for p in pngs]
    with torch.inference_mode():
        encoder = _median_ms(lambda i: model.encode_images([items[i]]), reps)

    def flush():
        ev = threading.Event()
        engine.flush_cache(lambda ok: ev.set())
        ev.wait(30)

    expanded = [proc.expand(list(base_ids), [it]) for it in items]
    ttft = []
    for i in range(reps):  # a new image each time: encoder + prefill
        flush()
        ttft.append(_first_token_ms(engine, *expanded[i]))
    prefill = []
    for _ in range(reps):  # the last image again: its rows cached, the prefix cache flushed
        flush()
        prefill.append(_first_token_ms(engine, *expanded[reps - 1]))
    engine.shutdown()

    def hf(i):
        ids, mm = expanded[i]
        t = torch.tensor([ids])
        kw = {"input_ids": t}
        if name == "gemma3":
            kw |= {"pixel_values": items[i].pixel_values.reshape(1, *items[i].pixel_values.shape[-3:])}
            kw["token_type_ids"] = (t == ref.config.image_token_id).long()
        else:
            kw |= {"pixel_values": items[i].pixel_values, "image_grid_thw": torch.tensor([items[i].meta["grid_thw"]])}
            kw["mm_token_type_ids"] = (t == ref.config.image_token_id).int()
        with torch.no_grad():
            ref.generate(**kw, max_new_tokens=1, do_sample=False)

    transformers_ms = _median_ms(hf, reps)
    return {
        "family": name,
        "image": f"{size}x{size}",
        "image_tokens": items[0].num_tokens,
        "prompt_tokens": len(expanded[0][0]),
        "decode_ms": decode,
        "encoder_ms": encoder,
        "prefill_ms": statistics.median(prefill),
        "ttft_ms": statistics.median(ttft),
        "transformers_ms": transformers_ms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from gemma3_utils import save_tiny_gemma3
    from vl_utils import save_tiny_qwen2_5_vl

    rows = [
        run_family("qwen2_5_vl", save_tiny_qwen2_5_vl, args.size, args.reps),
        run_family("gemma3", save_tiny_gemma3, args.size, args.reps),
    ]
    print("| family | image (tokens) | decode + preprocess | encoder | prefill | TTFT | transformers | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['family']} | {r['image']} ({r['image_tokens']}) | {r['decode_ms']:.1f} ms | {r['encoder_ms']:.1f} ms "
            f"| {r['prefill_ms']:.1f} ms | {r['ttft_ms']:.1f} ms | {r['transformers_ms']:.1f} ms "
            f"| {r['transformers_ms'] / r['ttft_ms']:.2f}x |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
