"""``llmkit serve --engine-process``: the engine in its own process behind the same EngineClient
seam. Same outputs as the in-thread engine; a killed engine fails its clients at once and stops the
server; nothing on the IPC path is pickled."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_utils import server_log, start_server, stop_server

CORE_ENGINE = Path(__file__).resolve().parents[3] / "core" / "engine"
PROCS = CORE_ENGINE / "procs"
MSGS = [{"role": "user", "content": "List three colours."}]


@pytest.fixture(scope="module")
def proc_server():
    proc, url = start_server(["--engine-process", "--batch-storage", "none"])
    try:
        yield proc, url
    finally:
        stop_server(proc)


def _chat(url, **kw):
    body = {"model": "m", "messages": MSGS, "max_tokens": 24, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_same_output_as_the_in_thread_engine(proc_server, server):
    _, url = proc_server
    mine, theirs = _chat(url), _chat(server.base_url)
    assert mine["choices"][0]["message"] == theirs["choices"][0]["message"]
    assert mine["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]


def test_streaming_equals_non_streaming_and_n(proc_server):
    _, url = proc_server
    full = _chat(url, n=2, seed=7, temperature=0.8)
    texts = ["", ""]
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        timeout=120,
        json={"model": "m", "messages": MSGS, "max_tokens": 24, "temperature": 0.8, "seed": 7, "n": 2, "stream": True},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["delta"].get("content") or ""
    assert texts == [c["message"]["content"] for c in full["choices"]]


def test_grammar_checks_cross_the_boundary(proc_server):
    _, url = proc_server
    out = _chat(url, regex="(red|green|blue)", max_tokens=8)
    assert out["choices"][0]["message"]["content"] in ("red", "green", "blue")
    bad = httpx.post(url + "/v1/chat/completions", timeout=60, json={"model": "m", "messages": MSGS, "regex": "(a*)*b"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "regex"


def test_engine_runs_in_another_process(proc_server):
    proc, url = proc_server
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    assert info["engine_pid"] != proc.pid and "kv_pages_total" in info


def test_killed_engine_fails_clients_and_stops_the_server():
    proc, url = start_server(["--engine-process", "--batch-storage", "none"])
    try:
        pid = httpx.get(url + "/get_server_info", timeout=30).json()["engine_pid"]
        events: list[str] = []
        started = threading.Event()

        def stream():
            with httpx.stream(
                "POST",
                url + "/v1/chat/completions",
                timeout=60,
                json={"model": "m", "messages": MSGS, "max_tokens": 4000, "stream": True, "ignore_eos": True},
            ) as r:
                for line in r.iter_lines():
                    started.set()
                    events.append(line)

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert started.wait(60)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        t.join(10)
        assert not t.is_alive(), "the client was left waiting"
        assert any('"error"' in e and "engine process" in e for e in events)
        assert events[-1] == "data: [DONE]" or events[-1] == ""
        proc.wait(timeout=max(1.0, 10 - (time.monotonic() - killed)))
        assert proc.returncode != 0
        assert re.search(r"engine process \(rank 0, pid \d+\) died: killed by signal 9", server_log(proc))
    finally:
        stop_server(proc)


def test_nothing_is_pickled_on_the_ipc_path():
    for path in (PROCS / "ipc.py", PROCS / "worker.py", PROCS / "process_client.py", CORE_ENGINE / "messages.py"):
        text = path.read_text()
        assert not re.search(r"\bpickle\b|recv_pyobj|send_pyobj|multiprocessing", text), path.name


def test_flush_cache_reaches_the_engine_process(proc_server):
    _, url = proc_server
    _chat(url)
    info = lambda: httpx.get(url + "/get_server_info", timeout=30).json()  # noqa: E731
    deadline = time.monotonic() + 10  # the stats snapshot comes from the engine twice a second
    while info()["kv_pages_cached"] == 0:
        assert time.monotonic() < deadline, "nothing was cached"
        time.sleep(0.2)
    r = httpx.post(url + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while info()["kv_pages_cached"] != 0:
        assert time.monotonic() < deadline, "the cache was not flushed"
        time.sleep(0.2)
