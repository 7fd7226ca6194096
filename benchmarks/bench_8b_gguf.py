"""An 8B-class GGUF (Llama-3.1-8B's shape, random Q4_0 weights) on llmkit and on llama-server.

    python benchmarks/bench_8b_gguf.py [--rounds 3] [--tokens 32] [--write-only] [shape options]
        [-- extra llmkit serve flags]

(a) Writes, once, a GGUF of Llama-3.1-8B's shape (hidden 4096, 32 layers, 32 heads / 8 KV heads,
    intermediate 14336, vocab 128256, rope theta 500000, context 8192) with random weights: every
    matrix (embeddings and LM head too, untied) Q4_0, written block by block (an fp16 scale and 16
    bytes of random nibbles per 32 weights, never quantized from floats), the norms F32 ones.
    The scales are ``1 / (4.6 * sqrt(in))`` (x0.5-1.5 per block): random nibbles have a standard
    deviation of ~4.6, so every matmul keeps activations near unit size and 32 layers stay finite.
    The tokenizer is the embedded SmolLM2 GGUF's (byte-level BPE, 49,152 tokens, its chat template)
    padded with ``<|pad_N|>`` tokens to the vocabulary size, so both servers load it and the
    embedding / LM head have Llama 3's 128,256 rows. Not modelled: Llama 3.1's rope scaling
    (``rope_freqs``), and real Q4_K_M files' Q6_K tensors (see ``--help``).
    The file goes to ``--out-dir`` (default ``/work/.cache/bench8b``, outside the repository; ~4.5 GB).
(b) Serves it with llama-server, then with ``llmkit serve --model-path FILE`` (one at a time: never
    both loaded), and measures for each: load time (start to ``/health``), resident memory of the
    server's process tree (peak over load + requests, sampled every 0.2 s, and after the requests;
    ``anon`` is the part that is not the memory-mapped file), and single-stream greedy decode of
    ``--tokens`` tokens with ``ignore_eos`` (decode tok/s = (tokens - 1) / (time of that request -
    time of a 1-token request on a prompt of the same length), non-streamed; median of
    ``--rounds`` after a warm-up request).

Run it on an idle machine (``uptime`` load < 1): llama.cpp's threads spin-wait, so with other
work on the 2 cores its decode collapses (0.6-1.8 tok/s at 8B under load vs 7.7 moments before);
the two servers are measured one after the other, not interleaved, so any change in load between
them skews the ratio.

Both servers get ``--threads`` threads and ``--context`` tokens of context: llama-server
``-np 1 -c CONTEXT`` (f16 KV cache), llmkit ``--context-length CONTEXT`` (its pool is allocated
untouched and grows as used). Smoke-test shape: ``--layers 2 --hidden 512 --heads 8 --kv-heads 2
--intermediate 1024 --vocab 49152``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from proc_memory import PeakRSS, tree_huge_mb, tree_rss  # noqa: E402

Q4_0_BLOCK = 18  # bytes per 32 weights: fp16 scale + 16 bytes of nibbles
PROMPT = "Write a short essay about the history of the printing press."


# ---------------------------------------------------------------------------------------------
# (a) the GGUF


def q4_0_random(rng: np.random.Generator, rows: int, cols: int, scale: float) -> np.ndarray:
    """``[rows, cols/32*18]`` uint8: random Q4_0 blocks with fp16 scales ``scale * U(0.5, 1.5)``."""
    nb = rows * cols // 32
    blocks = np.empty((nb, Q4_0_BLOCK), dtype=np.uint8)
    blocks[:, 2:] = rng.integers(0, 256, size=(nb, 16), dtype=np.uint8)
    d = (scale * (0.5 + rng.random(nb, dtype=np.float32))).astype(np.float16)
    blocks[:, :2] = d.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, cols // 32 * Q4_0_BLOCK)


def tensor_plan(a) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, (rows, cols) or (n,), "q4_0" | "f32")`` in file order, llama.cpp's llama names."""
    h, i, hd = a.hidden, a.intermediate, a.hidden // a.heads
    plan = [("token_embd.weight", (a.vocab, h), "q4_0")]
    for b in range(a.layers):
        p = f"blk.{b}."
        plan += [
            (p + "attn_norm.weight", (h,), "f32"),
            (p + "attn_q.weight", (a.heads * hd, h), "q4_0"),
            (p + "attn_k.weight", (a.kv_heads * hd, h), "q4_0"),
            (p + "attn_v.weight", (a.kv_heads * hd, h), "q4_0"),
            (p + "attn_output.weight", (h, a.heads * hd), "q4_0"),
            (p + "ffn_norm.weight", (h,), "f32"),
            (p + "ffn_gate.weight", (i, h), "q4_0"),
            (p + "ffn_up.weight", (i, h), "q4_0"),
            (p + "ffn_down.weight", (h, i), "q4_0"),
        ]
    plan += [("output_norm.weight", (h,), "f32"), ("output.weight", (a.vocab, h), "q4_0")]
    return plan


def gguf_name(a) -> str:
    return f"llama-h{a.hidden}-l{a.layers}-a{a.heads}-kv{a.kv_heads}-i{a.intermediate}-v{a.vocab}-q4_0.gguf"


def add_borrowed_tokenizer(w, base, vocab: int) -> None:
    """The ``tokenizer.*`` keys of GGUF reader ``base`` into writer ``w``, its tokens padded with
    ``<|pad_N|>`` to ``vocab``."""
    import gguf
    from gguf import GGUFValueType

    pad = vocab - len(base.fields["tokenizer.ggml.tokens"].contents())
    for key, field in base.fields.items():
        if not key.startswith("tokenizer."):
            continue
        val = field.contents()
        if key == "tokenizer.ggml.tokens":
            val = list(val) + [f"<|pad_{n}|>" for n in range(pad)]
        elif key == "tokenizer.ggml.token_type":
            val = list(val) + [int(gguf.TokenType.NORMAL)] * pad
        elif key == "tokenizer.ggml.scores":
            val = list(val) + [0.0] * pad
        if field.types[0] == GGUFValueType.ARRAY:
            w.add_key_value(key, val, GGUFValueType.ARRAY, sub_type=field.types[-1])
        else:
            w.add_key_value(key, val, field.types[0])


def write_gguf(a, path: Path) -> None:
    """Write the random GGUF to ``path`` tensor by tensor (one tensor in memory at a time), via a
    temporary file renamed at the end."""
    import gguf
    from gguf import GGMLQuantizationType

    from llmkit.core.model.loader.source import embedded_gguf_path

    if a.hidden % a.heads or a.heads % a.kv_heads or a.hidden % 32 or a.intermediate % 32:
        raise SystemExit("shape: hidden must divide by heads and 32, heads by kv-heads, intermediate by 32")
    base = gguf.GGUFReader(str(embedded_gguf_path()))
    tokens = base.fields["tokenizer.ggml.tokens"].contents()
    if a.vocab < len(tokens):
        raise SystemExit(f"--vocab must be at least the borrowed tokenizer's {len(tokens)} tokens")
    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(None, "llama")
    w.add_name(f"random Llama-shaped {path.stem}")
    w.add_block_count(a.layers)
    w.add_context_length(a.context)
    w.add_embedding_length(a.hidden)
    w.add_feed_forward_length(a.intermediate)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_dimension_count(a.hidden // a.heads)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(a.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_borrowed_tokenizer(w, base, a.vocab)
    plan = tensor_plan(a)
    for name, shape, kind in plan:
        if kind == "f32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            rows, cols = shape
            nbytes = rows * cols // 32 * Q4_0_BLOCK
            w.add_tensor_info(
                name, (rows, cols // 32 * Q4_0_BLOCK), np.dtype(np.uint8), nbytes, raw_dtype=GGMLQuantizationType.Q4_0
            )
    rng = np.random.default_rng(a.seed)
    t0 = time.monotonic()
    try:
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for n, (name, shape, kind) in enumerate(plan):
            if kind == "f32":
                w.write_tensor_data(np.ones(shape, dtype=np.float32))
            else:
                rows, cols = shape
                # embeddings: entries of ~0.05; matmuls: unit-size outputs (see the module doc)
                scale = 0.01 if name == "token_embd.weight" else 1 / (4.6 * cols**0.5)
                w.write_tensor_data(q4_0_random(rng, rows, cols, scale))
            if n % 45 == 0:
                print(f"  wrote {n + 1}/{len(plan)} tensors ({time.monotonic() - t0:.0f} s)", flush=True)
        w.close()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - t0:.0f} s", flush=True)


# ---------------------------------------------------------------------------------------------
# (b) the servers


def timed_request(client, n: int, salt: int) -> tuple[float, int, dict | None]:
    """One non-streamed greedy chat request of ``n`` tokens (EOS ignored): ``(seconds, tokens,
    the server's own timings if it reports them)``. ``salt`` starts the prompt (a different one
    for each request: no prompt-cache hit beyond the chat template's shared prefix)."""
    t0 = time.perf_counter()
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": f"{salt}. {PROMPT}"}],
        max_tokens=n,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return time.perf_counter() - t0, r.usage.completion_tokens, getattr(r, "timings", None)


def decode_round(client, n: int, salt: int) -> tuple[float, float, float | None]:
    """``(ttft s, decode tok/s, the server's own decode tok/s or None)``: a 1-token request and an
    ``n``-token one with prompts of the same length; decode = (n - 1) / the difference of their
    times. Non-streamed on purpose: from Python, llama-server's SSE chunks arrived ~0.35 s apart
    on this machine while its own timings (and curl) showed ~25 ms a token."""
    t1, _, _ = timed_request(client, 1, salt)
    tn, count, timings = timed_request(client, n, salt + 1)
    if count < 2 or tn <= t1:
        raise RuntimeError(f"{count} tokens in {tn:.2f} s vs 1 in {t1:.2f} s: cannot time the decode")
    own = timings.get("predicted_per_second") if isinstance(timings, dict) else None
    return t1, (count - 1) / (tn - t1), own


def measure(name: str, start, stop, a) -> dict:
    """Start a server with ``start(on_start) -> (proc, url)`` (``on_start(proc)`` as soon as it is
    launched: its tree is sampled from then on), time its load,
    run the decode rounds, stop it with ``stop(proc)`` in any case."""
    import openai

    holder: dict = {}
    sampler: list[PeakRSS] = []
    t0 = time.monotonic()
    proc = None
    try:
        proc, url = start(lambda p: sampler.append(PeakRSS(p.pid)))
        holder["load_s"] = time.monotonic() - t0
        holder["rss_loaded"] = tree_rss(proc.pid)
        huge = tree_huge_mb(proc.pid)
        print(
            f"{name}: loaded in {holder['load_s']:.1f} s, RSS {holder['rss_loaded']['VmRSS']:.0f} MB "
            f"({huge:.0f} MB in huge pages)",
            flush=True,
        )
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=a.request_timeout)
        timed_request(client, 4, 0)  # warm-up
        ttft, rate, own = [], [], []
        for r in range(a.rounds):
            t, d, o = decode_round(client, a.tokens, 2 * r + 1)
            ttft.append(t)
            rate.append(d)
            own += [o] if o else []
            note = f" (server's own: {o:.2f})" if o else ""
            print(f"{name}: round {r + 1}: TTFT {t:.2f} s, decode {d:.2f} tok/s{note}", flush=True)
        holder["ttft"] = statistics.median(ttft)
        holder["decode"] = statistics.median(rate)
        holder["own"] = statistics.median(own) if own else None
        holder["rss_after"] = tree_rss(proc.pid)
    finally:
        if proc is not None:
            stop(proc)
        if sampler:
            holder["rss_peak"] = sampler[0].stop()
    return holder


def start_llama(a, path: Path):
    from bench_llamacpp import start_llama_server

    def start(on_start):
        return start_llama_server(path, a.threads, slots=1, ctx=a.context, timeout=a.load_timeout, on_start=on_start)

    def stop(proc):
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)

    return start, stop


def start_llmkit(a, path: Path):
    from server_utils import start_server, stop_server

    def start(on_start):
        args = ["--model-path", str(path), "--num-threads", str(a.threads), "--context-length", str(a.context)]
        args += ["--batch-storage", "none", *a.serve_args]
        return start_server(args, timeout=a.load_timeout, on_start=on_start)

    return start, stop_server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="/work/.cache/bench8b")
    ap.add_argument("--rewrite", action="store_true", help="write the GGUF even if it exists")
    ap.add_argument("--write-only", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--load-timeout", type=float, default=900.0, help="seconds each server may take to load")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--only", choices=("llama.cpp", "llmkit"), default=None, help="measure one server only")
    ap.add_argument("serve_args", nargs="*", help="extra llmkit serve flags (after --)")
    a = ap.parse_args()
    # SIGTERM (``timeout``) as an exit: the finally blocks stop the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / gguf_name(a)
    if a.rewrite or not path.exists():
        write_gguf(a, path)
    else:
        print(f"using {path} ({path.stat().st_size / 1e9:.2f} GB)", flush=True)
    if a.write_only:
        return

    res = {}
    for name, factory in (("llama.cpp", start_llama), ("llmkit", start_llmkit)):
        if a.only and a.only != name:
            continue
        start, stop = factory(a, path)
        res[name] = measure(name, start, stop, a)  # stopped (and its memory freed) before the next
    print()
    print("| metric | llmkit | llama-server | ratio | target |\n|---|---:|---:|---:|---|")

    def row(title, get, target="", fmt="{:.2f}"):
        v = {n: (get(r) if r else None) for n, r in ((n, res.get(n)) for n in ("llmkit", "llama.cpp"))}
        a_, b_ = v["llmkit"], v["llama.cpp"]
        ratio = f"{a_ / b_:.2f}x" if a_ is not None and b_ else "-"
        show = [fmt.format(x) if x is not None else "-" for x in (a_, b_)]
        print(f"| {title} | {show[0]} | {show[1]} | {ratio} | {target} |")

    row("load time, start to /health (s)", lambda r: r["load_s"], fmt="{:.1f}")
    row("RSS after load (MB)", lambda r: r["rss_loaded"]["VmRSS"], fmt="{:.0f}")
    row("RSS peak, load + requests (MB)", lambda r: r["rss_peak"]["VmRSS"], fmt="{:.0f}")
    row("  anonymous part at the peak (MB)", lambda r: r["rss_peak"]["RssAnon"], fmt="{:.0f}")
    row("RSS after the requests (MB)", lambda r: r["rss_after"]["VmRSS"], "llmkit ≤ 7000 MB", fmt="{:.0f}")
    row("  anonymous part (MB)", lambda r: r["rss_after"]["RssAnon"], fmt="{:.0f}")
    row(f"time to 1 token, {len(PROMPT.split()) + 1}-word chat prompt (s)", lambda r: r["ttft"])
    row(f"single-stream decode, {a.tokens} greedy tokens (tok/s)", lambda r: r["decode"], "≥ 1.0x")
    if res.get("llama.cpp", {}).get("own"):
        print(f"(llama-server's own timings: decode {res['llama.cpp']['own']:.2f} tok/s)")
    print(
        f"{a.rounds} rounds, {a.threads} threads, context {a.context}, {path.name} "
        f"({path.stat().st_size / 1e9:.2f} GB), {time.strftime('%Y-%m-%d %H:%M')}"
    )


if __name__ == "__main__":
    main()
