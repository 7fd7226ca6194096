"""The ``s3`` storage backend against moto's standalone S3 server on loopback (no mocks)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from llmkit.testing.storage import StorageContract

from s3_utils import make_bucket, moto_endpoint

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

from llmkit.core.batches.storage import StorageError, open_storage  # noqa: E402
from llmkit.plugins.storage.s3 import S3Storage  # noqa: E402


@pytest.fixture(scope="module")
def endpoint():
    with moto_endpoint() as url:
        make_bucket(url, "llmkit-test")
        yield url


class TestS3Contract(StorageContract):
    @pytest.fixture
    def storage(self, endpoint):
        s = S3Storage("llmkit-test", prefix=f"t-{uuid.uuid4().hex}", endpoint_url=endpoint)
        yield s
        s.close()


def test_registered_and_built_from_options(endpoint):
    s = open_storage("s3", {"bucket": "llmkit-test", "prefix": "x/", "endpoint_url": endpoint})
    assert isinstance(s, S3Storage) and s.prefix == "x/"


def test_bucket_is_required():
    with pytest.raises(StorageError, match="bucket"):
        S3Storage("")


def test_prefixes_isolate_servers(endpoint):
    from llmkit.core.batches.storage import FileRecord, new_file_id

    a = S3Storage("llmkit-test", prefix=f"a-{uuid.uuid4().hex}", endpoint_url=endpoint)
    b = S3Storage("llmkit-test", prefix=f"b-{uuid.uuid4().hex}", endpoint_url=endpoint)
    a.put_file(FileRecord(new_file_id(), 1, 1, "x", "batch"))
    assert b.list_files() == [] and len(a.list_files()) == 1


def test_batch_runs_on_s3(endpoint):
    """A whole batch (upload, validate, run, finalize) with S3 as the storage."""
    from batch_utils import fake_execute, run_batch

    s = S3Storage("llmkit-test", prefix=f"run-{uuid.uuid4().hex}", endpoint_url=endpoint)
    rec, out, err = asyncio.run(run_batch(s, fake_execute, n=12))
    assert rec.status == "completed" and rec.request_counts == {"total": 12, "completed": 12, "failed": 0}
    assert [o["custom_id"] for o in out] == [f"r-{i}" for i in range(12)] and err == []
    assert list(s.iter_results(rec.id)) == []  # results cleaned up after finalizing
