"""Sliding-window K/V: what window layers that keep only their window save, against ``--swa-full``.

For each model shape (its real attention shape and window pattern, fewer layers, small MLPs and
vocabulary: none of those changes the K/V) this builds the real engine parts from a
``--load-format dummy`` checkpoint in one fixed memory budget (``--max-total-tokens``: the memory
of that many full-length tokens) and drives the real scheduler over the real pools, without
running the forward (the K/V's numbers do not decide where pages go):

- K/V bytes per token at a 32K context: one request's pages of both kinds once its 32,768-token
  prompt is in, times each page's bytes, over 32,768 (``--swa-full``: every layer's bytes);
- how many 8,192-token requests fit: requests admitted until the pools are full, each one's whole
  prompt held at once.

    python benchmarks/bench_swa_kv.py [--shapes gpt-oss-20b gemma-3-27b] [--pool-tokens 262144]

A shape is a config.json (``SHAPES``, or ``--config NAME=PATH`` for a file). Gemma 4 is served
with window pages (50 of 60 of the 31B's layers on a 1,024-token window, full layers with head
size 512): pass its text config.json (``Gemma4ForCausalLM``; fewer layers in the same pattern are
fine) to measure it; its head counts are not written down in this repository.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_presets import write_model_dir  # noqa: E402

GPT_OSS_20B = dict(  # openai/gpt-oss-20b's attention: 64 heads, 8 K/V heads of 64, window 128
    architectures=["GptOssForCausalLM"],
    model_type="gpt_oss",
    hidden_size=256,
    num_hidden_layers=4,  # 24 in the checkpoint, alternating as here
    layer_types=["sliding_attention", "full_attention"] * 2,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    sliding_window=128,
    intermediate_size=64,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=1024,
    max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
    },
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
GEMMA_3_27B = dict(  # google/gemma-3-27b-it's text model: 32 heads, 16 K/V heads of 128, window 1,024, 5:1
    architectures=["Gemma3ForCausalLM"],
    model_type="gemma3_text",
    hidden_size=256,
    num_hidden_layers=12,  # 62 in the checkpoint, the same 5:1 pattern
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2,
    num_attention_heads=32,
    num_key_value_heads=16,
    head_dim=128,
    query_pre_attn_scalar=168,
    sliding_window=1024,
    intermediate_size=64,
    vocab_size=1024,
    max_position_embeddings=131072,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
)
SHAPES = {"gpt-oss-20b": GPT_OSS_20B, "gemma-3-27b": GEMMA_3_27B}


def _model_dir(shape: dict, path: Path) -> str:
    write_model_dir("tiny", path)  # its tokenizer (vocabulary 512 <= the shape's)
    (path / "config.json").write_text(json.dumps({**shape, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}))
    return str(path)


def _prefill(sched, reqs, max_steps: int = 100000) -> None:
    """Admit and prefill ``reqs`` through the real scheduler (no forward), until no step is left."""
    for r in reqs:
        sched.add(r)
    for _ in range(max_steps):
        batch = sched.schedule()
        if batch is None:
            return
        sched.on_step_done(batch)


def _request(rid: str, n: int, seed: int):
    from llmkit.core.engine.messages import SamplingParams
    from llmkit.core.engine.request import Request

    return Request(rid=rid, prompt_ids=[(seed * 7919 + 31 * j) % 500 + 2 for j in range(n)], params=SamplingParams())


def measure(shape: dict, swa_full: bool, pool_tokens: int, chunk: int) -> dict:
    from llmkit.core.engine.builder import build_engine_parts
    from llmkit.core.engine.config import EngineConfig

    with tempfile.TemporaryDirectory() as d:
        cfg = EngineConfig(
            model_path=_model_dir(shape, Path(d)),
            load_format="dummy",
            device="cpu",
            max_total_tokens=pool_tokens,
            context_length=32768 + 64,
            max_running_requests=256,
            chunked_prefill_size=chunk,
            disable_radix_cache=True,
            swa_full=swa_full,
            grammar_backend="none",
        )
        parts = build_engine_parts(cfg)
    sched = parts.scheduler
    pool, wins = sched.pool, sched.windows
    layer_bytes = [k[0].numel() * k.element_size() * 2 for k in pool.k_buffers]  # K and V, a slot
    full_bytes = sum(b for i, b in enumerate(layer_bytes) if wins is None or i not in wins.layers)
    win_bytes = sum(layer_bytes) - full_bytes
    page = pool.page_size
    # one 32K request
    req = _request("long", 32768, 1)
    _prefill(sched, [req])
    held = len(req.own_pages) * page * full_bytes
    if wins is not None:
        held += wins.held_pages(req) * page * win_bytes
    sched.finish(req, "length")
    # as many 8,192-token requests as fit at once
    reqs = [_request(f"r{i}", 8192, i + 2) for i in range(256)]
    _prefill(sched, reqs)
    fit = sum(1 for r in sched.running if r.num_computed == 8192)
    pool_bytes = pool.num_pages * page * full_bytes + (wins.num_pages * page * win_bytes if wins else 0)
    return {"bytes_per_token_32k": held / 32768, "fit_8k": fit, "pool_gib": pool_bytes / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--pool-tokens", type=int, default=262144, help="the budget: this many full-length tokens")
    ap.add_argument("--chunked-prefill-size", type=int, default=2048)
    ap.add_argument("--config", action="append", default=[], metavar="NAME=PATH", help="a shape from a config.json")
    args = ap.parse_args()
    for spec in args.config:
        name, path = spec.split("=", 1)
        SHAPES[name] = json.loads(Path(path).read_text())
        args.shapes.append(name)
    print("| shape | K/V | bytes/token at 32K | % of full | 8,192-token requests that fit | pool GiB |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.shapes:
        full = measure(SHAPES[name], True, args.pool_tokens, args.chunked_prefill_size)
        swa = measure(SHAPES[name], False, args.pool_tokens, args.chunked_prefill_size)
        for label, m in (("--swa-full", full), ("window only", swa)):
            pct = 100 * m["bytes_per_token_32k"] / full["bytes_per_token_32k"]
            print(
                f"| {name} ({SHAPES[name]['num_hidden_layers']} layers) | {label} | {m['bytes_per_token_32k']:,.0f} "
                f"| {pct:.0f} % | {m['fit_8k']} | {m['pool_gib']:.2f} |"
            )


if __name__ == "__main__":
    main()
