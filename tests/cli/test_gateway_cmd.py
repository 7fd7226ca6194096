"""``llmkit gateway``: two workers and sglang-router started by one command, a request through
it, a killed worker started again, and SIGTERM stopping every process it started."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest

from llmkit.cli.gateway import _get, _visible_devices, healthy_workers, router_command

from server_utils import free_port

pytest.importorskip("sglang_router")


def _two_free_ports() -> int:
    """A port P with P and P + 1 both free (the workers take consecutive ports)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


def test_router_command_line():
    cmd = router_command(["http://a:1", "http://b:2"], host="h", port=5, policy="round_robin", prometheus_port=6)
    assert cmd[1:3] == ["-m", "sglang_router.launch_router"]
    assert cmd[cmd.index("--worker-urls") + 1 : cmd.index("--worker-urls") + 3] == ["http://a:1", "http://b:2"]
    assert cmd[cmd.index("--prometheus-port") + 1] == "6" and "--api-key" not in cmd
    keyed = router_command(["http://a:1"], host="h", port=5, policy="p", prometheus_port=6, api_key="k", extra=["-x"])
    assert keyed[keyed.index("--api-key") + 1] == "k" and keyed[-1] == "-x"


def test_each_worker_gets_its_own_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [_visible_devices(i, 2) for i in range(3)] == ["0,1", "2,3", "4,5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    assert [_visible_devices(i, 1) for i in range(3)] == ["3", "5", "7"]
    with pytest.raises(ValueError):
        _visible_devices(1, 2)


@pytest.mark.slow
def test_gateway_command_serves_and_stops(tmp_path):
    port, first = free_port(), _two_free_ports()
    cmd = [sys.executable, "-m", "llmkit.cli.main", "gateway", "-n", "2", "--port", str(port)]
    cmd += ["--worker-port", str(first), "--prometheus-port", str(free_port()), "--policy", "round_robin"]
    cmd += ["--api-key", "k", "--log-dir", str(tmp_path / "logs")]
    # passed through to both workers
    cmd += ["--file-storage-path", str(tmp_path / "store"), "--skip-server-warmup", "--served-model-name", "m"]
    log = open(tmp_path / "gateway.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, workers = f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{first + i}" for i in range(2)]
    try:
        deadline = time.monotonic() + 300
        while healthy_workers(url, "k") != 2:
            assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
            assert time.monotonic() < deadline, "the gateway never routed to both workers"
            time.sleep(1)
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert r.choices[0].message.content
        assert sorted(os.listdir(tmp_path / "logs")) == ["router.log", "worker-0.log", "worker-1.log"]

        # a worker killed is started again on its port, and the gateway takes it back
        pid = int(re.search(r"worker 1: pid (\d+)", (tmp_path / "gateway.log").read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while "starting it again" not in (tmp_path / "gateway.log").read_text():
            assert time.monotonic() < deadline, "the dead worker was not restarted"
            time.sleep(0.5)
        while healthy_workers(url, "k") != 2 or _get(workers[1] + "/health", None)[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "the restarted worker never rejoined"
            time.sleep(1)
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert r.choices[0].message.content

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for u in [url, *workers]:  # everything it started is gone
            assert _get(u + "/health", None, timeout=2)[0] == 0
    finally:
        if proc.poll() is None:  # a failure above: SIGTERM lets it stop its workers (own sessions)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
