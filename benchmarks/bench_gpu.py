"""llmkit against transformers on a GPU, on real model shapes with random weights (no downloads).

    python benchmarks/bench_gpu.py --preset qwen2.5-0.5b --scenario single
    python benchmarks/bench_gpu.py --preset llama-3.1-8b --attention triton --markdown --json out.json
    python benchmarks/bench_gpu.py --preset tiny --device cpu --attention torch   # CPU smoke run

The model directory (a real model's config.json, and a WordLevel tokenizer with exactly vocab_size
tokens so that every sampled id decodes) is written to a temporary directory. llmkit runs in
process with ``load_format="dummy"``; transformers builds the same config with its random init.
Both decode greedily, never stop early (ignore_eos / min_new_tokens) and see the same prompts.

(1) single: one request; decode tokens/s = (tokens - 1) / (last token time - first token time),
    so time to first token is excluded.
(2) concurrent: N requests of M output tokens submitted at once; output tokens/s = N*M / wall
    time, and decode tokens/s = tokens produced after every request has its first token / that
    window's length (transformers: N*(M-1) / first to last batched step).
Each configuration gets one shorter warm-up run first (other prompts: no prefix-cache hits).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import shlex
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
from gpu_presets import PRESETS, make_prompts, write_model_dir
from transformers_baseline import bench_transformers, free_memory, log, sync

from llmkit.core.engine.config import EngineConfig

ATTENTIONS = ("triton", "flashinfer", "torch")


# -- llmkit -----------------------------------------------------------------------------------
def llmkit_round(engine, prompts: list[list[int]], new_tokens: int, tag: str) -> dict:
    """Submit every prompt at once; return per-request (time, tokens) arrivals and the start time."""
    from llmkit.core.engine.messages import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    arrivals: list[list[tuple[float, int]]] = [[] for _ in prompts]
    errors: list[str] = []
    done = threading.Semaphore(0)

    def sink_for(i):
        def sink(out):  # called on the engine thread, once the step's tokens are on the host
            now = time.perf_counter()
            if out.token_ids:
                arrivals[i].append((now, len(out.token_ids)))
            if out.finished:
                if out.error or out.finish_reason == "abort":
                    errors.append(out.error or "aborted")
                done.release()

        return sink

    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.submit(GenerateRequest(f"{tag}-{i}", ids, params), sink_for(i))
    for _ in prompts:
        if not done.acquire(timeout=3600):
            raise TimeoutError("llmkit did not finish within an hour")
    if errors:
        raise RuntimeError(f"llmkit requests failed: {errors[:3]}")
    counts = [sum(n for _, n in a) for a in arrivals]
    if counts != [new_tokens] * len(prompts):
        raise RuntimeError(f"expected {new_tokens} tokens per request, got {sorted(set(counts))}")
    return {"t0": t0, "arrivals": arrivals}


def llmkit_metrics(r: dict) -> dict:
    arrivals, t0 = r["arrivals"], r["t0"]
    firsts = [a[0][0] for a in arrivals]
    end = max(a[-1][0] for a in arrivals)
    total = sum(n for a in arrivals for _, n in a)
    all_started = max(firsts)  # from here on every request is decoding
    decoded = sum(n for a in arrivals for t, n in a if t > all_started)
    return {
        "requests": len(arrivals),
        "output_tokens": total,
        "wall_s": end - t0,
        "output_tok_s": total / (end - t0),
        "decode_tok_s": decoded / (end - all_started) if end > all_started else float("nan"),
        "ttft_mean_s": sum(f - t0 for f in firsts) / len(firsts),
        "ttft_max_s": all_started - t0,
    }


def bench_llmkit(args, model_dir: Path, attention: str, device: torch.device) -> dict:
    from llmkit.core.engine.builder import build_engine_parts
    from llmkit.core.engine.loop import Engine

    n, p, m = args.num_requests, args.prompt_len, args.output_len
    max_running = args.max_running_requests or n
    warm_m = min(m, 32)
    extra = {} if args.cuda_graph_max_bs is None else {"cuda_graph_max_bs": args.cuda_graph_max_bs}
    cfg = EngineConfig(
        grammar_backend="none",
        model_path=str(model_dir),
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        attention=attention,
        max_running_requests=max_running,
        # the warm-up's and the measured round's KV both fit: no preemption, no cache eviction
        max_total_tokens=n * (2 * p + m + warm_m + 16) + 1024,
        disable_cuda_graph=args.disable_cuda_graph,
        overlap_schedule=False if args.disable_overlap_schedule else None,
        **extra,
    )
    t_build = time.perf_counter()
    parts = build_engine_parts(cfg)
    engine = Engine(cfg, parts)
    graphs = parts.runner.graphs
    info = {
        "engine": "llmkit",
        "attention": attention,
        "build_s": round(time.perf_counter() - t_build, 2),
        "cuda_graph": graphs is not None,
        "cuda_graph_max_bs": graphs.max_bs if graphs is not None else None,
        "overlap_schedule": engine.overlap,
        "max_running_requests": max_running,
    }
    del parts, graphs
    engine.start()
    vocab = engine.vocab_size
    try:
        if "single" in args.scenario:
            llmkit_round(engine, make_prompts(1, p, vocab, 101), warm_m, "warm-single")
            sync(device)
            info["single"] = llmkit_metrics(llmkit_round(engine, make_prompts(1, p, vocab, 1), m, "single"))
            log(f"  llmkit[{attention}] single: {info['single']['decode_tok_s']:.1f} decode tok/s")
        if "concurrent" in args.scenario:
            llmkit_round(engine, make_prompts(n, p, vocab, 102), warm_m, "warm-conc")
            sync(device)
            info["concurrent"] = llmkit_metrics(llmkit_round(engine, make_prompts(n, p, vocab, 2), m, "conc"))
            c = info["concurrent"]
            log(
                f"  llmkit[{attention}] concurrent {n}x{m}: {c['output_tok_s']:.1f} output tok/s, "
                f"{c['decode_tok_s']:.1f} decode tok/s"
            )
    finally:
        engine.shutdown()
        del engine
        free_memory(device)
    return info


# -- report -----------------------------------------------------------------------------------
def environment(device: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "command": command_line()}
    # Package metadata, not imports: importing triton here would defeat the attention plugin's
    # LLMKIT_TRITON_INTERPRET switch, which must act before triton is first imported.
    for key, dists in (
        ("triton", ("triton",)),
        ("flashinfer", ("flashinfer-python", "flashinfer")),
        ("transformers", ("transformers",)),
    ):
        env[key] = next((v for v in map(_dist_version, dists) if v), None)
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = platform.processor() or platform.machine()
    return env


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def ratios(results: list[dict]) -> list[dict]:
    hf = next((r for r in results if r["engine"] == "transformers"), None)
    if hf is None:
        return []
    out = []
    for r in results:
        if r["engine"] != "llmkit":
            continue
        row = {"attention": r["attention"]}
        for scen, keys in (("single", ("decode_tok_s",)), ("concurrent", ("output_tok_s", "decode_tok_s"))):
            if scen in r and scen in hf:
                for k in keys:
                    row[f"{scen}_{k}"] = r[scen][k] / hf[scen][k]
        out.append(row)
    return out


def markdown(report: dict) -> str:
    def cell(r, scen, key):
        v = r.get(scen, {}).get(key)
        return "" if v is None else f"{v:,.1f}"

    lines = [
        "| engine | attention | CUDA graphs | single decode tok/s | concurrent output tok/s "
        "| concurrent decode tok/s |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in report["results"]:
        graphs = ("yes (bs<=%s)" % r["cuda_graph_max_bs"]) if r.get("cuda_graph") else "no"
        lines.append(
            f"| {r['engine']} | {r['attention']} | {graphs if r['engine'] == 'llmkit' else '-'} "
            f"| {cell(r, 'single', 'decode_tok_s')} | {cell(r, 'concurrent', 'output_tok_s')} "
            f"| {cell(r, 'concurrent', 'decode_tok_s')} |"
        )
    for q in report["ratios"]:
        parts = [f"{k.replace('_tok_s', '')}: {v:.2f}x" for k, v in q.items() if k != "attention"]
        lines.append(f"\nllmkit[{q['attention']}] / transformers: " + ", ".join(parts))
    for s in report["skipped"]:
        lines.append(f"\nskipped attention {s['attention']}: {s['reason']}")
    for x in report["failed"]:
        lines.append(f"\nFAILED attention {x['attention']}: {x['error']}")
    for r in report["results"]:
        if "concurrent_error" in r:
            lines.append(f"\n{r['engine']} concurrent: {r['concurrent_error']}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-0.5b")
    ap.add_argument(
        "--attention",
        nargs="+",
        choices=ATTENTIONS,
        help="backends to measure (default: every one available on the device)",
    )
    ap.add_argument("--scenario", nargs="+", choices=("single", "concurrent"), default=["single", "concurrent"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--cuda-graph-max-bs", type=int, help="default: the engine's (EngineConfig.cuda_graph_max_bs)")
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=500)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-running-requests", type=int, help="default: --num-requests")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--hf-batch", type=int, help="transformers batch cap (default: all --num-requests at once)")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args(argv)
    if args.output_len < 2 or args.prompt_len < 1 or args.num_requests < 1:
        ap.error("--output-len must be >= 2, --prompt-len and --num-requests >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import logging

    # the decode blocks' measured choice between the fused GEMVs and cuBLAS (core/model/gemv_choice.py)
    choice = logging.getLogger("llmkit.core.model.gemv_choice")
    choice.setLevel(logging.INFO)
    choice.addHandler(logging.StreamHandler(sys.stdout))
    from llmkit.core.engine.builder import resolve_device, resolve_dtype, select_attention
    from llmkit.core.plugins import PluginError

    device = resolve_device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: pass --device cpu (with --preset tiny --attention torch) for a smoke run")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = resolve_dtype(args.dtype, device)
    env = environment(device)
    log(
        f"device: {env['device']} | torch {env['torch']} | triton {env['triton']} | "
        f"flashinfer {env['flashinfer']} | transformers {env['transformers']}"
    )
    log(f"command: {env['command']}")
    log(
        f"preset {args.preset}, {args.dtype}, prompts of {args.prompt_len} tokens, {args.output_len} output "
        f"tokens, concurrent requests: {args.num_requests}"
    )

    report = {"env": env, "preset": args.preset, "args": vars(args), "results": [], "skipped": [], "failed": []}
    with tempfile.TemporaryDirectory(prefix=f"bench-gpu-{args.preset}-") as tmp:
        model_dir = Path(tmp)
        write_model_dir(args.preset, model_dir)
        for name in args.attention or ATTENTIONS:
            try:
                select_attention(name, device)
            except PluginError as exc:
                log(f"skipping attention {name}: {exc}")
                report["skipped"].append({"attention": name, "reason": str(exc)})
                continue
            log(f"llmkit, attention {name}:")
            try:
                report["results"].append(bench_llmkit(args, model_dir, name, device))
            except Exception as exc:  # one failing backend must not lose the others' numbers
                traceback.print_exc()
                report["failed"].append({"attention": name, "error": f"{type(exc).__name__}: {exc}"})
                free_memory(device)
        if not args.no_transformers:
            log("transformers:")
            report["results"].append(bench_transformers(args, model_dir, device, dtype))
    report["ratios"] = ratios(report["results"])
    for q in report["ratios"]:
        log(
            f"llmkit[{q['attention']}] / transformers: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in q.items() if k != "attention")
        )
    if args.markdown:
        log("\n" + markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if report["failed"]:
        sys.exit(f"failed: {', '.join(f['attention'] for f in report['failed'])}")
    return report


if __name__ == "__main__":
    main()
