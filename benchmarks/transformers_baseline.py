"""The transformers side of ``bench_gpu.py``: the same config built with its random init on the same
device, decoding the same prompts greedily with ``generate()`` (and the helpers both sides share)."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch
from gpu_presets import make_prompts


def log(msg: str) -> None:
    print(msg, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _Stamps:
    """A generate() streamer that only records when each step's tokens reach the host (the first
    put() is the prompt); tokens.cpu() before put() waits for the device, so no extra sync."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> dict:
    ids = torch.tensor(prompts, device=device)  # equal lengths: the left padding is empty
    mask = torch.ones_like(ids)
    stamps = _Stamps()
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            min_new_tokens=new_tokens,
            max_new_tokens=new_tokens,
            pad_token_id=1,
            eos_token_id=0,
            streamer=stamps,
        )
    sync(device)
    t1 = time.perf_counter()
    if out.shape[1] - ids.shape[1] != new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    first, last = stamps.times[1], stamps.times[-1]
    return {"rows": len(prompts), "wall_s": t1 - t0, "ttft_s": first - t0, "decode_s": last - first}


def hf_metrics(chunks: list[dict], new_tokens: int) -> dict:
    rows = sum(c["rows"] for c in chunks)
    wall, decode = sum(c["wall_s"] for c in chunks), sum(c["decode_s"] for c in chunks)
    return {
        "requests": rows,
        "output_tokens": rows * new_tokens,
        "wall_s": wall,
        "output_tok_s": rows * new_tokens / wall,
        "decode_tok_s": rows * (new_tokens - 1) / decode if decode > 0 else float("nan"),
        "ttft_mean_s": sum(c["ttft_s"] for c in chunks) / len(chunks),
        "batches": len(chunks),
    }


def bench_transformers(args, model_dir: Path, device: torch.device, dtype: torch.dtype) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    n, p, m = args.num_requests, args.prompt_len, args.output_len
    config = AutoConfig.from_pretrained(str(model_dir))
    t_build = time.perf_counter()
    with torch.device(device):  # random init directly on the device: no host copy of 16 GB
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to(device).eval()
    info = {
        "engine": "transformers",
        "attention": getattr(model.config, "_attn_implementation", "?"),
        "build_s": round(time.perf_counter() - t_build, 2),
    }
    vocab = config.vocab_size
    warm_m = min(m, 8)
    try:
        if "single" in args.scenario:
            hf_generate(model, make_prompts(1, p, vocab, 101), warm_m, device)
            info["single"] = hf_metrics([hf_generate(model, make_prompts(1, p, vocab, 1), m, device)], m)
            log(f"  transformers single: {info['single']['decode_tok_s']:.1f} decode tok/s")
        if "concurrent" in args.scenario:
            bs = min(args.hf_batch or n, n)
            info["hf_batch"] = bs
            if bs < n:
                log(f"  transformers: {n} prompts in batches of {bs} (--hf-batch), run one after another")
            prompts = make_prompts(n, p, vocab, 2)
            try:
                hf_generate(model, make_prompts(bs, p, vocab, 102), warm_m, device)
                chunks = [hf_generate(model, prompts[i : i + bs], m, device) for i in range(0, n, bs)]
            except torch.cuda.OutOfMemoryError:  # keep the results so far; say how to fit
                info["concurrent_error"] = f"out of memory at batch {bs}: pass a smaller --hf-batch"
                log(f"  transformers concurrent: {info['concurrent_error']}")
            else:
                info["concurrent"] = c = hf_metrics(chunks, m)
                log(
                    f"  transformers concurrent {n}x{m}: {c['output_tok_s']:.1f} output tok/s, "
                    f"{c['decode_tok_s']:.1f} decode tok/s"
                )
    finally:
        del model
        free_memory(device)
    return info
