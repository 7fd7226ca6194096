"""``llmkit gateway``: N local ``llmkit serve`` workers behind SGLang's Model Gateway.

We do not write a router: ``sglang-router`` (a Rust binary from PyPI) is the router of this
ecosystem, and llmkit answers what it asks of a worker. This command only launches the pieces on
one machine, waits for them and stops them together. Workers share the storage backend (the same
``--file-storage-path`` or bucket), so responses, files and batches are seen by every replica.
Only the standard library is imported: ``llmkit --help`` stays fast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Annotated, Optional

import typer

STOP_TIMEOUT = 30.0  # seconds a child has to exit after SIGTERM before it is killed
# A worker that dies is started again on its port (the gateway keeps its URL and takes it back once
# healthy); one that dies MAX_RESTARTS times within RESTART_WINDOW_S is left down: a restart will
# not fix it, and the others keep serving.
MAX_RESTARTS, RESTART_WINDOW_S = 3, 600.0


def router_command(
    worker_urls: list[str],
    *,
    host: str,
    port: int,
    policy: str,
    prometheus_port: int,
    api_key: str | None = None,
    extra: list[str] = (),
) -> list[str]:
    """The ``sglang_router.launch_router`` command line. Its Prometheus exporter binds a port of its
    own (29000 by default): two gateways on one machine need different ones. With no
    ``worker_urls`` it starts empty, for workers that register themselves (``serve --gateway-url``)."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router"]
    cmd += ["--worker-urls", *worker_urls] if worker_urls else []
    cmd += ["--host", host, "--port", str(port), "--policy", policy, "--prometheus-port", str(prometheus_port)]
    if api_key:
        # The router sends this key to the workers, and asks it of its own clients too.
        cmd += ["--api-key", api_key]
    return [*cmd, *extra]


def _get(url: str, api_key: str | None, timeout: float = 2.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, b""


def healthy_workers(gateway_url: str, api_key: str | None = None) -> int:
    """How many workers the gateway routes to now (its ``/readiness``; 0 if it does not answer)."""
    status, body = _get(gateway_url + "/readiness", api_key)
    if status != 200:
        return 0
    try:
        return int(json.loads(body).get("healthy_workers", 0))
    except (ValueError, AttributeError):
        return 0


def wait_until(ready, procs: list[subprocess.Popen], timeout: float, what: str) -> None:
    """Poll ``ready()`` until true; raise if any of ``procs`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{what}: a process exited with {dead[0].returncode} ({' '.join(dead[0].args[:6])} ...)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready after {timeout:g} s")
        time.sleep(0.5)


def stop_all(procs: list[subprocess.Popen], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM to every child (the router first: no new requests reach a draining worker), then
    SIGKILL to those still running after ``timeout``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def _visible_devices(i: int, per_worker: int) -> str:
    """The devices of worker ``i``: its slice of CUDA_VISIBLE_DEVICES (or of 0, 1, ...)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    pool = listed.split(",") if listed else [str(d) for d in range((i + 1) * per_worker)]
    chosen = pool[i * per_worker : (i + 1) * per_worker]
    if len(chosen) < per_worker:
        raise ValueError(f"worker {i} needs {per_worker} devices; CUDA_VISIBLE_DEVICES lists {len(pool)}")
    return ",".join(chosen)


def _output(log_dir: Path | None, name: str):
    if log_dir is None:
        return None  # inherited: every piece logs to this terminal
    log_dir.mkdir(parents=True, exist_ok=True)
    return open(log_dir / f"{name}.log", "ab")


def gateway(
    ctx: typer.Context,
    workers: Annotated[int, typer.Option("--workers", "-n", min=1, help="llmkit serve workers to start")] = 2,
    host: Annotated[str, typer.Option(help="Address the gateway listens on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="The gateway's port (clients talk to it)")] = 30000,
    worker_port: Annotated[
        Optional[int], typer.Option(help="Port of the first worker; the others follow (default: --port + 1)")
    ] = None,
    policy: Annotated[
        str, typer.Option(help="The gateway's policy: cache_aware, round_robin, power_of_two, random")
    ] = "cache_aware",
    api_key: Annotated[
        Optional[str],
        typer.Option(help="Key the workers require; the gateway sends it to them and requires it of clients"),
    ] = None,
    gpus_per_worker: Annotated[
        int, typer.Option(help="Give each worker its own slice of the GPUs (CUDA_VISIBLE_DEVICES); 0: leave it")
    ] = 0,
    prometheus_port: Annotated[int, typer.Option(help="The gateway's own Prometheus metrics port")] = 29000,
    router_arg: Annotated[
        Optional[list[str]],
        typer.Option(help="An argument for sglang-router (repeatable), e.g. --router-arg=--log-level=debug"),
    ] = None,
    log_dir: Annotated[
        Optional[Path], typer.Option(help="Write worker-I.log and router.log here instead of to this terminal")
    ] = None,
    startup_timeout: Annotated[float, typer.Option(help="Seconds the workers may take to load")] = 900.0,
):
    """Start N `llmkit serve` workers and SGLang's Model Gateway in front of them, on this machine.

    Options not listed here go to every `llmkit serve` (e.g. --model-path, --file-storage-path:
    one storage for all, so responses, files and batches are shared). A worker that dies is
    started again (three times in ten minutes at most). Ctrl-C or SIGTERM stops all.
    """
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        typer.echo("error: the gateway is sglang-router: pip install sglang-router", err=True)
        raise typer.Exit(2)
    serve_args = list(ctx.args)  # --host and --port are the gateway's own: workers get --worker-port
    first = worker_port if worker_port is not None else port + 1
    urls = [f"http://127.0.0.1:{first + i}" for i in range(workers)]
    procs: list[subprocess.Popen] = []  # the router first once started, then the workers
    restarts: list[list[float]] = [[] for _ in range(workers)]

    def start_worker(i: int) -> subprocess.Popen:
        env = dict(os.environ)
        if gpus_per_worker:
            env["CUDA_VISIBLE_DEVICES"] = _visible_devices(i, gpus_per_worker)
        cmd = [sys.executable, "-m", "llmkit.cli.main", "serve", "--port", str(first + i), *serve_args]
        if api_key:
            cmd += ["--api-key", api_key]
        # own sessions: Ctrl-C reaches this process only, which stops the children in order
        p = subprocess.Popen(
            cmd, env=env, stdout=_output(log_dir, f"worker-{i}"), stderr=subprocess.STDOUT, start_new_session=True
        )
        typer.echo(f"worker {i}: pid {p.pid}, {urls[i]}", err=True)
        return p

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        procs += [start_worker(i) for i in range(workers)]
        for url in urls:
            wait_until(lambda u=url: _get(u + "/health", None)[0] == 200, procs, startup_timeout, f"worker {url}")
        typer.echo(f"{workers} workers healthy: {' '.join(urls)}", err=True)
        cmd = router_command(
            urls,
            host=host,
            port=port,
            policy=policy,
            prometheus_port=prometheus_port,
            api_key=api_key,
            extra=router_arg or [],
        )
        router = subprocess.Popen(
            cmd, stdout=_output(log_dir, "router"), stderr=subprocess.STDOUT, start_new_session=True
        )
        procs.insert(0, router)
        local = f"http://127.0.0.1:{port}" if host in ("0.0.0.0", "::") else f"http://{host}:{port}"
        wait_until(lambda: healthy_workers(local, api_key) == workers, procs, 120, "the gateway")
        typer.echo(f"gateway on http://{host}:{port} ({policy}, {workers} workers); Ctrl-C stops all", err=True)
        while True:
            if router.poll() is not None:
                raise RuntimeError(f"the gateway exited with {router.returncode}")
            for i in range(workers):
                p = procs[1 + i]
                if p.poll() is None or getattr(p, "left_down", False):
                    continue
                now = time.monotonic()
                restarts[i] = [t for t in restarts[i] if now - t < RESTART_WINDOW_S] + [now]
                if len(restarts[i]) > MAX_RESTARTS:
                    p.left_down = True
                    typer.echo(f"warning: worker {urls[i]} exited with {p.returncode} again; left down", err=True)
                    continue
                typer.echo(f"warning: worker {urls[i]} exited with {p.returncode}; starting it again", err=True)
                procs[1 + i] = start_worker(i)
            time.sleep(1)
    except KeyboardInterrupt:
        typer.echo("stopping the gateway and its workers", err=True)
        code = 0
    except (RuntimeError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        code = 1
    finally:
        stop_all(procs)
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("gateway", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(gateway)
