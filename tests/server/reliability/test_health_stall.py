"""``/health`` tells the truth about a hung engine: 503 once the engine shows no progress for
``--health-stall-timeout`` seconds (a step that never ends, a frozen engine process), 200 again
when it moves. ``alive()`` alone cannot see either: the thread or process is still there."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from llmkit.core.engine.client import InProcessEngineClient
from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from model_utils import start_engine
from server_utils import start_server, stop_server


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_a_blocked_step_shows_as_no_progress():
    """A hook that blocks the engine loop mid-step (the step waits on an event): the in-process
    client's progress age grows past any bound, and falls back once the step ends."""
    engine = start_engine()
    client = InProcessEngineClient(engine, max_queued=8)
    gate, entered = threading.Event(), threading.Event()
    step = engine.step

    def blocked_step(inflight):
        entered.set()
        gate.wait(30)
        return step(inflight)

    engine.step = blocked_step
    try:
        assert client.progress_age() < 1.0  # idle: the loop turns every 0.5 s
        params = SamplingParams(max_new_tokens=2, temperature=0)
        engine.submit(GenerateRequest(rid="r", prompt_ids=[1, 2, 3], params=params), lambda out: None)
        assert entered.wait(30)
        assert _wait_for(lambda: client.progress_age() > 1.5, 10)
        assert client.alive()  # the thread lives: only the progress age tells
        gate.set()
        assert _wait_for(lambda: client.progress_age() < 1.0, 10)
    finally:
        gate.set()
        engine.shutdown()


def test_health_is_503_while_the_engine_process_is_frozen():
    proc, url = start_server(["--engine-process", "--batch-storage", "none", "--health-stall-timeout", "2"])
    try:
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        pid = httpx.get(url + "/get_server_info", timeout=30).json()["engine_pid"]
        os.kill(pid, signal.SIGSTOP)  # frozen: alive, reports nothing
        try:
            assert _wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 503, 15)
            err = httpx.get(url + "/health", timeout=10).json()["error"]
            assert "no progress" in err["message"] and "--health-stall-timeout" in err["message"]
        finally:
            os.kill(pid, signal.SIGCONT)
        assert _wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 200, 15)
    finally:
        stop_server(proc)
