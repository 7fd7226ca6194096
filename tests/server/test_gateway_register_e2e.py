"""``llmkit serve --gateway-url``: a worker joins SGLang's Model Gateway by itself, and leaves it on
SIGTERM (issue 33). Real processes on 127.0.0.1: a gateway started with no workers, an llmkit worker
(the embedded model) pointed at it, the OpenAI SDK through the gateway."""

from __future__ import annotations

import signal
import time

import openai
import pytest

from llmkit.cli.gateway import _get, healthy_workers

from gateway_utils import listed_workers, start_router
from server_utils import free_port, server_log, start_server, stop_server

pytest.importorskip("sglang_router")
pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Say hi."}]
WAIT_S = 60.0  # every wait on the gateway is bounded by this


def wait_for(check, what: str, procs=(), timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a process exited with {p.returncode}\n{server_log(p)}")
        if time.monotonic() > deadline:
            logs = "\n".join(server_log(p) for p in procs)
            raise AssertionError(f"{what}: not after {timeout:g} s\n{logs}")
        time.sleep(0.25)


def roundtrip(gateway_url: str, worker, worker_url: str, router, api_key: str | None) -> None:
    """Wait until the gateway routes to the worker, chat through it, SIGTERM the worker, and wait
    until the gateway no longer lists it."""

    def listed() -> list[dict]:
        return [w for w in listed_workers(gateway_url, api_key) if w["url"] == worker_url]

    wait_for(lambda: any(w["is_healthy"] for w in listed()), "the worker listed healthy", [worker, router])
    assert healthy_workers(gateway_url, api_key) == 1
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=api_key or "none", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="m", messages=HI, max_tokens=4)
    assert r.choices[0].message.content
    assert '"POST /v1/chat/completions HTTP' in server_log(worker, tail=100_000)  # it went through the worker

    worker.send_signal(signal.SIGTERM)
    wait_for(lambda: not listed(), "the worker gone from the gateway", [router])
    worker.wait(30)
    assert "gateway: deregistered" in server_log(worker)


def test_worker_registers_and_leaves():
    router, gateway_url = start_router([])
    worker = None
    try:
        assert listed_workers(gateway_url) == []
        worker, url = start_server(["--skip-server-warmup", "--batch-storage", "none", "--gateway-url", gateway_url])
        roundtrip(gateway_url, worker, url, router, None)
    finally:
        if worker is not None:
            stop_server(worker)
        stop_server(router, timeout=15)


def test_worker_registers_again_with_a_restarted_gateway():
    """A gateway keeps no list of its workers: the same gateway started again on its port gets the
    worker back without anyone telling it (the worker checks every LLMKIT_GATEWAY_RECHECK_S)."""
    port = free_port()
    router, gateway_url = start_router([], port=port)
    worker = None
    try:
        args = ["--skip-server-warmup", "--batch-storage", "none", "--gateway-url", gateway_url]
        worker, url = start_server(args, env={"LLMKIT_GATEWAY_RECHECK_S": "1"})
        healthy = lambda: any(w["url"] == url and w["is_healthy"] for w in listed_workers(gateway_url))  # noqa: E731
        wait_for(healthy, "the worker listed healthy", [worker, router])
        stop_server(router, timeout=15)
        router, _ = start_router([], port=port)
        wait_for(healthy, "the worker listed again by the restarted gateway", [worker, router])
        assert "registering again" in server_log(worker, tail=100_000)
        client = openai.OpenAI(base_url=gateway_url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert client.chat.completions.create(model="m", messages=HI, max_tokens=4).choices[0].message.content
    finally:
        if worker is not None:
            stop_server(worker)
        stop_server(router, timeout=15)


def test_worker_waits_for_the_gateway_with_a_key():
    """The worker starts first (the gateway is not up: it retries), the gateway later; both keyed:
    the worker's --api-key is the gateway's key on its /workers routes and the key it sends back."""
    key = "register-test-key"
    port = free_port()
    gateway_url = f"http://127.0.0.1:{port}"
    worker, url = start_server(
        ["--skip-server-warmup", "--batch-storage", "none", "--api-key", key, "--gateway-url", gateway_url]
    )
    router = None
    try:
        wait_for(lambda: "cannot register" in server_log(worker), "the worker's first failed attempt", [worker], 30)
        router, _ = start_router([], api_key=key, port=port)
        assert _get(gateway_url + "/workers", None)[0] == 401  # the gateway's key guards its control plane
        roundtrip(gateway_url, worker, url, router, key)
        assert server_log(worker, tail=100_000).count("cannot register") == 1  # each failure logged once
    finally:
        stop_server(worker)
        if router is not None:
            stop_server(router, timeout=15)
