"""Connection limits on a real ``llmkit serve`` socket: slow-header connections are closed after
--header-timeout (uvicorn alone keeps them for ever), idle keep-alive ones after
--keep-alive-timeout, normal requests still work, and an error response (a 500 included) leaves
its keep-alive connection usable. Every wait is bounded."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from server_utils import start_server, stop_server


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("storage")


@pytest.fixture(scope="module")
def url(storage):
    args = ["--file-storage-path", str(storage), "--header-timeout", "1", "--keep-alive-timeout", "1"]
    proc, base = start_server(args)
    try:
        yield base
    finally:
        stop_server(proc)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1024) == b""  # EOF: the server closed it
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _connect(url: str) -> socket.socket:
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=5)


def test_slow_and_silent_connections_are_closed(url):
    socks = [_connect(url) for _ in range(20)]
    for i, s in enumerate(socks):
        if i % 2:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # headers never finished
    t0 = time.monotonic()
    assert all(_closed_within(s, 5) for s in socks)
    assert time.monotonic() - t0 < 5
    for s in socks:
        s.close()
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_connections_beyond_the_cap_are_closed_at_once():
    proc, base = start_server(["--batch-storage", "none", "--max-connections", "4", "--header-timeout", "30"])
    try:
        held = [_connect(base) for _ in range(4)]  # silent: kept until the header timeout
        time.sleep(0.3)
        extra = _connect(base)
        assert _closed_within(extra, 3)  # over the cap: closed without waiting 30 s
        extra.close()
        for s in held:
            assert not _closed_within(s, 0.1)
            s.close()
        time.sleep(0.3)
        assert httpx.get(base + "/health", timeout=10).status_code == 200
    finally:
        stop_server(proc)


def test_idle_keep_alive_is_closed_and_busy_ones_are_not(url):
    s = _connect(url)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(5)
    got = b""
    while b'"ok"' not in got:  # the whole response, headers and body
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    assert b" 200 " in got
    assert _closed_within(s, 5)  # idle after its response
    s.close()
    # A request slower than the header timeout overall (it is generating) is not cut.
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "m", "prompt": "Hello", "max_tokens": 40, "ignore_eos": True},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40


def test_queue_timeout_is_503():
    """One slot, held by a long request: the next one waits past --queue-timeout and gets 503."""
    import threading

    proc, base = start_server(["--batch-storage", "none", "--max-running-requests", "1", "--queue-timeout", "1"])
    try:
        out = {}

        def long():
            out["r"] = httpx.post(
                base + "/v1/completions",
                json={"model": "m", "prompt": "Once", "max_tokens": 400, "ignore_eos": True},
                timeout=120,
            )

        t = threading.Thread(target=long)
        t.start()
        deadline = time.monotonic() + 60
        while httpx.get(base + "/get_server_info", timeout=10).json()["num_running_reqs"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 1}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout", r.text
        assert time.monotonic() - t0 < 10
        t.join(120)
        assert out["r"].status_code == 200
    finally:
        stop_server(proc)


def test_a_500_leaves_the_keep_alive_connection_usable(url, storage):
    """A failure the server did not foresee (here the local storage's directory for uploads in
    progress, removed under it) is a 500 in the OpenAI shape, and the client's next request on the
    same connection is served: uvicorn closes a connection whose app raised after responding, so
    the error must end in the app."""
    import shutil

    ports = []

    def record(resp):  # the connection's local port, read while it is open
        ports.append(resp.extensions["network_stream"].get_extra_info("client_addr")[1])

    with httpx.Client(base_url=url, timeout=30, event_hooks={"response": [record]}) as http:
        assert http.get("/v1/models").status_code == 200
        shutil.rmtree(storage / "tmp")
        try:
            failed = http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"})
        finally:
            (storage / "tmp").mkdir(mode=0o700)
        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert error["type"] == "internal_server_error" and error["message"].startswith("Internal server error")
        time.sleep(0.2)  # a close would have reached the client by now
        assert http.get("/v1/models").status_code == 200
    assert len(ports) == 3 and len(set(ports)) == 1, ports  # one connection throughout
