"""llmkit (native GGUF precision) against llama.cpp's ``llama-server`` on the same GGUF, interleaved.

    python benchmarks/bench_llamacpp.py [--rounds 3] [--gguf FILE] [--concurrency 16,64] [--build-only]
        [-- extra llmkit serve flags]

Metrics, each as the median of ``--rounds`` interleaved rounds (llmkit, then llama-server):

(a) single-stream greedy decode, 128 tokens (tok/s, end to end over HTTP);
(b) for each ``--concurrency`` C (default 16 and 64): C concurrent chat requests x 128 tokens,
    total generated tok/s (the 16 prompts, repeated C/16 times);
(c) time to first token of a 512-token prompt (s; a different first token each round, so neither
    server's prompt cache hits);
(d) resident memory of each server after the largest (b) (MB, from /proc).

llama-server is built once, if absent, from the ``llama-cpp-python`` sdist's vendored llama.cpp
(``pip download``, then cmake + ninja with ``GGML_NATIVE=ON``; about 6 minutes of two cores) into
``$LLMKIT_LLAMACPP_DIR`` (default ``/work/.cache/llama.cpp``, outside the repository). It runs with
``-t N -tb N -np C -c 1024*C`` for the largest C of ``--concurrency`` (continuous batching over C
slots of 1,024 tokens; a 512-token prompt plus 1 must fit one slot; 16 slots, ``-c 16384``, as
before when C is 16) and ``ignore_eos`` like llmkit. More slots mean a larger KV cache, which
llama.cpp allocates (and clears) at start: with ``--concurrency 16,64`` its RSS includes 64 slots.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(ROOT / "benchmarks"))

LLAMA_CPP_PYTHON = "0.3.36"
BUILD_DIR = Path(os.environ.get("LLMKIT_LLAMACPP_DIR", "/work/.cache/llama.cpp"))


def _has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# On a CPU with AMX, llama.cpp's AMX matmul (which GGML_NATIVE turns on there) crashed on a qwen35
# GGUF's Q8_0 weights (SIGSEGV in ggml_backend_amx_mul_mat, 2026-12-07): it is built without AMX
# there, into a build directory of its own (AVX-512 VNNI kernels instead).
_NO_AMX = _has_amx()
_BUILD_NAME = "build-noamx" if _NO_AMX else "build"


def llama_server_binary() -> Path:
    """The built ``llama-server``; builds it first if absent."""
    exe = BUILD_DIR / _BUILD_NAME / "bin" / "llama-server"
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
    build = BUILD_DIR / _BUILD_NAME
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
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
            *([f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"] if _NO_AMX else []),
        ],
        check=True,
    )
    subprocess.run(["ninja", "-C", str(build), f"-j{os.cpu_count() or 2}", "llama-server"], check=True)
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLOT_TOKENS = 1024  # llama-server's context per slot: a 512-token prompt plus 1, or 40 + 128 tokens


def start_llama_server(
    gguf: Path, threads: int, slots: int = 16, ctx: int | None = None, timeout: float = 300.0, on_start=None
):
    """``llama-server`` on ``gguf`` with ``slots`` parallel slots and ``ctx`` tokens of context in all
    (default ``SLOT_TOKENS`` per slot); returns ``(proc, url)`` once ``/health`` answers, or raises
    after ``timeout`` seconds (killing it). ``on_start(proc)`` is called right after the launch."""
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
            str(slots),
            "-c",
            str(ctx or slots * SLOT_TOKENS),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    if on_start is not None:
        on_start(proc)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
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
    proc.wait(30)
    raise RuntimeError(f"llama-server did not become healthy in {timeout:.0f} s; see {BUILD_DIR / 'llama-server.log'}")


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
    ap.add_argument(
        "--concurrency",
        default="16,64",
        help="comma-separated concurrent request counts for (b), each a multiple of 16 (default 16,64)",
    )
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or any(c <= 0 or c % 16 for c in levels):
        ap.error(f"--concurrency {args.concurrency}: each count must be a positive multiple of 16")
    exe = llama_server_binary()
    print(f"llama-server: {exe}", flush=True)
    if args.build_only:
        return
    # SIGTERM (``timeout``, a CI limit) as an exit, so the finally below stops both servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import openai
    from bench_cpu import PROMPTS, llmkit_concurrent, llmkit_ttft, long_prompt
    from transformers import AutoTokenizer

    from llmkit.core.model.loader.source import embedded_gguf_path, resolve_model_dir

    from server_utils import start_server, stop_server

    gguf = Path(args.gguf) if args.gguf else embedded_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(str(gguf), weights=False)))
    ids = long_prompt(tok)
    metrics = ["single", *(f"concurrent{c}" for c in levels), "ttft", "rss"]
    servers = {}
    try:
        servers["llmkit"] = start_server(
            [
                "--model-path",
                str(gguf),
                "--quantization",
                "gguf",
                "--batch-storage",
                "none",
                "--num-threads",
                str(args.threads),
            ]
            + args.serve_args
        )
        servers["llama.cpp"] = start_llama_server(gguf, args.threads, slots=max(16, *levels))
        res = {f"{m}_{n}": [] for m in metrics for n in servers}
        for r in range(args.rounds + 1):  # round 0 warms both up
            for name, (proc, url) in servers.items():
                client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
                got = {"single": single_stream(client, PROMPTS[0])}
                for c in levels:
                    got[f"concurrent{c}"] = llmkit_concurrent(url, copies=c // len(PROMPTS))
                got["rss"] = rss_mb(proc.pid)
                got["ttft"] = llmkit_ttft(client, ids, r)
                print(f"  round {r} {name}: " + ", ".join(f"{k}={v:.2f}" for k, v in got.items()), flush=True)
                if r:
                    for m in metrics:
                        res[f"{m}_{name}"].append(got[m])
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
    targets = {16: "≥ 1.3x", 64: "≥ 1.8x"}
    rows = [("(a) single-stream greedy, 128 tokens (tok/s)", "single", "≥ 1.0x (stretch 1.3x)")]
    rows += [(f"(b) {c} concurrent x 128 tokens (total tok/s)", f"concurrent{c}", targets.get(c, "")) for c in levels]
    rows += [
        ("(c) time to first token, 512-token prompt (s)", "ttft", "≤ 0.5x"),
        (f"(d) server RSS after (b) at {levels[-1]} (MB)", "rss", "≤ 1.5x"),
    ]
    print("| metric | llmkit | llama-server | ratio | target |\n|---|---:|---:|---:|---|")
    for title, m, target in rows:
        a, b = med[f"{m}_llmkit"], med[f"{m}_llama.cpp"]
        print(f"| {title} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {target} |")
    slots = max(16, *levels)
    print(
        f"{args.rounds} rounds, {args.threads} threads, {gguf.name}, llama-server -np {slots} -c {slots * SLOT_TOKENS}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )


if __name__ == "__main__":
    main()
