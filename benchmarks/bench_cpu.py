"""llmkit against transformers on the embedded model, measured interleaved in one run.

    python benchmarks/bench_cpu.py [--rounds 3] [--update-readme] [-- extra llmkit serve flags]
    python benchmarks/bench_cpu.py --metrics-overhead | --engine-process-overhead | --dp-compare [--rounds 3]
    python benchmarks/bench_cpu.py --update-readme -- --quantization int8
    python benchmarks/bench_cpu.py --metrics-overhead [--rounds 3]
    python benchmarks/bench_cpu.py --native-compare [--rounds 3]

(a) single-stream greedy decode: 128 tokens, tokens/s end to end (HTTP streaming for llmkit);
(b) 16 concurrent chat requests of 128 tokens through HTTP against transformers' batched
    ``generate`` of the same 16 prompts (left-padded), total generated tokens / wall time;
(c) time to first token for a 512-token prompt.
transformers runs in fp32 with sdpa attention on the same weights; both use every core.

``--metrics-overhead`` instead compares llmkit with /metrics on (the default) against
``--disable-metrics``: two servers, (a) and (b) measured interleaved on each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

TOPICS = [
    "the ocean",
    "volcanoes",
    "bread",
    "chess",
    "the moon",
    "bicycles",
    "coffee",
    "rainforests",
    "jazz",
    "glaciers",
    "honeybees",
    "lighthouses",
    "origami",
    "deserts",
    "comets",
    "libraries",
]
PROMPTS = [f"Write a short essay about {t}." for t in TOPICS]
NEW_TOKENS = 128


def llmkit_single(client) -> float:
    t0 = time.perf_counter()
    n = 0
    for chunk in client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        if chunk.usage:
            n = chunk.usage.completion_tokens
    return n / (time.perf_counter() - t0)


def llmkit_concurrent(base_url: str, copies: int = 1) -> float:
    import openai

    async def run():
        # closed inside the loop: a client left to the garbage collector closes after it
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=600) as client:

            async def one(p):
                r = await client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": p}],
                    max_tokens=NEW_TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                return r.usage.completion_tokens

            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(p) for p in PROMPTS * copies))
            return sum(counts) / (time.perf_counter() - t0)

    return asyncio.run(run())


def long_prompt(tok) -> list[int]:
    words = " ".join(f"{TOPICS[i % 16]} number {i}" for i in range(400))
    ids = tok(words, add_special_tokens=False)["input_ids"][:512]
    assert len(ids) == 512
    return ids


def llmkit_ttft(client, ids: list[int], salt: int) -> float:
    ids = [ids[0] + salt % 7] + ids[1:]  # a different first token each time: no prefix-cache hit
    t0 = time.perf_counter()
    for chunk in client.completions.create(model="m", prompt=ids, max_tokens=1, stream=True, temperature=0):
        if chunk.choices:
            return time.perf_counter() - t0
    return time.perf_counter() - t0


class HF:
    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()

    def _chat_ids(self, texts):
        rendered = [
            self.tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
            for t in texts
        ]
        return self.tok(rendered, return_tensors="pt", padding=True, add_special_tokens=False)

    def generate(self, enc, n):
        with self.torch.inference_mode():
            return self.model.generate(
                **enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=self.tok.pad_token_id or 2
            )

    def single(self) -> float:
        enc = self._chat_ids(PROMPTS[:1])
        t0 = time.perf_counter()
        out = self.generate(enc, NEW_TOKENS)
        return (out.shape[1] - enc["input_ids"].shape[1]) / (time.perf_counter() - t0)

    def batched(self) -> float:
        enc = self._chat_ids(PROMPTS)
        t0 = time.perf_counter()
        out = self.generate(enc, NEW_TOKENS)
        return len(PROMPTS) * (out.shape[1] - enc["input_ids"].shape[1]) / (time.perf_counter() - t0)

    def ttft(self, ids) -> float:
        enc = {
            "input_ids": self.torch.tensor([ids]),
            "attention_mask": self.torch.ones(1, len(ids), dtype=self.torch.long),
        }
        t0 = time.perf_counter()
        self.generate(enc, 1)
        return time.perf_counter() - t0


def metrics_cost_per_output(n: int = 200_000) -> float:
    """Microseconds the server spends on metrics per RequestOutput (one token while decoding)."""
    from llmkit.core.engine.messages import GenerateRequest, RequestOutput, SamplingParams
    from llmkit.core.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    tracker = metrics.track(GenerateRequest(rid="r", prompt_ids=[1, 2, 3], params=SamplingParams()))
    out = RequestOutput(rid="r", text="x", token_ids=[7], completion_tokens=1)
    t0 = time.perf_counter()
    for _ in range(n):
        tracker.on_output(out)
    return (time.perf_counter() - t0) / n * 1e6


def compare_servers(
    rounds: int, serve_args: list[str], variants: dict[str, list[str]], copies: int = 1
) -> dict[str, float]:
    """(a) and (b) on one server per variant (extra serve flags), interleaved; medians of ``rounds``.
    ``copies``: (b) sends each of its 16 prompts this many times at once."""
    import openai

    from server_utils import start_server, stop_server

    servers = {}
    try:
        for name, extra in variants.items():
            servers[name] = start_server(["--batch-storage", "none", *serve_args, *extra])
        res = {f"{k}_{n}": [] for k in ("single", "concurrent") for n in servers}
        for r in range(rounds + 1):  # round 0 warms every server up
            for name, (_, url) in servers.items():
                client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
                single, concurrent = llmkit_single(client), llmkit_concurrent(url, copies)
                if r:
                    res[f"single_{name}"].append(single)
                    res[f"concurrent_{name}"].append(concurrent)
            if r:
                print(f"round {r}: " + ", ".join(f"{k}={v[-1]:.1f}" for k, v in res.items()), flush=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    return {k: statistics.median(v) for k, v in res.items()}


def print_comparison(
    med: dict[str, float], a: str, b: str, heads: tuple[str, str], rounds: int, copies: int = 1
) -> None:
    print(f"| metric | {heads[0]} | {heads[1]} | ratio |\n|---|---:|---:|---:|")
    for k, title in (
        ("single", "(a) single-stream greedy, 128 tokens (tok/s)"),
        ("concurrent", f"(b) {len(PROMPTS) * copies} concurrent chat requests x 128 tokens (total tok/s)"),
    ):
        print(f"| {title} | {med[f'{k}_{a}']:.1f} | {med[f'{k}_{b}']:.1f} | {med[f'{k}_{a}'] / med[f'{k}_{b}']:.3f} |")
    print(f"{rounds} rounds, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")


def metrics_overhead(rounds: int, serve_args: list[str]) -> None:
    """(a) and (b) with Prometheus metrics on and off."""
    per_output = metrics_cost_per_output()
    med = compare_servers(rounds, serve_args, {"on": [], "off": ["--disable-metrics"]})
    print_comparison(med, "on", "off", ("metrics on", "--disable-metrics"), rounds)
    print(
        f"\nMetrics cost per output token, in-process: {per_output:.2f} µs "
        f"(at (a)'s {med['single_on']:.0f} tok/s: {per_output * med['single_on'] / 1e4:.4f} % of a core)"
    )


def engine_process_overhead(rounds: int, serve_args: list[str]) -> None:
    """(a) and (b) with the engine in its own process against the engine on a server thread."""
    med = compare_servers(rounds, serve_args, {"process": ["--engine-process"], "thread": []})
    print_comparison(med, "process", "thread", ("--engine-process", "engine thread"), rounds)


def dp_compare(rounds: int, serve_args: list[str]) -> None:
    """(a) and 32 concurrent requests: two data-parallel replicas (one thread each) against one
    engine with every thread."""
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    med = compare_servers(rounds, serve_args, {"dp2": ["--dp-size", "2", "--num-threads", threads], "dp1": []}, 2)
    print_comparison(med, "dp2", "dp1", (f"--dp-size 2 ({threads} thread each)", "one engine, all threads"), rounds, 2)


def native_compare(rounds: int, serve_args: list[str]) -> None:
    """(a) and (b) at the GGUF's native precision (the default) against ``--quantization none`` (fp32)."""
    med = compare_servers(
        rounds, serve_args, {"native": ["--quantization", "gguf"], "fp32": ["--quantization", "none"]}
    )
    print_comparison(med, "native", "fp32", ("native GGUF (int4/int8)", "--quantization none (fp32)"), rounds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--update-readme", action="store_true")
    ap.add_argument(
        "--metrics-overhead",
        action="store_true",
        help="compare /metrics on (default) and --disable-metrics instead of transformers",
    )
    ap.add_argument(
        "--engine-process-overhead",
        action="store_true",
        help="compare --engine-process with the in-thread engine instead of transformers",
    )
    ap.add_argument(
        "--dp-compare",
        action="store_true",
        help="compare --dp-size 2 with one engine (32 concurrent requests) instead of transformers",
    )
    ap.add_argument(
        "--native-compare",
        action="store_true",
        help="compare the GGUF's native precision (--quantization gguf) with --quantization none instead of transformers",
    )
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args()
    if args.native_compare:
        return native_compare(args.rounds, args.serve_args)
    if args.metrics_overhead:
        return metrics_overhead(args.rounds, args.serve_args)
    if args.engine_process_overhead:
        return engine_process_overhead(args.rounds, args.serve_args)
    if args.dp_compare:
        return dp_compare(args.rounds, args.serve_args)

    import openai

    from llmkit.core.model.loader.source import resolve_model_dir

    from server_utils import start_server, stop_server

    model_dir = str(resolve_model_dir(None))
    proc, url = start_server(["--batch-storage", "none", *args.serve_args])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        hf = HF(model_dir)
        ids = long_prompt(hf.tok)
        llmkit_single(client)  # warm-up both
        hf.generate(hf._chat_ids(PROMPTS[:1]), 4)
        res = {k: [] for k in ("ls", "hs", "lb", "hb", "lt", "ht")}
        for r in range(args.rounds):
            res["ls"].append(llmkit_single(client))
            res["hs"].append(hf.single())
            res["lb"].append(llmkit_concurrent(url))
            res["hb"].append(hf.batched())
            res["lt"].append(llmkit_ttft(client, ids, r))
            res["ht"].append(hf.ttft(ids))
            print(f"round {r + 1}: " + ", ".join(f"{k}={v[-1]:.3f}" for k, v in res.items()), flush=True)
    finally:
        stop_server(proc)
    med = {k: statistics.median(v) for k, v in res.items()}
    table = "\n".join(
        [
            "| metric | llmkit | transformers | ratio | target |",
            "|---|---:|---:|---:|---|",
            f"| (a) single-stream greedy, 128 tokens (tok/s) | {med['ls']:.1f} | {med['hs']:.1f} | "
            f"{med['ls'] / med['hs']:.2f}x | ≥ 1.5x |",
            f"| (b) 16 concurrent chat requests x 128 tokens (total tok/s) | {med['lb']:.1f} | {med['hb']:.1f} | "
            f"{med['lb'] / med['hb']:.2f}x | ≥ 1.5x |",
            f"| (c) time to first token, 512-token prompt (s) | {med['lt']:.3f} | {med['ht']:.3f} | "
            f"{med['lt'] / med['ht']:.2f}x | ≤ 1.1x |",
        ]
    )
    cmd = "python benchmarks/bench_cpu.py " + " ".join(a for a in sys.argv[1:] if a != "--update-readme")
    report = (
        f"{table}\n\nCommand: `{cmd.strip()}`; {args.rounds} rounds, "
        f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}. (b) is llmkit over HTTP against "
        "transformers' static batch in-process."
    )
    print(report)
    if args.update_readme:
        readme = ROOT / "README.md"
        text = readme.read_text()
        label = " ".join(args.serve_args) or "default"
        start, end = f"<!-- bench_cpu[{label}]:start -->", f"<!-- bench_cpu[{label}]:end -->"
        title = "Default configuration (the GGUF at native precision):" if label == "default" else f"With `{label}`:"
        block = f"{start}\n{title}\n\n{report}\n{end}"
        if start in text:
            text = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
        elif "BENCHMARK-TABLE" in text:
            text = text.replace("BENCHMARK-TABLE", block + "\n\nBENCHMARK-TABLE")
        else:
            text = text.rstrip() + "\n\n" + block + "\n"
        readme.write_text(text)


if __name__ == "__main__":
    main()
