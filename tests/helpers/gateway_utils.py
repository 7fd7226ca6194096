"""Start and stop SGLang's Model Gateway (``sglang-router``) in front of llmkit workers."""

from __future__ import annotations

import subprocess
import tempfile

from llmkit.cli.gateway import healthy_workers, router_command, wait_until

from server_utils import free_port, server_log, stop_server

# Fast failure detection for the tests: a dead worker leaves the rotation within ~2 s.
TEST_ROUTER_ARGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]


def start_router(
    worker_urls: list[str], *, policy: str = "round_robin", api_key: str | None = None, timeout: float = 60.0
) -> tuple[subprocess.Popen, str]:
    """Run the gateway on a free port; return once it routes to every worker."""
    port = free_port()
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
        wait_until(lambda: healthy_workers(url, api_key) == len(worker_urls), [proc], timeout, "sglang-router")
    except RuntimeError as exc:
        stop_server(proc, timeout=10)
        raise RuntimeError(f"{exc}\n{server_log(proc)}") from None
    return proc, url
