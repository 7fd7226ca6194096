"""Multi-LoRA serving against the base model alone, on CPU with the embedded SmolLM2-135M.

    python benchmarks/bench_lora.py [--adapters 4] [--rank 16] [--concurrent 16] [--tokens 128] [--rounds 2]
        [--pairs 8] [--engine-pairs 0] [--model-path DIR --load-format dummy]

Random rank-``--rank`` PEFT adapters on all seven projections are written for the embedded model.
Two servers, one at a time: the base model with no LoRA flags, and the same model with the
adapters loaded at start (``--lora-paths``). Each round measures, on each server:

- concurrent: ``--concurrent`` completions at once, each ``--tokens`` tokens (``ignore_eos``); on
  the LoRA server they are spread over the adapters (request i uses adapter i mod N), so every
  forward mixes all of them; output tokens a second over the whole run
- single: one completion of ``--tokens`` tokens; on the LoRA server with one adapter

The median of the rounds is reported, with the ratio LoRA / base (issue 30's targets: ≥ 0.75x
concurrent, ≥ 0.85x single).

Single-stream rates on the 2-core machine drift by a quarter between rounds minutes apart, which
swamps the adapter's cost in the server-against-server ratio. So the LoRA server is then also
measured against itself (``--pairs``, 0 to skip): single requests alternating between the base
model (no adapter rows: the forward runs as without LoRA) and an adapter, back to back, each
pair's ratio taken while the machine is in one state; the median of the pairs is reported.

``--engine-pairs N`` does the same in this process, on the engine without the server (no HTTP,
no event loop sharing the two cores), for both runs: N pairs in ABBA order of a single 64-token
request (base, then an adapter) and of ``--concurrent`` 64-token requests (all base, then spread
over the adapters), each pair's ratio, the median and quartiles reported. It is the steadiest of
the measures here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def write_adapters(out: Path, n: int, rank: int, model_path: str | None = None) -> list[str]:
    """``n`` random adapters for the model at ``model_path`` (a Hugging Face directory; None: the
    embedded model), saved as PEFT saves them; returns their paths."""
    import torch
    from safetensors.torch import save_file

    from llmkit.core.model.loader.source import resolve_model_dir

    model_dir = Path(model_path) if model_path else resolve_model_dir(None, weights=False)
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * head_dim
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    shapes = {  # (in, out) of each projection
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    paths = []
    for a in range(n):
        g = torch.Generator().manual_seed(a)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for module, (d_in, d_out) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.02
        path = out / f"a{a}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(
            json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)})
        )
        paths.append(str(path))
    return paths


async def _rate(url: str, models: list[str], tokens: int) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)

    async def one(model: str) -> int:
        r = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True}
        )
        return r.usage.completion_tokens

    start = time.perf_counter()
    done = await asyncio.gather(*(one(m) for m in models))
    wall = time.perf_counter() - start
    await client.close()
    return sum(done) / wall


def measure(url: str, models: list[str], args) -> dict:
    asyncio.run(_rate(url, models[:2], 4))  # warm-up
    concurrent = [models[i % len(models)] for i in range(args.concurrent)]
    return {
        "concurrent": asyncio.run(_rate(url, concurrent, args.tokens)),
        "single": asyncio.run(_rate(url, models[:1], args.tokens)),
    }


def engine_pairs(adapter_paths: list[str], n: int, concurrent: int, model: dict, tokens: int = 64) -> None:
    """Base and adapter requests alternating on one in-process engine (see the docstring)."""
    import threading

    from llmkit.core.engine.builder import build_engine_parts
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.engine.loop import Engine
    from llmkit.core.engine.messages import GenerateRequest, SamplingParams

    names = [f"a{i}" for i in range(len(adapter_paths))]
    cfg = EngineConfig(
        lora_paths=tuple(f"{n}={p}" for n, p in zip(names, adapter_paths)),
        grammar_backend="none",
        max_running_requests=max(16, concurrent),
        **model,
    )
    engine, _ = Engine.build_and_start(cfg, lambda: build_engine_parts(cfg))

    def rate(tag: str, loras: list) -> float:  # output tokens a second
        done, stamps = threading.Semaphore(0), []

        def sink(out):
            stamps.extend([time.perf_counter()] * len(out.token_ids))
            if out.finished:
                done.release()

        params = SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens, temperature=0)
        start = time.perf_counter()
        for i, lora in enumerate(loras):
            engine.submit(GenerateRequest(f"{tag}-{i}", list(range(100 + i, 140 + i)), params, lora=lora), sink)
        for _ in loras:
            if not done.acquire(timeout=600):
                raise RuntimeError(f"requests {tag} did not finish")
        if len(loras) == 1:  # one stream: its decode rate (from its first token)
            return (len(stamps) - 1) / (stamps[-1] - stamps[0])
        return len(stamps) / (max(stamps) - start)

    runs = {
        "single stream, one adapter": ([None], [names[0]]),
        f"{concurrent} concurrent, over {len(names)} adapters": (
            [None] * concurrent,
            [names[i % len(names)] for i in range(concurrent)],
        ),
    }
    try:
        print(f"\nin-process, base and adapter requests alternating (ABBA), {n} pairs of {tokens} tokens a request:")
        for label, (base_loras, lora_loras) in runs.items():
            rate("warm-base", base_loras)
            rate("warm-lora", lora_loras)
            pairs = []
            for i in range(n):
                order = ("base", "lora") if i % 2 == 0 else ("lora", "base")
                r = {k: rate(f"p{i}-{k}", base_loras if k == "base" else lora_loras) for k in order}
                pairs.append((r["base"], r["lora"]))
            ratios = [lo / b for b, lo in pairs]
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            base, lora = (statistics.median(x) for x in zip(*pairs))
            print(f"{label}: base {base:.1f} tok/s, adapters {lora:.1f} tok/s, "
                  f"median ratio {statistics.median(ratios):.2f}x (quartiles {q1:.2f}-{q3:.2f})")  # fmt: skip
    finally:
        engine.shutdown()


def _served_name(model_path: str | None) -> str:
    """The name the server gives the base model (its path as given, or the embedded model's)."""
    return model_path or "SmolLM2-135M-Instruct"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrent", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--pairs", type=int, default=8, help="alternating base/adapter single streams on one server")
    p.add_argument("--engine-pairs", type=int, default=0, help="the same in-process, on the engine alone")
    p.add_argument("--model-path", help="a Hugging Face model directory (default: the embedded model)")
    p.add_argument("--load-format", default="auto", help="dummy: random weights at the model's shapes (a GPU run)")
    args = p.parse_args()

    from server_utils import start_server, stop_server

    paths = write_adapters(Path(tempfile.mkdtemp(prefix="bench-lora-")), args.adapters, args.rank, args.model_path)
    names = [f"a{i}" for i in range(args.adapters)]
    common = ["--batch-storage", "none", "--disable-web-ui", "--max-running-requests", str(max(16, args.concurrent))]
    model = {"model_path": args.model_path, "load_format": args.load_format} if args.model_path else {}
    common += [f for k, v in model.items() for f in ("--" + k.replace("_", "-"), v)]
    setups = {
        "base": (common, [_served_name(args.model_path)]),
        "lora": ([*common, "--lora-paths", *(f"{n}={p}" for n, p in zip(names, paths))], names),
    }
    if args.rounds:  # (0: only the pairs)
        runs: dict[str, list[dict]] = {k: [] for k in setups}
        for _ in range(args.rounds):  # alternate: the machine's drift falls on both alike
            for key, (flags, models) in setups.items():
                proc, url = start_server(flags)
                try:
                    runs[key].append(measure(url, models, args))
                finally:
                    stop_server(proc)
                print(key, json.dumps(runs[key][-1]), flush=True)
        med = {k: {m: statistics.median(r[m] for r in v) for m in ("concurrent", "single")} for k, v in runs.items()}
        print(f"\npython benchmarks/bench_lora.py {' '.join(sys.argv[1:])}")
        print(f"{args.adapters} rank-{args.rank} adapters, {args.tokens} tokens a request, median of {args.rounds}\n")
        print("| run | base model, no adapters (tok/s) | with adapters (tok/s) | ratio |")
        print("|---|---|---|---|")
        for m, label in (("concurrent", f"{args.concurrent} concurrent, over {args.adapters} adapters"),
                         ("single", "single stream, one adapter")):  # fmt: skip
            base, lora = med["base"][m], med["lora"][m]
            print(f"| {label} | {base:.1f} | {lora:.1f} | {lora / base:.2f}x |")
    if args.pairs:
        flags, models = setups["lora"]
        proc, url = start_server(flags)
        try:
            asyncio.run(_rate(url, models[:1], 4))  # warm-up
            pairs = [
                (
                    asyncio.run(_rate(url, setups["base"][1], args.tokens)),
                    asyncio.run(_rate(url, models[:1], args.tokens)),
                )
                for _ in range(args.pairs)
            ]
        finally:
            stop_server(proc)
        ratio = statistics.median(lo / b for b, lo in pairs)
        rates = ", ".join(f"{lo / b:.2f}" for b, lo in pairs)
        base, lora = (statistics.median(x) for x in zip(*pairs))
        print(f"\nsingle stream on the LoRA server, base model and adapter alternating, {args.pairs} pairs:")
        print(f"base {base:.1f} tok/s, adapter {lora:.1f} tok/s, median ratio {ratio:.2f}x ({rates})")
    if args.engine_pairs:
        engine_pairs(paths, args.engine_pairs, args.concurrent, model)


if __name__ == "__main__":
    main()
