"""What prompt-lookup drafting can gain on this machine at most: the verify step's measured cost
and the best any lookup proposer could do on the benchmark's prompts.

    python benchmarks/spec_ceiling.py [--draft-tokens 1 2 3 4 6 8] [--max-tokens 128] [--model-path PATH]
        [--load-format dummy]

On a GPU, ``--model-path`` of a real checkpoint's directory with ``--load-format dummy`` measures
the verify step's cost at its shapes (the oracle drafts the plain output, whatever the weights).

1. Each prompt of ``benchmarks/data/speculative_prompts.json`` is decoded plainly (greedy, one at a
   time), which gives its output and the time of a one-row decode step.
2. The verify cost ``c(K)``: the same prompts again, every step drafting the next ``K`` tokens of
   that output (an oracle, so every draft is kept), timed per step; ``c(K)`` is a (1 + K)-row step's
   time over a one-row step's, both from this run.
3. The ceiling, replayed over the outputs: at every step an oracle lookup picks, among all earlier
   occurrences in the prompt and output of the last ``n >= min_match`` tokens, the one whose
   continuation agrees with the output longest, and drafts exactly the agreeing tokens (at most
   the largest K measured), where that pays (``(kept + 1) / c(kept) > 1``). No real lookup proposer
   knows which occurrence will agree, nor how far: its speed-up is below this bound. The bound with
   ``c(K) = 1`` (a device where a verify row costs nothing extra, a GPU at small batch) is shown too.

``bench_speculative.py`` measures the shipped NGRAM proposer on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import time

from bench_speculative import DATA, _engine, _generate, _speculation, chat_ids


def _oracle_steps(engine, saved: dict, runs: list, k: int, max_tokens: int) -> float:
    """Seconds per decode step when every step drafts the next ``k`` tokens of the known output."""
    spec = saved["spec"]
    now: dict = {}

    def draft(req):
        now["steps"] += 1
        room = min(k, req.params.max_new_tokens - len(req.output_ids) - 1)
        t = len(req.output_ids)
        return list(now["out"][t : t + room]) if room > 0 else []

    spec.draft, spec.record = draft, lambda *a: None
    seconds = steps = 0.0
    try:
        for i, (ids, out) in enumerate(runs):
            now.update(out=out, steps=0)
            tokens, secs = _generate(engine, f"oracle-{k}-{i}", ids, max_tokens)
            assert tokens == out, "greedy output changed under an oracle draft"
            seconds += secs
            steps += now["steps"]  # (decode steps: the prefill's step drafts nothing)
    finally:
        del spec.draft, spec.record  # back to the class's methods
    return seconds / steps


def _plain_steps(engine, runs: list, max_tokens: int) -> float:
    """Seconds per decode step without drafts."""
    seconds = steps = 0.0
    for i, (ids, out) in enumerate(runs):
        tokens, secs = _generate(engine, f"plain-again-{i}", ids, max_tokens)
        seconds, steps = seconds + secs, steps + len(tokens) - 1
    return seconds / steps


def _best_run(ids: list[int], out: list[int], t: int, min_match: int, max_match: int = 8) -> int:
    """The most tokens of ``out[t:]`` that any earlier occurrence of a suffix of ``ids`` continues with."""
    n, best = len(ids), 0
    for size in range(min_match, min(max_match, n - 1) + 1):
        suffix = ids[n - size :]
        for end in range(size, n):
            if ids[end - size : end] == suffix:
                a = 0
                while end + a < n and t + a < len(out) and ids[end + a] == out[t + a]:
                    a += 1
                best = max(best, a)
    return best


def ceiling(runs: list, cost: dict, min_match: int) -> float:
    """Decode speed-up of the oracle lookup over plain decoding (see the module docstring)."""
    tokens = seconds = 0.0
    kmax = max(cost)
    for ids, out in runs:
        t = 1
        while t < len(out):
            a = min(_best_run(ids + out[:t], out, t, min_match), kmax, len(out) - t - 1)
            keep = a > 0 and (a + 1) / cost[a] > 1
            tokens += a + 1 if keep else 1
            seconds += cost[a] if keep else 1
            t += a + 1 if keep else 1
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--load-format", default="auto", help="dummy: the verify cost at a checkpoint's shapes")
    args = ap.parse_args()
    kmax = max(args.draft_tokens)
    engine = _engine(
        args.model_path, args.load_format, speculative_algorithm="NGRAM", speculative_num_draft_tokens=kmax
    )
    saved: dict = {}
    try:
        sets = {
            name: [chat_ids(engine.tokenizer, it["prompt"]) for it in items]
            for name, items in json.loads(DATA.read_text()).items()
        }
        _speculation(engine, False, saved)
        runs = {
            name: [(ids, _generate(engine, f"plain-{name}-{i}", ids, args.max_tokens)[0]) for i, ids in enumerate(ps)]
            for name, ps in sets.items()
        }
        every = [r for rs in runs.values() for r in rs if len(r[1]) > kmax + 1]
        cost = {0: 1.0}
        print(f"\nverify step cost, {len(every)} prompts, greedy, every draft kept (oracle)")
        print("| draft tokens K | ms a plain step | ms a verify step | c(K) |")
        print("|---:|---:|---:|---:|")
        started = time.perf_counter()
        for k in sorted(args.draft_tokens):  # each against a plain pass just before it (drift hits both)
            _speculation(engine, False, saved)
            one_row = _plain_steps(engine, every, args.max_tokens)
            _speculation(engine, True, saved)
            per_step = _oracle_steps(engine, saved, every, k, args.max_tokens)
            cost[k] = per_step / one_row
            print(f"| {k} | {one_row * 1e3:.2f} | {per_step * 1e3:.2f} | {cost[k]:.2f} |", flush=True)
        for k in range(1, kmax + 1):  # sizes not measured: the next measured one's cost (an upper value)
            if k not in cost:
                cost[k] = cost[min(m for m in cost if m > k)]
        print(f"({time.perf_counter() - started:.0f} s)\n")
    finally:
        engine.shutdown()
    free = dict.fromkeys(cost, 1.0)
    print("| prompts | min match | oracle lookup, measured c(K) | oracle lookup, c(K) = 1 |")
    print("|---|---:|---:|---:|")
    for name, rs in runs.items():
        for m in (1, 2):
            print(f"| {name} | {m} | {ceiling(rs, cost, m):.2f}x | {ceiling(rs, free, m):.2f}x |")


if __name__ == "__main__":
    main()
