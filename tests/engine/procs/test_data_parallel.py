"""``llmkit serve --dp-size 2``: two engine processes behind one server. The router's choices
(unit), then a tiny random-weight Llama served with DP=2 against DP=1: 32 concurrent requests
spread over both replicas with the same outputs, a shared-prefix workload stays on one replica,
and a killed replica fails its own clients and is restarted while the other serves."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import openai
import pytest

from llmkit.core.engine.procs.dp_router import PrefixRouter

from fault_utils import LongStreams
from server_utils import server_log, start_server, stop_server

# --- the router -------------------------------------------------------------------------------


def test_router_sends_new_prompts_to_the_least_loaded():
    router = PrefixRouter(3, block=4)
    assert router.route([1, 2], [2, 0, 1]) == 1
    assert router.route([1, 2], [0, 0, 5]) in (0, 1)


def test_router_rotates_ties():
    router = PrefixRouter(2, block=4)
    assert {router.route([i], [0, 0]) for i in range(4)} == {0, 1}


def test_router_keeps_a_shared_prefix_on_its_replica_unless_much_busier():
    router = PrefixRouter(2, block=4, slack=2)
    system = list(range(100, 116))  # four blocks
    first = router.route(system + [1, 2, 3, 4], [0, 0])
    other = 1 - first
    loads = [0, 0]
    loads[first] = 2  # busier, within the slack: the prefix wins
    assert router.route(system + [9, 9, 9, 9], loads) == first
    loads[first] = 3  # past the slack: the least loaded wins
    assert router.route(system + [8, 8, 8, 8], loads) == other
    # the longest remembered prefix decides: [8, 8, 8, 8] went to the other replica last
    assert router.route(system + [8, 8, 8, 8, 7], [0, 0]) == other
    assert router.route(system + [1, 2, 3, 4], [1, 0]) == first


def test_router_table_is_bounded():
    router = PrefixRouter(2, block=2, capacity=10)
    for i in range(100):
        router.route([i] * 20, [0, 0])
    assert len(router._owner) <= 10


# --- the server -------------------------------------------------------------------------------

COMMON = ["--batch-storage", "none", "--enable-deterministic-inference", "--num-threads", "1"]


@pytest.fixture(scope="module")
def model_dir(tiny_llama):
    return str(tiny_llama)


@pytest.fixture(scope="module")
def dp2(model_dir):
    proc, url = start_server(["--model-path", model_dir, "--dp-size", "2", *COMMON])
    try:
        yield proc, url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def dp1(model_dir):
    proc, url = start_server(["--model-path", model_dir, *COMMON])
    try:
        yield url
    finally:
        stop_server(proc)


def _replicas(url: str) -> list[dict]:
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    assert info["dp_size"] == 2
    return info["replicas"]


async def _complete_all(url: str, prompts: list[list[int]]) -> list[list[str]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    rs = await asyncio.gather(
        *[
            client.completions.create(
                model="m", prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}, logprobs=1
            )
            for p in prompts
        ]
    )
    return [r.choices[0].logprobs.tokens for r in rs]


def test_32_concurrent_requests_use_both_replicas_and_match_dp1(dp2, dp1):
    proc, url = dp2
    before = [r["routed"] for r in _replicas(url)]
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + i % 7)] for i in range(32)]
    mine = asyncio.run(_complete_all(url, prompts))
    theirs = asyncio.run(_complete_all(dp1, prompts))
    assert mine == theirs
    after = _replicas(url)
    served = [a["routed"] - b for a, b in zip(after, before)]
    assert sum(served) == 32 and min(served) > 0, served
    assert {r["pid"] for r in after}.isdisjoint({proc.pid}) and len({r["pid"] for r in after}) == 2


def test_shared_prefix_stays_on_one_replica(dp2):
    _, url = dp2
    system = [(13 * j) % 500 + 3 for j in range(160)]  # a long "system prompt" (5 router blocks)
    before = [r["routed"] for r in _replicas(url)]
    hits_before = httpx.get(url + "/get_server_info", timeout=30).json()["prefix_cache_hits"]
    for i in range(6):
        r = httpx.post(
            url + "/v1/completions",
            timeout=120,
            json={"model": "m", "prompt": system + [i + 3, i + 4], "max_tokens": 2, "temperature": 0},
        )
        assert r.status_code == 200, r.text
    served = [r["routed"] - b for r, b in zip(_replicas(url), before)]
    assert sorted(served) == [0, 6], served
    # the replica's radix cache served the shared prefix to the five that followed the first
    # (engine processes publish their counters a few times a second)
    deadline = time.monotonic() + 10
    while (hits := httpx.get(url + "/get_server_info", timeout=30).json()["prefix_cache_hits"] - hits_before) < 750:
        assert time.monotonic() < deadline, hits
        time.sleep(0.1)


def test_killed_replica_fails_its_clients_and_is_restarted(model_dir):
    """The killed replica's clients get an error at once; the other replica's go on and new
    requests are served meanwhile (``/health``: 200 ``degraded``); the replica comes back with a
    new process and the server never stops."""
    args = ["--model-path", model_dir, "--dp-size", "2", "--max-running-requests", "1"]
    proc, url = start_server([*args, *COMMON])
    try:
        clients = LongStreams(url, 12)  # one running per replica and a queue behind it: both busy
        assert clients.started.wait(60)
        # The streams connect one by one (threads) and each lasts under a second: one read of the
        # counts could fall between two of a replica's streams (it saw 0 once), so read again (a
        # loaded machine answers the reads slowly: the bound is generous, the loop usually ends at once)
        deadline = time.monotonic() + 30
        while (busy := max(_replicas(url), key=lambda r: r["outstanding"]))["outstanding"] < 1:
            assert time.monotonic() < deadline, "no replica had a request outstanding"
            time.sleep(0.02)
        rank, pid = busy["rank"], busy["pid"]
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health", timeout=10).json().get("status") != "degraded":
            assert time.monotonic() < deadline, server_log(proc)
            time.sleep(0.1)
        served = httpx.post(
            url + "/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 4}, timeout=60
        )
        assert served.status_code == 200  # by the replica that is up
        clients.join_all(since=killed, within=180)
        failed = [ev for ev in clients.events if any('"error"' in e and f"rank {rank}" in e for e in ev)]
        finished = [ev for ev in clients.events if "data: [DONE]" in ev and not any('"error"' in e for e in ev)]
        assert failed and finished, [ev[-2:] for ev in clients.events]
        deadline = time.monotonic() + 120
        while True:
            back = _replicas(url)[rank]
            if back["alive"] and back["pid"] != pid and httpx.get(url + "/health", timeout=10).json()["status"] == "ok":
                break
            assert time.monotonic() < deadline, server_log(proc)
            time.sleep(0.5)
        assert proc.poll() is None
        log = server_log(proc, tail=10**6)
        assert re.search(rf"engine process \(rank {rank}, pid {pid}\) died: killed by signal 9", log)
        assert f"replica {rank} is back" in log
    finally:
        stop_server(proc)


class _Replica:
    tokenizer, max_context, vocab_size, model_dir = None, 256, 512, "."

    def __init__(self, rank: int) -> None:
        self.rank, self.dead, self.up = rank, None, True

    def alive(self) -> bool:
        return self.up


def test_a_replica_that_keeps_dying_stops_the_server(monkeypatch):
    """Past MAX_RESTARTS deaths within the window the server stops instead of restarting again."""
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.engine.procs import dp_client, process_client

    stops, restarts = [], []
    monkeypatch.setattr(process_client, "stop_server_soon", lambda: stops.append(1))
    client = dp_client.DataParallelClient([_Replica(0), _Replica(1)], 8)
    client.config = EngineConfig(dp_size=2)
    monkeypatch.setattr(client, "_restart", lambda old: restarts.append(old.rank))
    monkeypatch.setattr(
        dp_client.threading, "Thread", lambda target, args, **kw: type("T", (), {"start": lambda self: target(*args)})()
    )
    for _ in range(dp_client.MAX_RESTARTS):
        dead = client.replicas[1]
        dead.up, dead.dead = False, "the engine process (rank 1) died"
        client._replica_died(dead)
        assert client.alive() and client.degraded()
        dead.up = True  # as if restarted
    assert restarts == [1] * dp_client.MAX_RESTARTS and not stops
    client.replicas[1].up = False
    client._replica_died(client.replicas[1])
    assert stops == [1] and client.dead and not client.alive()
