"""A Qwen3.5-shaped hybrid GGUF (llama.cpp's ``qwen35``, random Q8_0 weights) on llmkit and on
llama-server: single-stream decode and 16 concurrent requests, plus transformers on the same shape.

    python benchmarks/bench_hybrid_gguf.py [--rounds 3] [--tokens 32] [--concurrency 16]
        [-- extra llmkit serve flags; default: --quantization int8]

(a) Writes, once, a GGUF of the ``qwen3.5-0.8b-like`` preset's shape (gpu_presets.py: hidden 1024,
    24 layers, three Gated DeltaNet layers to each gated attention layer, 16 key and 16 value
    heads of 128, attention 8 heads / 2 KV heads of 256, intermediate 3584, vocabulary 248,320,
    tied embeddings) with random weights: every matrix Q8_0 (random int8 blocks, scales keeping
    activations near unit size), the norms ones, the DeltaNet's ``ssm_a`` negative decays. The
    tokenizer is the embedded SmolLM2 GGUF's, padded to the vocabulary. ``--out-dir`` (default
    ``/work/.cache/benchhybrid``).
(b) llama-server, then ``llmkit serve --model-path FILE --quantization int8`` (llmkit dequantizes a
    qwen35 GGUF and serves it on its int8 CPU kernels: one byte a weight, as Q8_0 is), one at a
    time; for each: load time, RSS, time to one token, single-stream decode tok/s (as
    bench_8b_gguf.py measures it), and the total tok/s of ``--concurrency`` concurrent requests of
    ``--tokens`` tokens (llama-server with that many slots).
(c) transformers (fp32, its torch fallback kernels for the DeltaNet) on the same shape with random
    weights: single-stream greedy decode tok/s (``generate``, timed between a 1-token and an
    ``--tokens``-token run).

Run it on an idle machine (llama.cpp's threads spin-wait; see bench_8b_gguf.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_8b_gguf import PROMPT, add_borrowed_tokenizer, measure, start_llmkit, timed_request  # noqa: E402
from gpu_presets import PRESETS  # noqa: E402

Q8_0_BLOCK = 34  # bytes per 32 weights: an fp16 scale and 32 int8


def q8_0_random(rng: np.random.Generator, rows: int, cols: int, scale: float) -> np.ndarray:
    """``rows x cols`` weights as Q8_0 blocks of random int8 (std ~73) times ``scale`` (x0.5-1.5)."""
    blocks = rows * cols // 32
    out = np.empty((blocks, Q8_0_BLOCK), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, blocks) * scale / 73.0).astype(np.float16)
    out[:, :2] = d.view(np.uint8).reshape(blocks, 2)
    out[:, 2:] = rng.integers(-127, 128, (blocks, 32), dtype=np.int8).view(np.uint8)
    return out.reshape(rows, cols // 32 * Q8_0_BLOCK)


def tensor_plan(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape as rows x cols, kind) of every tensor: ``q8`` matrices, ``ones``, ``a`` (the
    decays), ``zeros``, ``conv`` (small random F32)."""
    h, hd = c["hidden_size"], c["head_dim"]
    nk, nv, dk, dv = (
        c["linear_num_key_heads"],
        c["linear_num_value_heads"],
        c["linear_key_head_dim"],
        c["linear_value_head_dim"],
    )
    conv = 2 * nk * dk + nv * dv
    plan = [("token_embd.weight", (c["vocab_size"], h), "q8"), ("output_norm.weight", (h,), "ones")]
    for i, kind in enumerate(c["layer_types"]):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (h,), "ones"), (b + "post_attention_norm.weight", (h,), "ones")]
        if kind == "full_attention":
            q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
            plan += [
                (b + "attn_q.weight", (2 * q, h), "q8"),
                (b + "attn_k.weight", (kv, h), "q8"),
                (b + "attn_v.weight", (kv, h), "q8"),
                (b + "attn_output.weight", (h, q), "q8"),
                (b + "attn_q_norm.weight", (hd,), "ones"),
                (b + "attn_k_norm.weight", (hd,), "ones"),
            ]
        else:
            plan += [
                (b + "attn_qkv.weight", (conv, h), "q8"),
                (b + "attn_gate.weight", (nv * dv, h), "q8"),
                # (F32, as llama.cpp's quantizer leaves them: llama.cpp's AMX Q8_0 matmul crashed on
                # these 16-row matrices on an AMX CPU)
                (b + "ssm_beta.weight", (nv, h), "small"),
                (b + "ssm_alpha.weight", (nv, h), "small"),
                (b + "ssm_conv1d.weight", (conv, c["linear_conv_kernel_dim"]), "conv"),
                (b + "ssm_a", (nv,), "a"),
                (b + "ssm_dt.bias", (nv,), "zeros"),
                (b + "ssm_norm.weight", (dv,), "ones"),
                (b + "ssm_out.weight", (h, nv * dv), "q8"),
            ]
        inter = c["intermediate_size"]
        plan += [(b + "ffn_gate.weight", (inter, h), "q8"), (b + "ffn_up.weight", (inter, h), "q8")]
        plan += [(b + "ffn_down.weight", (h, inter), "q8")]
    return plan


def write_gguf(c: dict, path: Path, seed: int = 0) -> None:
    import gguf
    from gguf import GGMLQuantizationType

    from llmkit.core.model.loader.source import embedded_gguf_path

    base = gguf.GGUFReader(str(embedded_gguf_path()))
    arch = "qwen35"
    w = gguf.GGUFWriter(None, arch)
    w.add_name(f"random Qwen3.5-shaped {path.stem}")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(4096)
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    rope = c["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(c["head_dim"] * rope["partial_rotary_factor"]))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_full_attention_interval(4)
    w.add_uint32(f"{arch}.ssm.conv_kernel", c["linear_conv_kernel_dim"])
    w.add_uint32(f"{arch}.ssm.state_size", c["linear_key_head_dim"])
    w.add_uint32(f"{arch}.ssm.group_count", c["linear_num_key_heads"])
    w.add_uint32(f"{arch}.ssm.time_step_rank", c["linear_num_value_heads"])
    w.add_uint32(f"{arch}.ssm.inner_size", c["linear_num_value_heads"] * c["linear_value_head_dim"])
    w.add_vocab_size(c["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_borrowed_tokenizer(w, base, c["vocab_size"])
    plan = tensor_plan(c)
    for name, shape, kind in plan:
        if kind == "q8":
            rows, cols = shape
            nbytes = rows * cols // 32 * Q8_0_BLOCK
            w.add_tensor_info(
                name, (rows, cols // 32 * Q8_0_BLOCK), np.dtype(np.uint8), nbytes, raw_dtype=GGMLQuantizationType.Q8_0
            )
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".partial")
    try:
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, shape, kind in plan:
            if kind == "q8":
                scale = 0.05 if name == "token_embd.weight" else 1 / shape[1] ** 0.5
                w.write_tensor_data(q8_0_random(rng, *shape, scale))
            elif kind == "ones":
                w.write_tensor_data(np.ones(shape, dtype=np.float32))
            elif kind == "zeros":
                w.write_tensor_data(np.zeros(shape, dtype=np.float32))
            elif kind == "a":
                w.write_tensor_data(-rng.uniform(0.5, 2.0, shape).astype(np.float32))
            elif kind == "small":
                w.write_tensor_data((rng.standard_normal(shape) / shape[1] ** 0.5).astype(np.float32))
            else:
                w.write_tensor_data((rng.standard_normal(shape) * 0.3).astype(np.float32))
        w.close()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB)", flush=True)


def concurrent_rate(url: str, n_req: int, tokens: int) -> float:
    """Total generated tok/s of ``n_req`` concurrent greedy chat requests of ``tokens`` tokens."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=1200)
    counts = [0] * n_req

    def one(i):
        counts[i] = timed_request(client, tokens, 1000 + i)[1]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n_req)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def transformers_decode(c: dict, tokens: int, threads: int) -> float:
    """transformers' single-stream greedy decode tok/s on the shape (random fp32 weights)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.set_num_threads(threads)
    cfg = Qwen3_5TextConfig(**{k: v for k, v in c.items() if k not in ("architectures", "model_type")})
    model = Qwen3_5ForCausalLM(cfg).eval()
    ids = torch.randint(2, 1000, (1, 20))
    times = {}
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
        for n in (1, tokens):
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            times[n] = time.perf_counter() - t0
    return (tokens - 1) / (times[tokens] - times[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3.5-0.8b-like")
    ap.add_argument("--out-dir", default="/work/.cache/benchhybrid")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--load-timeout", type=float, default=900.0)
    ap.add_argument("--request-timeout", type=float, default=1200.0)
    ap.add_argument("--only", choices=("llama.cpp", "llmkit", "transformers"), default=None)
    ap.add_argument("serve_args", nargs="*")
    a = ap.parse_args()
    a.serve_args = a.serve_args or ["--quantization", "int8"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    c = dict(PRESETS[a.preset])
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{a.preset}-q8_0.gguf"
    if not path.exists():
        write_gguf(c, path)
    res: dict[str, dict] = {}
    for name in ("llama.cpp", "llmkit"):
        if a.only and a.only != name:
            continue
        if name == "llama.cpp":
            from bench_llamacpp import start_llama_server

            def start(on_start):
                ctx = 1024 * a.concurrency
                return start_llama_server(
                    path, a.threads, slots=a.concurrency, ctx=ctx, timeout=a.load_timeout, on_start=on_start
                )

            def stop(proc):
                proc.terminate()
                proc.wait(60)
        else:
            start, stop = start_llmkit(a, path)
        holder: dict = {}

        def with_concurrency(on_start, start=start, holder=holder):
            proc, url = start(on_start)
            holder["url"] = url
            return proc, url

        def stop_after(proc, stop=stop, holder=holder):
            try:
                holder["concurrent"] = concurrent_rate(holder["url"], a.concurrency, a.tokens)
                print(f"{name}: {a.concurrency} concurrent: {holder['concurrent']:.2f} tok/s", flush=True)
            finally:
                stop(proc)

        res[name] = {**measure(name, with_concurrency, stop_after, a), **holder}
    if not a.only or a.only == "transformers":
        res["transformers"] = {"decode": transformers_decode(c, a.tokens, a.threads)}
        print(f"transformers: decode {res['transformers']['decode']:.2f} tok/s", flush=True)
    print("\n| metric | llmkit | llama-server | ratio | transformers | ratio |\n|---|---:|---:|---:|---:|---:|")
    get = lambda n, k: res.get(n, {}).get(k)  # noqa: E731
    for title, key in (
        ("load time (s)", "load_s"),
        (f"time to 1 token, {len(PROMPT.split()) + 1}-word chat prompt (s)", "ttft"),
        (f"single-stream decode, {a.tokens} tokens (tok/s)", "decode"),
        (f"{a.concurrency} concurrent x {a.tokens} tokens (tok/s)", "concurrent"),
    ):
        ours, lc, tf = get("llmkit", key), get("llama.cpp", key), get("transformers", key)
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        r1 = f"{ours / lc:.2f}x" if ours and lc else "-"
        r2 = f"{ours / tf:.2f}x" if ours and tf else "-"
        print(f"| {title} | {fmt(ours)} | {fmt(lc)} | {r1} | {fmt(tf)} | {r2} |")
    print(
        f"{a.rounds} rounds, {a.threads} threads, {path.name}, llmkit flags {' '.join(a.serve_args)}, {time.strftime('%Y-%m-%d %H:%M')}"
    )


if __name__ == "__main__":
    main()
