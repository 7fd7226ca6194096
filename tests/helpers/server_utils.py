"""Start and stop ``llmkit serve`` subprocesses for end-to-end tests (restarts, kill -9)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

from llmkit.core.model.loader.source import EMBEDDED_NAME

STARTUP_TIMEOUT = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = STARTUP_TIMEOUT,
    on_start=None,
    port: int | None = None,
) -> tuple[subprocess.Popen, str]:
    """Run ``llmkit serve --port PORT *args``; return once ``GET /health`` answers 200.

    The server's output goes to a temporary log file (``proc.log_path``), printed if it dies or
    never becomes healthy. ``env`` is added to this process's environment. ``on_start(proc)`` is
    called right after the launch (a benchmark samples the server's memory from then on).
    ``port``: a given one (a server restarted where a router expects it), else a free one.
    """
    if "--served-model-name" not in args:
        # The default name (the model path, or the embedded model's) plus "m", the short name the
        # tests send: a request naming any other model gets 404.
        path = args[args.index("--model-path") + 1] if "--model-path" in args else EMBEDDED_NAME
        args = [*args, "--served-model-name", path, "--served-model-name", "m"]
    port = port or free_port()
    log = tempfile.NamedTemporaryFile(prefix="llmkit-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "llmkit.cli.main", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
    )
    proc.log_path = log.name  # type: ignore[attr-defined]
    if on_start is not None:
        on_start(proc)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llmkit serve exited with {proc.returncode}:\n{server_log(proc)}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, base_url
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)  # (a refused connection costs nothing: the socket listens only once serving)
    stop_server(proc)
    raise RuntimeError(f"llmkit serve was not healthy after {timeout} s:\n{server_log(proc)}")


def server_log(proc: subprocess.Popen, tail: int = 4000) -> str:
    try:
        with open(proc.log_path) as f:  # type: ignore[attr-defined]
            return f.read()[-tail:]
    except OSError:
        return ""


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM (graceful), then SIGKILL if it has not exited within ``timeout``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_server(proc)


def kill_server(proc: subprocess.Popen) -> None:
    """``kill -9``: no shutdown handlers run, as in a crash."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


@contextmanager
def tp2_and_tp1(args: list[str]):
    """``(TP=2 url, TP=1 url, TP=2 process)``: two servers of ``args``, one with ``--tp-size 2``,
    stopped on exit (the comparisons TP=2 equals TP=1)."""
    tp2, url2 = start_server([*args, "--tp-size", "2"])
    try:
        tp1, url1 = start_server(args)
        try:
            yield url2, url1, tp2
        finally:
            stop_server(tp1)
    finally:
        stop_server(tp2)
