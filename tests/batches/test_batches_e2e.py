"""Batches end to end: a real ``llmkit serve`` subprocess, the embedded model, the openai client.

The seed notebook cells run as written, except that ``model`` is the served model's name (the
notebooks' server served the model they name). Durability: kill -9 mid-batch, restart on the same
storage (local and s3), every custom_id exactly once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

import pytest


def _serve_has_batches() -> bool:
    """``llmkit serve`` exists and takes ``--batch-storage`` (cheap: the CLI never imports torch)."""
    if importlib.util.find_spec("llmkit.cli.serve") is None:
        return False
    import typer

    from llmkit.cli.main import app

    serve = typer.main.get_command(app).commands.get("serve")  # type: ignore[attr-defined]
    return serve is not None and any("--batch-storage" in p.opts for p in serve.params)


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _serve_has_batches(), reason="llmkit serve has no --batch-storage yet"),
]
openai = pytest.importorskip("openai")

from server_utils import kill_server, start_server, stop_server  # noqa: E402

FINISHED = ("completed", "failed", "cancelled", "expired")


def requests_jsonl(
    n: int, model: str, *, max_tokens: int = 50, url: str = "/chat/completions", long: bool = False
) -> bytes:
    lines = []
    for i in range(n):
        if url.endswith("/completions") and "chat" not in url:
            body = {"model": model, "prompt": f"{i}: Once upon a time", "max_tokens": max_tokens}
        else:
            msgs = (
                [
                    {"role": "system", "content": f"{i}: You are a helpful AI assistant"},
                    {"role": "user", "content": "Write a detailed story about topic. Make it very long."},
                ]
                if long
                else [{"role": "user", "content": f"Say the number {i}."}]
            )
            body = {"model": model, "messages": msgs, "max_tokens": max_tokens}
        lines.append(json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": url, "body": body}))
    return ("\n".join(lines) + "\n").encode()


def submit(client, data: bytes, endpoint: str = "/v1/chat/completions"):
    f = client.files.create(file=("batch_requests.jsonl", data), purpose="batch")
    return f, client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")


def wait_for(client, batch_id: str, timeout: float = 600, until=FINISHED):
    deadline = time.time() + timeout
    while (b := client.batches.retrieve(batch_id)).status not in until:
        assert time.time() < deadline, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.5)
    return b


def output_ids(client, batch) -> list[str]:
    ids = []
    for fid in (batch.output_file_id, batch.error_file_id):
        if fid:
            ids += [json.loads(x)["custom_id"] for x in client.files.content(fid).read().splitlines() if x.strip()]
    return ids


@pytest.fixture(scope="module")
def model(server):
    return server.client.models.list().data[0].id


def test_seed_cell_chat_batch(server, model):
    client = server.client
    data = b"".join(
        json.dumps(
            {
                "custom_id": f"request-{i + 1}",
                "method": "POST",
                "url": "/chat/completions",
                "body": {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 50},
            }
        ).encode()
        + b"\n"
        for i, q in enumerate(["Tell me a joke about programming", "What is Python?"])
    )
    _, batch = submit(client, data)
    batch = wait_for(client, batch.id)
    assert batch.status == "completed"
    assert batch.request_counts.completed == batch.request_counts.total == 2 and batch.request_counts.failed == 0
    results = [
        json.loads(x) for x in client.files.content(batch.output_file_id).read().decode().split("\n") if x.strip()
    ]
    assert [r["custom_id"] for r in results] == ["request-1", "request-2"]
    body = results[0]["response"]["body"]
    assert results[0]["response"]["status_code"] == 200 and isinstance(body["choices"], list)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    assert client.files.delete(batch.output_file_id).deleted


def test_completions_endpoint_batch(server, model):
    client = server.client
    f, batch = submit(client, requests_jsonl(3, model, max_tokens=8, url="/v1/completions"), "/v1/completions")
    batch = wait_for(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    body = json.loads(client.files.content(batch.output_file_id).read().splitlines()[0])["response"]["body"]
    assert body["object"] == "text_completion" and isinstance(body["choices"], list)
    assert client.files.delete(f.id).deleted and client.files.delete(batch.output_file_id).deleted


def test_seed_cell_status_checks(server, model):
    client = server.client
    f, batch = submit(client, requests_jsonl(100, model, max_tokens=500, long=True))
    try:
        time.sleep(2)  # the notebook's waits (10 s, then 3 s) shortened: the calls are what matter
        for _ in range(5):
            d = client.batches.retrieve(batch_id=batch.id)
            assert d.status in ("validating", "in_progress", "finalizing", "completed")
            assert d.request_counts.total in (0, 100) and d.input_file_id == f.id
            time.sleep(0.5)
        assert d.request_counts.total == 100
    finally:
        client.batches.cancel(batch.id)  # leave the server idle for the next test
        wait_for(client, batch.id)


def test_seed_cell_cancel_500(server, model):
    client = server.client
    f, batch = submit(client, requests_jsonl(500, model, max_tokens=500, long=True))
    time.sleep(2)  # the notebook waits 10 s
    cancelled = client.batches.cancel(batch_id=batch.id)
    assert cancelled.status == "cancelling"
    cancelled = wait_for(client, batch.id, timeout=120, until=("failed", "cancelled"))
    assert cancelled.status == "cancelled" and cancelled.cancelled_at
    assert cancelled.request_counts.completed < 500
    assert client.batches.cancel(batch.id).status == "cancelled"  # sticky, no 5xx
    assert client.files.delete(f.id).deleted


def _kill_and_resume(args: list[str], env: dict[str, str] | None = None) -> None:
    n_lines = 60  # killed after 10: enough lines left in flight and queued to resume
    # The restarted server is a new lease holder: it takes the batch over once the killed one's
    # lease expires (a short one here).
    args = [*args, "--batch-lease-ttl", "3"]
    proc, base = start_server(args, env=env)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x")
        model = client.models.list().data[0].id
        _, batch = submit(client, requests_jsonl(n_lines, model, max_tokens=8))
        deadline = time.time() + 300
        while (b := client.batches.retrieve(batch.id)).request_counts.completed < 10:
            assert b.status in ("validating", "in_progress") and time.time() < deadline, b
            time.sleep(0.2)
    finally:
        kill_server(proc)
    assert b.status == "in_progress" and b.request_counts.completed < n_lines
    proc, base = start_server(args, env=env)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x")
        done = wait_for(client, batch.id)
        assert done.status == "completed" and done.request_counts.total == n_lines
        assert done.request_counts.completed + done.request_counts.failed == n_lines
        ids = output_ids(client, done)
        assert sorted(ids) == sorted(f"request-{i}" for i in range(n_lines))  # each exactly once
    finally:
        stop_server(proc)


def test_kill9_resume_local(tmp_path):
    _kill_and_resume(["--batch-storage", "local", "--file-storage-path", str(tmp_path / "store")])


def test_kill9_resume_s3(tmp_path):
    from s3_utils import FAKE_CREDENTIALS, make_bucket, moto_endpoint

    with moto_endpoint() as url:
        make_bucket(url, "llmkit-e2e")
        _kill_and_resume(
            [
                "--batch-storage",
                "s3",
                "--storage-option",
                "bucket=llmkit-e2e",
                "--storage-option",
                f"endpoint_url={url}",
                "--storage-option",
                "prefix=e2e/",
            ],
            env=FAKE_CREDENTIALS,
        )


def test_third_party_storage_plugin(tmp_path):
    from storage_plugin_utils import install_memstore

    site = install_memstore(tmp_path)
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    proc, base = start_server(["--batch-storage", "memstore"], env=env)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x")
        model = client.models.list().data[0].id
        _, batch = submit(client, requests_jsonl(3, model, max_tokens=4))
        done = wait_for(client, batch.id)
        assert done.status == "completed" and sorted(output_ids(client, done)) == [f"request-{i}" for i in range(3)]
    finally:
        stop_server(proc)
