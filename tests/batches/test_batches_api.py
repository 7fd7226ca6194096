"""The Files and Batches HTTP API in a small FastAPI app, driven by the official ``openai`` client."""

from __future__ import annotations

import io
import json
import time

import pytest
from fastapi.testclient import TestClient

from llmkit.plugins.storage.local import LocalStorage

from batch_utils import fake_execute, jsonl, make_app

openai = pytest.importorskip("openai")
BAD_IDS = ["nope", "file-123", "..%2F..%2Fetc%2Fpasswd", "file-" + "0" * 32 + "%00", "x" * 300]


@pytest.fixture
def env(tmp_path):
    storage = LocalStorage(str(tmp_path / "store"))
    with TestClient(make_app(storage, fake_execute)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        yield http, client, storage
    storage.close()


def wait_done(client, batch_id, timeout=20):
    deadline = time.time() + timeout
    while (b := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.time() < deadline, b.status
        time.sleep(0.05)
    return b


@pytest.mark.parametrize(
    "endpoint, url", [("/v1/chat/completions", "/chat/completions"), ("/v1/completions", "/v1/completions")]
)
def test_openai_client_round_trip(env, endpoint, url):
    http, client, _ = env
    if endpoint == "/v1/completions":
        data = b"".join(
            json.dumps(
                {
                    "custom_id": f"r-{i}",
                    "method": "POST",
                    "url": url,
                    "body": {"model": "m", "prompt": "p", "messages": [{"role": "user", "content": f"c{i}"}]},
                }
            ).encode()
            + b"\n"
            for i in range(3)
        )
    else:
        data = jsonl(3, url=url)
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert f.id.startswith("file-") and f.bytes == len(data) and f.purpose == "batch"
    assert client.files.retrieve(f.id).filename == "in.jsonl"
    b = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h", metadata={"k": "v"})
    assert b.status == "validating" and b.request_counts.total == 0 and b.metadata == {"k": "v"}
    b = wait_done(client, b.id)
    assert b.status == "completed" and b.request_counts.completed == 3 and b.request_counts.failed == 0
    out = [json.loads(x) for x in client.files.content(b.output_file_id).read().splitlines()]
    assert [o["custom_id"] for o in out] == ["r-0", "r-1", "r-2"]
    assert isinstance(out[0]["response"]["body"]["choices"], list)
    assert client.files.delete(b.output_file_id).deleted
    assert client.files.delete(f.id).deleted
    assert b.id in [x.id for x in client.batches.list()]


def test_failed_validation_reports_errors(env):
    _, client, _ = env
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(2, url="/v1/completions"))), purpose="batch")
    b = wait_done(
        client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
    )
    assert b.status == "failed" and b.output_file_id is None
    assert [(e.code, e.line, e.param) for e in b.errors.data] == [("invalid_url", 1, "url"), ("invalid_url", 2, "url")]


def test_list_pagination_newest_first(env):
    _, client, _ = env
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(1))), purpose="batch")
    ids = [
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
        for _ in range(3)
    ]
    page = client.batches.list(limit=2)
    assert len(page.data) == 2 and page.has_more
    assert [x.id for x in client.batches.list()] == ids[::-1]
    rest = client.batches.list(limit=2, after=page.data[-1].id)
    assert len(rest.data) == 1 and not rest.has_more
    files = client.files.list().data
    assert f.id in [x.id for x in files] and files == sorted(files, key=lambda x: -x.created_at)


def _err(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in resp.text and "blobs" not in resp.text and "sqlite" not in resp.text
    return body["error"]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_unknown_and_malformed_ids_get_the_same_404(env, bad):
    http, _, _ = env
    unknown = "file-" + "0" * 32
    ref = http.get(f"/v1/files/{unknown}").json()
    for method, path in (("GET", "/v1/files/{}"), ("GET", "/v1/files/{}/content"), ("DELETE", "/v1/files/{}")):
        resp = http.request(method, path.format(bad))
        assert _err(resp, 404) and resp.json() == ref
    bref = http.get("/v1/batches/batch_" + "0" * 32).json()
    assert _err(http.get(f"/v1/batches/{bad}"), 404) and http.get(f"/v1/batches/{bad}").json() == bref
    assert http.post(f"/v1/batches/{bad}/cancel").json() == bref


def test_upload_rejections(env):
    http, _, _ = env
    assert (
        _err(http.post("/v1/files", files={"file": ("a.jsonl", b"")}, data={"purpose": "batch"}), 400)["code"]
        == "empty_file"
    )
    assert (
        _err(http.post("/v1/files", files={"file": ("a.jsonl", b"x")}, data={"purpose": "fine-tune"}), 400)["param"]
        == "purpose"
    )
    assert _err(http.post("/v1/files", files={"file": ("a", b"x" * (2 << 20))}, data={"purpose": "batch"}), 413)
    assert _err(http.post("/v1/files", data={"purpose": "batch"}), 400)["param"] == "file"
    assert _err(http.post("/v1/files", content=b"not multipart", headers={"content-type": "text/plain"}), 400)


def test_create_batch_rejections(env):
    http, client, _ = env
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(1))), purpose="batch")
    ok = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    cases = [
        ({**ok, "endpoint": "/v1/embeddings"}, 400, "endpoint"),
        ({**ok, "completion_window": "48h"}, 400, "completion_window"),
        ({**ok, "input_file_id": "file-" + "1" * 32}, 404, "input_file_id"),
        ({**ok, "input_file_id": "../../etc/passwd"}, 404, "input_file_id"),
        ({**ok, "metadata": {"k": 1}}, 400, "metadata"),
        ({"endpoint": "/v1/chat/completions", "completion_window": "24h"}, 400, "input_file_id"),
    ]
    for body, status, param in cases:
        assert _err(http.post("/v1/batches", json=body), status)["param"] == param
    for raw in (b"{", b"[]", b"null", b"[" * 50_000):
        _err(http.post("/v1/batches", content=raw, headers={"content-type": "application/json"}), 400)
    out = client.batches.retrieve(wait_done(client, client.batches.create(**ok).id).id)
    assert (
        _err(http.post("/v1/batches", json={**ok, "input_file_id": out.output_file_id}), 400)["param"]
        == "input_file_id"
    )


def test_cancel_through_the_api(tmp_path):
    import asyncio

    async def slow(endpoint, body):
        await asyncio.sleep(0.05)
        return await fake_execute(endpoint, body)

    storage = LocalStorage(str(tmp_path / "store"))
    with TestClient(make_app(storage, slow, max_in_flight=2)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(200))), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while client.batches.retrieve(b.id).request_counts.completed < 2:
            time.sleep(0.02)
        c = client.batches.cancel(b.id)
        assert c.status == "cancelling"
        final = wait_done(client, b.id)
        assert final.status == "cancelled" and final.cancelled_at and final.request_counts.completed < 200
        assert client.batches.cancel(b.id).status == "cancelled"
        assert client.files.delete(f.id).deleted
    storage.close()
