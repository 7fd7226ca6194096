"""Speculative decoding against plain decoding, single stream, greedy, measured in one run.

    python benchmarks/bench_speculative.py [--algorithm NGRAM] [--draft-tokens 4] [--max-tokens 128]
        [--rounds 2] [--model-path PATH] [--json FILE]

Two in-process engines on the same model, one with ``--speculative-algorithm`` and one without,
take the prompts of ``benchmarks/data/speculative_prompts.json`` one at a time, alternating
(plain, speculative) per prompt so that drift on a shared machine hits both alike. Decode tok/s is
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


def _engine(model_path, **spec):
    from llmkit.core.engine.builder import build_engine_parts
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.engine.loop import Engine

    cfg = EngineConfig(model_path=model_path, grammar_backend="none", **spec)
    engine = Engine(cfg, build_engine_parts(cfg))
    engine.start()
    return engine


def _generate(engine, rid: str, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens and the decode time (first token to the last)."""
    from llmkit.core.engine.messages import GenerateRequest, SamplingParams

    done, tokens, stamps = threading.Event(), [], []

    def sink(out):
        if out.token_ids:
            stamps.append((time.perf_counter(), len(out.token_ids)))
            tokens.extend(out.token_ids)
        if out.finished:
            done.set()

    engine.submit(GenerateRequest(rid, ids, SamplingParams(max_new_tokens=max_tokens, temperature=0)), sink)
    assert done.wait(600), rid
    return tokens, stamps[-1][0] - stamps[0][0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--algorithm", default="NGRAM")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    prompts = json.loads(DATA.read_text())
    plain = _engine(args.model_path)
    spec = _engine(
        args.model_path, speculative_algorithm=args.algorithm, speculative_num_draft_tokens=args.draft_tokens
    )
    tok = plain.tokenizer
    results = {}
    try:
        for name, items in prompts.items():
            totals = {"plain": [0, 0.0], "spec": [0, 0.0]}
            differ = 0
            for r in range(args.rounds):
                for i, item in enumerate(items):
                    text = tok.apply_chat_template(
                        [{"role": "user", "content": item["prompt"]}], add_generation_prompt=True, tokenize=False
                    )
                    ids = tok(text, add_special_tokens=False)["input_ids"]
                    outs = {}
                    for label, engine in (("plain", plain), ("spec", spec)):
                        tokens, seconds = _generate(engine, f"{name}-{r}-{i}-{label}", ids, args.max_tokens)
                        totals[label][0] += len(tokens) - 1
                        totals[label][1] += seconds
                        outs[label] = tokens
                    differ += outs["plain"] != outs["spec"]
            rate = {k: n / s for k, (n, s) in totals.items()}
            results[name] = {"plain_tok_s": rate["plain"], "spec_tok_s": rate["spec"], "differ": differ}
        stats = spec.speculator.stats
    finally:
        plain.shutdown()
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
