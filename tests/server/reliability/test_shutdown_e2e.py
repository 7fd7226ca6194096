"""SIGTERM on a real ``llmkit serve``: /health says 503 while draining, new requests get 503, those
still running when --shutdown-timeout runs out get an OpenAI-shaped 503 or a final error event
and [DONE], and a second SIGTERM exits at once. Every wait is bounded."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from server_utils import server_log, start_server, stop_server

LONG = {"model": "m", "prompt": "Once upon a time", "max_tokens": 6000, "ignore_eos": True}


def _non_stream(url: str, out: dict) -> None:
    try:
        r = httpx.post(url + "/v1/completions", json=LONG, timeout=90)
        out["status"], out["body"] = r.status_code, r.json()
    except Exception as exc:  # noqa: BLE001 - recorded and asserted on
        out["exc"] = repr(exc)


def _stream(url: str, out: dict) -> None:
    lines: list[str] = []
    out["lines"] = lines
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=90) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line:
                    lines.append(line)
    except Exception as exc:  # noqa: BLE001
        out["exc"] = repr(exc)


def _wait_tokens(url: str, timeout: float = 60) -> None:
    """Until both requests are decoding (so SIGTERM finds them in flight)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(url + "/get_server_info", timeout=10).json().get("num_running_reqs", 0) >= 2:
            return
        time.sleep(0.2)
    raise AssertionError("the requests never started")


def test_sigterm_drain_answers_what_is_left():
    proc, url = start_server(["--batch-storage", "none", "--shutdown-timeout", "3"])
    plain, streamed = {}, {}
    threads = [
        threading.Thread(target=_non_stream, args=(url, plain)),
        threading.Thread(target=_stream, args=(url, streamed)),
    ]
    try:
        for t in threads:
            t.start()
        _wait_tokens(url)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(url + "/health", timeout=10)  # still listening while draining
        assert health.status_code == 503 and "error" in health.json()
        new = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1}, timeout=10)
        assert new.status_code == 503 and new.json()["error"]["code"] == "server_shutting_down"
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client is still waiting"
        assert plain.get("status") == 503, (plain, server_log(proc))
        assert set(plain["body"]["error"]) == {"message", "type", "param", "code"}
        lines = streamed["lines"]
        assert streamed.get("status") == 200 and lines[-1] == "data: [DONE]", (streamed, server_log(proc))
        assert json.loads(lines[-2][6:])["error"]["code"] == "server_shutting_down"
        assert proc.wait(30) == 0
    finally:
        stop_server(proc)


def test_second_sigterm_exits_at_once():
    proc, url = start_server(["--batch-storage", "none", "--shutdown-timeout", "60"])
    out: dict = {}
    t = threading.Thread(target=_stream, args=(url, out))
    try:
        t.start()
        deadline = time.monotonic() + 60
        while not out.get("lines") and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # draining: the stream runs on
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        assert time.monotonic() - t0 < 5
        t.join(30)
        assert not t.is_alive()
    finally:
        stop_server(proc)
