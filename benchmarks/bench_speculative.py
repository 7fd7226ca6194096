"""Speculative decoding against plain decoding, single stream, greedy, measured in one run.

    python benchmarks/bench_speculative.py [--algorithm NGRAM] [--draft-tokens 4] [--max-tokens 128]
        [--rounds 2] [--topk K] [--num-steps N] [--model-path PATH]
        [--speculative-draft-model-path PATH] [--load-format dummy] [--json FILE]

One in-process engine with ``--speculative-algorithm``, built and run on its own thread as the
server runs it, takes the prompts of ``benchmarks/data/speculative_prompts.json`` one at a time,
twice each: with its speculator switched off, then on, so that drift on a shared machine hits both
alike. (One engine, not two: each engine thread gets its own OpenMP team, and with two teams in a
process libgomp stops spinning between parallel regions, which slowed every step 2-3x.) Decode tok/s is
tokens after the first over the time from the first token to the last (prefill excluded), summed
over a set: ``copy_heavy`` (edit code, quote and fix a paragraph, fill a JSON from a document)
and ``plain_chat``. Greedy output must be identical; the script counts the prompts where it is not.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "speculative_prompts.json"


def chat_ids(tok, prompt: str) -> list[int]:
    """The prompt as a user turn of the model's chat template (as it is, for a model without one)."""
    text = prompt
    if getattr(tok, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def _engine(model_path, load_format: str = "auto", **spec):
    from llmkit.core.engine.builder import build_engine_parts
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.engine.loop import Engine

    cfg = EngineConfig(model_path=model_path, load_format=load_format, grammar_backend="none", **spec)
    engine, _ = Engine.build_and_start(cfg, lambda: build_engine_parts(cfg))
    return engine


def _speculation(engine, on: bool, saved: dict) -> None:
    """Switch the engine's speculator (and the hidden states a draft head reads) off or back on,
    on the engine thread, between requests."""

    def switch():
        if not on:
            saved.setdefault("spec", engine.scheduler.speculator)
            saved.setdefault("features", engine.runner.features)
        engine.scheduler.speculator = saved["spec"] if on else None
        engine.runner.features = saved["features"] if on else None

    engine.call(switch).result(timeout=60)


def _generate(engine, rid: str, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens and the decode time (first token to the last)."""
    from llmkit.core.engine.messages import GenerateRequest, SamplingParams

    done, tokens, stamps = threading.Event(), [], []

    def sink(out):
        if out.finished and getattr(out, "error", None):
            sink.error = out.error
        if out.token_ids:
            stamps.append((time.perf_counter(), len(out.token_ids)))
            tokens.extend(out.token_ids)
        if out.finished:
            done.set()

    engine.submit(GenerateRequest(rid, ids, SamplingParams(max_new_tokens=max_tokens, temperature=0)), sink)
    assert done.wait(600), rid
    if not stamps:
        raise RuntimeError(f"{rid}: no tokens ({getattr(sink, 'error', None) or 'the request failed'})")
    return tokens, stamps[-1][0] - stamps[0][0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--algorithm", default="NGRAM")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ngram-min-match", type=int, default=None, help="--speculative-ngram-min-match-window-size")
    ap.add_argument("--ngram-max-match", type=int, default=None, help="--speculative-ngram-max-match-window-size")
    ap.add_argument("--topk", type=int, default=None, help="--speculative-eagle-topk (above 1: tree drafts)")
    ap.add_argument("--num-steps", type=int, default=None, help="--speculative-num-steps (a tree's depth)")
    ap.add_argument("--model-path", default=None)
    ap.add_argument(
        "--speculative-draft-model-path", "--draft-model-path", dest="draft_model_path", default=None,
        help="STANDALONE's draft model, or the EAGLE/EAGLE3 head's directory",
    )  # fmt: skip
    ap.add_argument("--load-format", default="auto", help="dummy: random weights at the checkpoint's shapes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    prompts = json.loads(DATA.read_text())
    given = {
        "speculative_ngram_min_match_window_size": args.ngram_min_match,
        "speculative_ngram_max_match_window_size": args.ngram_max_match,
        "speculative_eagle_topk": args.topk,
        "speculative_num_steps": args.num_steps,
        "speculative_draft_model_path": args.draft_model_path,
    }
    window = {k: v for k, v in given.items() if v is not None}  # the engine's defaults for the others
    spec = _engine(
        args.model_path,
        args.load_format,
        speculative_algorithm=args.algorithm,
        speculative_num_draft_tokens=args.draft_tokens,
        **window,
    )
    saved: dict = {}
    tok = spec.tokenizer
    results = {}
    try:
        for name, items in prompts.items():
            totals = {"plain": [0, 0.0], "spec": [0, 0.0]}
            differ = 0
            for r in range(args.rounds):
                for i, item in enumerate(items):
                    ids = chat_ids(tok, item["prompt"])
                    outs = {}
                    for label in ("plain", "spec"):
                        _speculation(spec, label == "spec", saved)
                        tokens, seconds = _generate(spec, f"{name}-{r}-{i}-{label}", ids, args.max_tokens)
                        totals[label][0] += len(tokens) - 1
                        totals[label][1] += seconds
                        outs[label] = tokens
                    differ += outs["plain"] != outs["spec"]
            rate = {k: n / s for k, (n, s) in totals.items()}
            results[name] = {"plain_tok_s": rate["plain"], "spec_tok_s": rate["spec"], "differ": differ}
        stats = spec.speculator.stats
    finally:
        spec.shutdown()

    print(
        f"\n{args.algorithm}, up to {args.draft_tokens} draft tokens, {args.max_tokens} tokens, greedy, single stream"
    )
    print("| prompts | decode tok/s, plain | decode tok/s, speculative | ratio | outputs that differ |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        ratio = r["spec_tok_s"] / r["plain_tok_s"]
        print(f"| {name} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {ratio:.2f}x | {r['differ']} |")
    print(
        f"accept length {stats.accept_length:.2f}, acceptance "
        f"{stats.accepted_tokens / max(1, stats.draft_tokens):.0%} of {stats.draft_tokens} draft tokens"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
