"""Batch leases in the ``local`` and ``s3`` backends: one holder at a time, expiry, takeover,
concurrent claimers (threads over separate handles, and separate processes for ``local``)."""

from __future__ import annotations

import multiprocessing
import uuid

import pytest

from llmkit.core.batches.storage import new_batch_id
from llmkit.plugins.storage.local import LocalStorage
from llmkit.testing.storage import LeaseContract


class TestLocalLeases(LeaseContract):
    @pytest.fixture
    def storage(self, tmp_path):
        s = LocalStorage(str(tmp_path / "root"))
        yield s
        s.close()

    @pytest.fixture
    def replica(self, tmp_path):
        opened = []

        def open_replica():
            opened.append(LocalStorage(str(tmp_path / "root")))
            return opened[-1]

        yield open_replica
        for s in opened:
            s.close()


def _claim_in_process(root: str, batch_id: str, holder: str, barrier, wins) -> None:
    s = LocalStorage(root)
    barrier.wait(timeout=60)
    if s.acquire_lease(batch_id, holder, 30):
        wins.put(holder)
    s.close()


def test_local_claimers_in_separate_processes(tmp_path):
    """Servers sharing a --file-storage-path are processes, each with its own SQLite connection."""
    ctx = multiprocessing.get_context("spawn")
    root, bid, n = str(tmp_path / "root"), new_batch_id(), 4
    LocalStorage(root).close()  # create the schema once, before the race
    barrier, wins = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_claim_in_process, args=(root, bid, f"p{i}", barrier, wins)) for i in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    winners = []
    while not wins.empty():
        winners.append(wins.get(timeout=5))
    assert len(winners) == 1, winners


class TestS3Leases(LeaseContract):
    @pytest.fixture(scope="class")
    def endpoint(self):
        pytest.importorskip("boto3")
        pytest.importorskip("moto.server")
        from s3_utils import make_bucket, moto_endpoint

        with moto_endpoint() as url:
            make_bucket(url, "llmkit-leases")
            yield url

    @pytest.fixture
    def prefix(self):
        return f"l-{uuid.uuid4().hex}/"

    @pytest.fixture
    def replica(self, endpoint, prefix):
        from llmkit.plugins.storage.s3 import S3Storage

        opened = []

        def open_replica():
            opened.append(S3Storage("llmkit-leases", prefix=prefix, endpoint_url=endpoint))
            return opened[-1]

        yield open_replica
        for s in opened:
            s.close()

    @pytest.fixture
    def storage(self, replica):
        return replica()
