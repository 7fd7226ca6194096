"""The batch lease with real servers: two ``llmkit serve`` replicas on 127.0.0.1 sharing one
``--file-storage-path``, driven with the openai client. A batch runs exactly once: replicas racing
for it, a cancel through the replica not running it, and the holder killed with kill -9 mid-batch
(the other takes it over and finishes it, every line answered exactly once).

The local tests share one pair of servers and run in file order; the last of them kills replica A.
The s3 test starts a pair of its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

from llmkit.core.batches.storage import BatchRecord, FileRecord, new_batch_id, new_file_id
from llmkit.plugins.storage.local import LocalStorage

from server_utils import kill_server, server_log, start_server, stop_server
from tests.batches.test_batches_e2e import output_ids, requests_jsonl, submit, wait_for

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

LEASE_TTL = 3  # renewed every second; a dead holder's batches are taken over within about 6 s


class Replica:
    def __init__(self, proc, base_url: str) -> None:
        self.proc, self.base_url = proc, base_url
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)

    def log(self) -> str:
        return server_log(self.proc, tail=10_000_000)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("shared-storage")


@contextmanager
def two_replicas(storage_args: list[str], env: dict[str, str] | None = None) -> Iterator[list[Replica]]:
    args = [*storage_args, "--batch-lease-ttl", str(LEASE_TTL), "--skip-server-warmup"]
    with cf.ThreadPoolExecutor(2) as pool:  # the two load their model side by side
        futures = [pool.submit(start_server, args, env=env) for _ in range(2)]
        started = []
        try:
            for f in futures:
                started.append(Replica(*f.result(timeout=400)))
        except Exception:
            for f in futures:
                if f.done() and f.exception() is None:
                    stop_server(f.result()[0])
            raise
    try:
        yield started
    finally:
        for r in started:
            stop_server(r.proc)


@pytest.fixture(scope="module")
def replicas(store):
    with two_replicas(["--batch-storage", "local", "--file-storage-path", str(store)]) as started:
        yield started


@pytest.fixture(scope="module")
def model(replicas):
    return replicas[0].client.models.list().data[0].id


def _claimed_by(replicas, batch_id: str) -> list[int]:
    return [i for i, r in enumerate(replicas) if f"batch {batch_id}: claimed" in r.log()]


def test_replicas_racing_for_a_batch_run_it_once(replicas, store, model):
    """A batch no replica holds (left by a server without leases): both replicas' scans try to
    claim it; exactly one runs it."""
    n = 8
    data = requests_jsonl(n, model, max_tokens=4)
    s = LocalStorage(str(store))
    try:
        fid = new_file_id()
        s.write_blob(fid, [data])
        s.put_file(FileRecord(fid, len(data), int(time.time()), "in.jsonl", "batch"))
        now = int(time.time())
        rec = BatchRecord(new_batch_id(), "/v1/chat/completions", fid, "24h", now, now + 86400)
        rec.pinned_input_id, rec.created_ns = new_file_id(), time.time_ns()
        s.put_batch(rec)
    finally:
        s.close()
    a, b = replicas
    done = wait_for(b.client, rec.id, timeout=300)
    assert done.status == "completed", done
    assert done.request_counts.total == done.request_counts.completed == n and done.request_counts.failed == 0
    assert sorted(output_ids(a.client, done)) == sorted(f"request-{i}" for i in range(n))  # each exactly once
    assert len(_claimed_by(replicas, rec.id)) == 1


def test_cancel_through_b_reaches_the_run_on_a(replicas, model):
    a, b = replicas
    # Long answers: the whole batch takes tens of seconds, the cancel reaches A within about 2 s.
    # (Short ones let a fast engine finish all 40 before A's next lease round sees the cancel.)
    _, batch = submit(a.client, requests_jsonl(40, model, max_tokens=256, long=True))
    deadline = time.time() + 300
    while (seen := b.client.batches.retrieve(batch.id)).request_counts.completed < 1:
        assert seen.status in ("validating", "in_progress") and time.time() < deadline, seen
        time.sleep(0.3)
    assert batch.id in [x.id for x in b.client.batches.list()]
    cancelled = b.client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling"
    assert b.client.batches.retrieve(batch.id).status in ("cancelling", "cancelled")  # never in_progress again
    done = wait_for(b.client, batch.id, timeout=120)
    assert done.status == "cancelled" and done.cancelled_at and done.request_counts.completed < 40
    assert a.client.batches.retrieve(batch.id).status == "cancelled"
    assert f"batch {batch.id}: cancel asked through another replica" in a.log()
    assert f"batch {batch.id}: cancelling" not in b.log()  # b never ran it


def test_holder_killed_mid_batch_the_other_finishes_it(replicas, model):
    _kill_the_holder(replicas, model)


def test_holder_killed_mid_batch_on_s3():
    """The same with the replicas sharing an S3 bucket (moto's server on loopback)."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    from s3_utils import FAKE_CREDENTIALS, make_bucket, moto_endpoint

    with moto_endpoint() as url:
        make_bucket(url, "llmkit-lease-e2e")
        options = ["bucket=llmkit-lease-e2e", f"endpoint_url={url}", "prefix=lease/"]
        args = ["--batch-storage", "s3", *(x for o in options for x in ("--storage-option", o))]
        with two_replicas(args, env=FAKE_CREDENTIALS) as pair:
            _kill_the_holder(pair, pair[0].client.models.list().data[0].id)


def _kill_the_holder(replicas, model: str) -> None:
    a, b = replicas
    n = 24
    _, batch = submit(a.client, requests_jsonl(n, model, max_tokens=8))
    deadline = time.time() + 300
    while (seen := a.client.batches.retrieve(batch.id)).request_counts.completed < 4:
        assert seen.status in ("validating", "in_progress") and time.time() < deadline, seen
        time.sleep(0.2)
    kill_server(a.proc)  # kill -9: its lease is neither renewed nor released
    assert seen.status == "in_progress" and seen.request_counts.completed < n
    done = wait_for(b.client, batch.id, timeout=300)
    assert done.status == "completed", done
    assert done.request_counts.total == n and done.request_counts.completed + done.request_counts.failed == n
    assert sorted(output_ids(b.client, done)) == sorted(f"request-{i}" for i in range(n))  # each exactly once
    assert f"batch {batch.id}: claimed" in b.log()
