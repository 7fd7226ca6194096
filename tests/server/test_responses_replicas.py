"""Background responses seen from another replica sharing the storage (behind a gateway, a poll
lands on any replica): one running elsewhere is reported as running, not lost; one whose process
stopped beating is failed; a cancel or delete that cannot reach it says so."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi.testclient import TestClient

from llmkit.core.server.responses import routes
from llmkit.plugins.storage.local import LocalStorage

from fake_engine import fake_app

BODY = {"model": "m", "input": "hi", "max_output_tokens": 40, "background": True}


@pytest.fixture
def replicas(tmp_path, monkeypatch):
    monkeypatch.setattr(routes, "BEAT_S", 0.05)
    storage = LocalStorage(str(tmp_path))
    a, b = fake_app(storage=storage), fake_app(storage=storage)
    engine = a.state.llmkit.client
    plain = engine.generate

    async def slow(req):  # about 2 s for 40 tokens: long enough to be seen running
        async for out in plain(req):
            await asyncio.sleep(0.05)
            yield out

    engine.generate = slow
    with TestClient(a) as ha, TestClient(b) as hb:
        yield ha, hb


def _status(http, rid: str) -> str:
    r = http.get(f"/v1/responses/{rid}")
    assert r.status_code == 200, r.text
    return r.json()["status"]


def test_a_response_running_on_one_replica_is_running_on_the_other(replicas):
    ha, hb = replicas
    rid = ha.post("/v1/responses", json=BODY).json()["id"]
    time.sleep(0.5)  # a few beats
    assert _status(hb, rid) == "in_progress"
    for r in (hb.post(f"/v1/responses/{rid}/cancel"), hb.delete(f"/v1/responses/{rid}")):
        assert r.status_code == 409 and r.json()["error"]["param"] == "response_id", r.text
    deadline = time.monotonic() + 30
    while _status(ha, rid) == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert _status(hb, rid) in ("completed", "incomplete")


def test_a_response_whose_runner_stopped_beating_is_failed(replicas, monkeypatch):
    ha, hb = replicas
    rid = ha.post("/v1/responses", json=BODY).json()["id"]
    time.sleep(0.3)
    monkeypatch.setattr(routes, "STALE_S", 0.0)  # every beat is old now: its process looks dead
    got = hb.get(f"/v1/responses/{rid}").json()
    assert got["status"] == "failed" and "restarted" in got["error"]["message"]
