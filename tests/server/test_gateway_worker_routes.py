"""What SGLang's Model Gateway (sglang-router 0.3) calls on a worker, answered as an SGLang worker
answers it; found by running the gateway in front of llmkit (see tests/server/test_gateway_e2e.py)."""

from __future__ import annotations

import pytest

# The body the gateway forwards for `client.responses.create(model=..., input="hi",
# max_output_tokens=5)`: its own defaults and SGLang's sampling extensions added, stream null.
GATEWAY_RESPONSES_BODY = {
    "input": "hi",
    "max_output_tokens": 5,
    "model": "m",
    "store": True,
    "stream": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "priority": 0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def test_responses_take_the_gateways_body(fake_server):
    r = fake_server.http().post("/v1/responses", json=GATEWAY_RESPONSES_BODY)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "response"


def test_responses_refuse_a_priority_they_cannot_honour(fake_server):
    r = fake_server.http().post("/v1/responses", json={**GATEWAY_RESPONSES_BODY, "priority": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_responses_check_sglang_sampling(fake_server):
    r = fake_server.http().post("/v1/responses", json={**GATEWAY_RESPONSES_BODY, "top_k": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"


def test_registration_info_under_both_names(fake_server):
    http = fake_server.http()
    for new, old in (("/server_info", "/get_server_info"), ("/model_info", "/get_model_info")):
        a, b = http.get(new), http.get(old)
        assert a.status_code == b.status_code == 200
        assert a.json().keys() == b.json().keys()
    assert http.get("/model_info").json()["is_generation"] is True


def test_get_load_is_sglangs_per_rank_list(fake_server):
    loads = fake_server.http().get("/get_load").json()
    assert isinstance(loads, list) and len(loads) == 1
    assert set(loads[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    assert all(isinstance(v, int) for v in loads[0].values())


def test_load_report_counts_requests_and_kv_tokens():
    from llmkit.core.server.sglang.load import load_report

    stats = {"num_running_reqs": 3, "num_waiting_reqs": 2, "kv_pages_in_use": 5, "page_size": 16}
    assert load_report(stats) == [{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 80}]


def test_flush_cache_drops_the_prefix_cache(fake_server):
    http = fake_server.http()
    before = getattr(fake_server.engine, "flushes", 0)
    for method in (http.post, http.get):  # SGLang takes both
        r = method("/flush_cache")
        assert r.status_code == 200 and r.text.startswith("Cache flushed")
    assert fake_server.engine.flushes == before + 2


@pytest.fixture(autouse=True)
def _serving(fake_server):
    """The in-process server is shared by the session: a test before this file may have run its
    lifespan's shutdown, which leaves its engine marked draining (every request a 503)."""
    fake_server.engine.draining = False
