"""llmkit (native GGUF precision) against llama.cpp's ``llama-server`` on the same GGUF, interleaved.

    python benchmarks/bench_llamacpp.py [--rounds 3] [--gguf FILE] [--build-only] [-- extra llmkit serve flags]

Metrics, each as the median of ``--rounds`` interleaved rounds (llmkit, then llama-server):

(a) single-stream greedy decode, 128 tokens (tok/s, end to end over HTTP);
(b) 16 concurrent chat requests x 128 tokens, total generated tok/s;
(c) time to first token of a 512-token prompt (s; a different first token each round, so neither
    server's prompt cache hits);
(d) resident memory of each server after (b) (MB, from /proc).

llama-server is built once, if absent, from the ``llama-cpp-python`` sdist's vendored llama.cpp
(``pip download``, then cmake + ninja with ``GGML_NATIVE=ON``; about 6 minutes of two cores) into
``$LLMKIT_LLAMACPP_DIR`` (default ``/work/.cache/llama.cpp``, outside the repository). It runs with
``-t N -tb N -np 16 -c 16384`` (continuous batching over 16 slots of 1,024 tokens; a 512-token prompt plus 1 must fit one slot) and ``ignore_eos`` like llmkit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

LLAMA_CPP_PYTHON = "0.3.36"
BUILD_DIR = Path(os.environ.get("LLMKIT_LLAMACPP_DIR", "/work/.cache/llama.cpp"))


def llama_server_binary() -> Path:
    """The built ``llama-server``; builds it first if absent."""
    exe = BUILD_DIR / "build" / "bin" / "llama-server"
    if exe.exists():
        return exe
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    src = BUILD_DIR / "src"
    if not (src / "CMakeLists.txt").exists():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "-d",
                    tmp,
                ],
                check=True,
            )
            (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            (top,) = [p for p in Path(tmp).iterdir() if p.is_dir()]
            shutil.rmtree(src, ignore_errors=True)
            shutil.copytree(top / "vendor" / "llama.cpp", src)
    build = BUILD_DIR / "build"
    subprocess.run(
        [
            "cmake",
            "-S",
            str(src),
            "-B",
            str(build),
            "-G",
            "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_USE_PREBUILT_UI=OFF",
            "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DBUILD_SHARED_LIBS=OFF",
        ],
        check=True,
    )
    subprocess.run(["ninja", "-C", str(build), f"-j{os.cpu_count() or 2}", "llama-server"], check=True)
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama_server(gguf: Path, threads: int):
    import urllib.request

    port = _free_port()
    log = open(BUILD_DIR / "llama-server.log", "w")
    proc = subprocess.Popen(
        [
            str(llama_server_binary()),
            "-m",
            str(gguf),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-np",
            "16",
            "-c",
            "16384",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited; see {BUILD_DIR / 'llama-server.log'}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama-server did not become healthy in 300 s")


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its children (llmkit's server may run helpers), MB."""
    total = 0
    pids = [pid]
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        pids += [int(p) for p in out]
    except OSError:
        pass
    for p in pids:
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def single_stream(client, prompt: str, n: int = 128) -> float:
    """One greedy request of ``n`` tokens (EOS ignored), tok/s end to end; non-streaming, so both
    servers report their own token count in ``usage``."""
    t0 = time.perf_counter()
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=n,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return r.usage.completion_tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gguf", default=None, help="default: the embedded model's GGUF")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args()
    exe = llama_server_binary()
    print(f"llama-server: {exe}", flush=True)
    if args.build_only:
        return

    import openai
    from bench_cpu import PROMPTS, llmkit_concurrent, llmkit_ttft, long_prompt
    from transformers import AutoTokenizer

    from llmkit.core.model.source import embedded_gguf_path, resolve_model_dir

    from server_utils import start_server, stop_server

    gguf = Path(args.gguf) if args.gguf else embedded_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(str(gguf), weights=False)))
    ids = long_prompt(tok)
    servers = {}
    try:
        servers["llmkit"] = start_server(
            ["--model-path", str(gguf), "--batch-storage", "none", "--num-threads", str(args.threads), *args.serve_args]
        )
        servers["llama.cpp"] = start_llama_server(gguf, args.threads)
        res = {f"{m}_{n}": [] for m in ("single", "concurrent", "ttft", "rss") for n in servers}
        for r in range(args.rounds + 1):  # round 0 warms both up
            for name, (proc, url) in servers.items():
                client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
                single = single_stream(client, PROMPTS[0])
                concurrent = llmkit_concurrent(url)
                rss = rss_mb(proc.pid)
                ttft = llmkit_ttft(client, ids, r)
                if r:
                    for m, v in (("single", single), ("concurrent", concurrent), ("ttft", ttft), ("rss", rss)):
                        res[f"{m}_{name}"].append(v)
            if r:
                print(f"round {r}: " + ", ".join(f"{k}={v[-1]:.2f}" for k, v in res.items()), flush=True)
    finally:
        for proc, _ in servers.values():
            if hasattr(proc, "args") and "llama-server" in str(proc.args[0]):
                proc.terminate()
                proc.wait(30)
            else:
                stop_server(proc)
    med = {k: statistics.median(v) for k, v in res.items()}
    rows = [
        ("(a) single-stream greedy, 128 tokens (tok/s)", "single", "≥ 1.0x (stretch 1.3x)"),
        (f"(b) {len(PROMPTS)} concurrent x 128 tokens (total tok/s)", "concurrent", "≥ 1.3x"),
        ("(c) time to first token, 512-token prompt (s)", "ttft", "≤ 0.5x"),
        ("(d) server RSS after (b) (MB)", "rss", "≤ 1.5x"),
    ]
    print("| metric | llmkit | llama-server | ratio | target |\n|---|---:|---:|---:|---|")
    for title, m, target in rows:
        a, b = med[f"{m}_llmkit"], med[f"{m}_llama.cpp"]
        print(f"| {title} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {target} |")
    print(f"{args.rounds} rounds, {args.threads} threads, {gguf.name}, {time.strftime('%Y-%m-%d %H:%M')}")


if __name__ == "__main__":
    main()
