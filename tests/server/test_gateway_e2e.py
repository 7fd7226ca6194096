"""Two ``llmkit serve`` workers sharing one storage, behind SGLang's Model Gateway
(``sglang-router``, round robin), driven with the OpenAI SDK through the gateway.

The gateway (0.3) does not route /v1/files, /v1/batches, /v1/messages or /tokenize (it answers 404
itself), nor /v1/responses/{id}/input_items (501): files and batches go to any worker directly, and the shared storage makes them visible
to the others. The last tests kill a worker under load, then start it again.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import json
import time

import openai
import pytest

from llmkit.cli.gateway import healthy_workers

from gateway_utils import start_router
from server_utils import kill_server, server_log, start_server, stop_server

pytest.importorskip("sglang_router")
pytestmark = pytest.mark.slow

KEY = "gateway-test-key"
HI = [{"role": "user", "content": "Say hi."}]


class Cluster:
    def __init__(self, workers, router, url, worker_args):
        self.workers, self.router, self.url = workers, router, url  # workers: [(proc, base_url)]
        self.worker_args = worker_args  # what each worker was started with

    def client(self, base_url: str | None = None, timeout: float = 60) -> openai.OpenAI:
        return openai.OpenAI(base_url=(base_url or self.url) + "/v1", api_key=KEY, max_retries=0, timeout=timeout)

    def posts(self, path: str) -> list[int]:
        """How many ``POST path`` each worker has logged (uvicorn's access log)."""
        return [server_log(p, tail=10_000_000).count(f'"POST {path} HTTP') for p, _ in self.workers]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    store = tmp_path_factory.mktemp("shared-storage")
    args = ["--file-storage-path", str(store), "--batch-storage", "local", "--api-key", KEY, "--skip-server-warmup"]
    with cf.ThreadPoolExecutor(2) as pool:  # the two load their model side by side
        futures = [pool.submit(start_server, args) for _ in range(2)]
        workers = []
        try:
            for f in futures:
                workers.append(f.result(timeout=300))
        except Exception:
            for f in futures:
                if f.done() and f.exception() is None:
                    stop_server(f.result()[0])
            raise
    router = None
    try:
        router, url = start_router([u for _, u in workers], policy="round_robin", api_key=KEY)
        yield Cluster(workers, router, url, args)
    finally:
        if router is not None:
            stop_server(router, timeout=15)
        for proc, _ in workers:
            stop_server(proc)


def test_chat_streaming_and_completions(cluster):
    c = cluster.client()
    r = c.chat.completions.create(model="m", messages=HI, max_tokens=4)
    assert r.choices[0].message.content
    pieces = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(model="m", messages=HI, max_tokens=4, stream=True)
        if ch.choices
    ]
    assert "".join(pieces)
    assert c.completions.create(model="m", prompt="Hello", max_tokens=4).choices[0].text


def test_the_key_is_required_at_the_gateway(cluster):
    bad = openai.OpenAI(base_url=cluster.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="m", messages=HI, max_tokens=2)


def test_a_response_is_continued_on_the_other_worker(cluster):
    c = cluster.client()
    before = cluster.posts("/v1/responses")
    first = c.responses.create(model="m", input="My name is Ada.", max_output_tokens=4)
    second = c.responses.create(model="m", input="What is my name?", max_output_tokens=4, previous_response_id=first.id)
    after = cluster.posts("/v1/responses")
    # round robin: one hop on each worker, the second finding the first in the shared storage
    assert [a - b for a, b in zip(after, before)] == [1, 1]
    assert second.previous_response_id == first.id
    assert [c.responses.retrieve(r.id).id for r in (first, second)] == [first.id, second.id]
    # the gateway answers input_items with 501 itself; any worker lists them from the storage
    for _, url in cluster.workers:
        assert [i.type for i in cluster.client(url).responses.input_items.list(second.id).data] == ["message"]


def test_a_background_response_polled_through_the_gateway(cluster):
    """Polls land on both workers (round robin): the one not running it reports it running."""
    c = cluster.client()
    r = c.responses.create(model="m", input="Tell a story.", max_output_tokens=32, background=True)
    seen = set()
    deadline = time.monotonic() + 120
    while r.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response never finished"
        time.sleep(0.3)
        r = c.responses.retrieve(r.id)
        seen.add(r.status)
    assert r.status in ("completed", "incomplete") and "failed" not in seen, (r.status, r.error)


def test_a_streamed_response_through_the_gateway(cluster):
    events = list(cluster.client().responses.create(model="m", input="Hi", max_output_tokens=4, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")


def test_files_and_batches_are_shared_across_workers(cluster):
    (_, url_a), (_, url_b) = cluster.workers
    a, b = cluster.client(url_a), cluster.client(url_b)
    lines = [
        {
            "custom_id": f"r-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": HI, "max_tokens": 3},
        }
        for i in range(3)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    f = a.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert b.files.retrieve(f.id).id == f.id
    batch = b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.5)
        batch = a.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    out = [json.loads(x) for x in b.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == ["r-0", "r-1", "r-2"]  # each line answered once
    assert batch.id in [x.id for x in a.batches.list()]


def test_flush_cache_through_the_gateway(cluster):
    import httpx

    r = httpx.post(cluster.url + "/flush_cache", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200 and r.json()["workers_flushed"] == 2, r.text


def test_kill_a_worker_under_load(cluster):
    """Runs last: in-flight requests end (an error or a retried answer) within a bound, none hangs,
    and the gateway sends new requests to the survivor."""
    c = cluster.client(timeout=60)

    def one(i: int) -> str:
        if i % 2:
            stream = c.chat.completions.create(model="m", messages=HI, max_tokens=48, stream=True)
            return "".join((ch.choices[0].delta.content or "") for ch in stream if ch.choices)
        return c.chat.completions.create(model="m", messages=HI, max_tokens=48).choices[0].message.content

    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, i) for i in range(6)]
        time.sleep(1.5)
        kill_server(cluster.workers[1][0])
        done, pending = cf.wait(futures, timeout=90)
        assert not pending, "a request in flight on the killed worker hung"
    for f in done:
        exc = f.exception()
        assert exc is None or isinstance(exc, openai.APIError), repr(exc)  # an error, not a hang

    deadline = time.monotonic() + 30
    while healthy_workers(cluster.url, KEY) != 1:
        assert time.monotonic() < deadline, "the gateway still routes to the dead worker"
        time.sleep(0.5)
    for _ in range(4):
        assert c.chat.completions.create(model="m", messages=HI, max_tokens=3).choices[0].message.content


def test_a_restarted_worker_rejoins(cluster):
    """After the kill above: the same worker started again on its port is routed to again."""
    url = cluster.workers[1][1]
    proc, _ = start_server(cluster.worker_args, port=int(url.rsplit(":", 1)[1]))
    cluster.workers[1] = (proc, url)  # stopped by the fixture
    deadline = time.monotonic() + 60
    while healthy_workers(cluster.url, KEY) != 2:
        assert time.monotonic() < deadline, "the gateway did not take the restarted worker back"
        time.sleep(0.5)
    before = cluster.posts("/v1/chat/completions")
    c = cluster.client()
    for _ in range(2):
        assert c.chat.completions.create(model="m", messages=HI, max_tokens=3).choices[0].message.content
    assert cluster.posts("/v1/chat/completions")[1] > before[1]
