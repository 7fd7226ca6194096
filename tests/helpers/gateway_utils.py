"""Start and stop SGLang's Model Gateway (``sglang-router``) in front of llmkit workers."""

from __future__ import annotations

import json
import subprocess
import tempfile

from llmkit.cli.gateway import _get, healthy_workers, router_command, wait_until

from server_utils import free_port, server_log, stop_server

# Fast failure detection for the tests: a dead worker leaves the rotation within ~2 s.
TEST_ROUTER_ARGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]


def start_router(
    worker_urls: list[str],
    *,
    policy: str = "round_robin",
    api_key: str | None = None,
    timeout: float = 60.0,
    port: int | None = None,
) -> tuple[subprocess.Popen, str]:
    """Run the gateway on ``port`` (default: a free one); return once it routes to every worker
    (with none: once it answers, empty, for workers that register themselves)."""
    port = port or free_port()
    log = tempfile.NamedTemporaryFile(prefix="sglang-router-", suffix=".log", delete=False)
    cmd = router_command(
        worker_urls,
        host="127.0.0.1",
        port=port,
        policy=policy,
        prometheus_port=free_port(),
        api_key=api_key,
        extra=TEST_ROUTER_ARGS,
    )
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path = log.name  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}"
    try:
        if worker_urls:
            wait_until(lambda: healthy_workers(url, api_key) == len(worker_urls), [proc], timeout, "sglang-router")
        else:
            wait_until(lambda: _get(url + "/health", None)[0] == 200, [proc], timeout, "sglang-router")
    except RuntimeError as exc:
        stop_server(proc, timeout=10)
        raise RuntimeError(f"{exc}\n{server_log(proc)}") from None
    return proc, url


def listed_workers(gateway_url: str, api_key: str | None = None) -> list[dict]:
    """The gateway's ``GET /workers`` entries (``url``, ``is_healthy``, ...); [] if it does not answer."""
    status, body = _get(gateway_url + "/workers", api_key)
    return json.loads(body).get("workers", []) if status == 200 else []
