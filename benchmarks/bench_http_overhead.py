"""What serving over HTTP costs beyond the engine: the real server with a forward that does no
work, streamed to ``llmkit bench serve``, against the same engine stepping alone. Runs on CPU.

    python benchmarks/bench_http_overhead.py [--batch 1 16 64] [--tokens 300] [--profile DIR]

A GPU runs the forward while the host works, so a server on a fast GPU is bound by its host
work: the engine's steps (``bench_host_overhead.py`` splits those by phase) and the HTTP side
(each stream's chunks built, encoded and written on the event loop, which shares the GIL with the
engine thread). Here the model's forward is replaced by precomputed logits (as in
``bench_host_overhead.py``; the tokenizer and vocabulary are the embedded SmolLM2's), so both
columns measure host work only:

- engine: output tokens a second of ``Engine.step`` alone, ``batch`` requests decoding (the median
  step of ``bench_host_overhead.py --no-phases``)
- http: output tokens a second that ``llmkit bench serve`` receives from the server
  (``--num-prompts batch``, all sent at once, ``--ignore-eos``), with its median TPOT, and the
  server process's CPU time (all threads: engine and event loop) per output token, which the
  client's share of the two cores does not inflate as it does the rates

``--profile DIR`` records the server with py-spy (``pip install py-spy``) during each HTTP run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fake_forward() -> None:
    """Replace ModelRunner.execute: inputs and metadata are built as for a real forward, the
    logits are precomputed (random, cycled over 8 sets so the text changes every step)."""
    import torch

    from llmkit.core.engine.model_runner import ModelRunner

    sets: dict[int, list] = {}
    calls = [0]

    def execute(self, inp, picks=None):
        self.build_metadata(inp, picks)
        n = len(inp.sample_rows)
        vocab = self.model.vocab_size if hasattr(self.model, "vocab_size") else 49152
        if vocab not in sets:
            gen = torch.Generator().manual_seed(0)
            sets[vocab] = [torch.randn(512, vocab, generator=gen) for _ in range(8)]
        calls[0] += 1
        return sets[vocab][calls[0] % 8][:n], []

    ModelRunner.execute = execute


def _serve(argv: list[str]) -> None:
    _fake_forward()
    from llmkit.cli.main import app

    app(["serve", *argv], standalone_mode=True)


def engine_rate(batch: int, steps: int) -> float:
    """Output tokens a second of the engine alone: ``bench_host_overhead``'s step, timed whole."""
    from bench_host_overhead import measure

    return batch / (measure(batch, steps, phases=False)["total"] / 1e3)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def http_rate(batch: int, tokens: int, profile: Path | None) -> dict:
    import urllib.request

    from server_utils import free_port  # tests/helpers

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="bench-http-", suffix=".log", delete=False)
    args = ["--port", str(port), "--load-format", "dummy", "--max-running-requests", str(max(batch, 4))]
    args += ["--batch-storage", "none", "--disable-web-ui"]
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start: " + Path(log.name).read_text()[-3000:]) from None
                time.sleep(0.3)
        run = [sys.executable, "-m", "llmkit.cli.main", "bench", "serve", "--base-url", url, "--backend"]
        run += ["openai-completions", "--num-prompts", str(batch), "--random-input-len", "4"]
        run += ["--random-output-len", str(tokens), "--ignore-eos", "--no-progress"]
        # one warm-up round, then the measured one
        subprocess.run([*run[:-6], "--num-prompts", "2", "--random-output-len", "8", "--ignore-eos", "--no-progress"],
                       check=True, capture_output=True, timeout=300)  # fmt: skip
        out = Path(tempfile.mkdtemp()) / "r.json"
        spy = None
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
            spy = subprocess.Popen(
                ["py-spy", "record", "-p", str(proc.pid), "-o", str(profile / f"server_b{batch}.txt"), "--format", "raw",
                 "--threads", "--rate", "200", "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        cpu = _cpu_seconds(proc.pid)
        subprocess.run([*run, "--json", str(out)], check=True, capture_output=True, timeout=900)
        cpu = _cpu_seconds(proc.pid) - cpu
        if spy is not None:
            spy.send_signal(2)
            spy.wait(60)
        r = json.loads(out.read_text())
        return {
            "tok_s": r["output_throughput"],
            "tpot_ms": r.get("median_tpot_ms"),
            "failed": r.get("failed", 0),
            "cpu_us_per_tok": cpu / max(r.get("total_output_tokens") or batch * tokens, 1) * 1e6,
        }
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.unlink(log.name)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        return _serve(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--profile", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(
        "| streams | engine alone, tok/s | over HTTP, tok/s | HTTP / engine | HTTP median TPOT | server CPU a token |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for b in args.batch:
        eng = engine_rate(b, min(args.tokens, 200))
        h = http_rate(b, args.tokens, args.profile)
        tpot = f"{h['tpot_ms']:.3f} ms" if h["tpot_ms"] is not None else "-"
        cpu = f"{h['cpu_us_per_tok']:.0f} us"
        print(f"| {b} | {eng:,.0f} | {h['tok_s']:,.0f} | {h['tok_s'] / eng:.2f} | {tpot} | {cpu} |", flush=True)


if __name__ == "__main__":
    main()
