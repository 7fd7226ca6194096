"""The ``local`` storage backend: the shared contract plus on-disk properties."""

from __future__ import annotations

import os
import stat

import pytest

from llmkit.core.batches.storage import FileTooLargeError, new_file_id, open_storage
from llmkit.plugins.storage.local import LocalStorage
from llmkit.testing.storage import StorageContract


class TestLocalContract(StorageContract):
    @pytest.fixture
    def storage(self, tmp_path):
        s = LocalStorage(str(tmp_path / "root"))
        yield s
        s.close()


def test_registered_as_local_plugin(tmp_path):
    s = open_storage("local", {"path": str(tmp_path / "r")})
    assert isinstance(s, LocalStorage)
    s.close()


def test_permissions_and_layout(tmp_path):
    s = LocalStorage(str(tmp_path / "root"))
    fid = new_file_id()
    s.write_blob(fid, [b"data"])
    assert stat.S_IMODE(os.stat(s.root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(s.root / "blobs" / fid).st_mode) == 0o600
    assert os.listdir(s.root / "tmp") == []
    s.close()


def test_oversize_write_leaves_no_temp_file(tmp_path):
    s = LocalStorage(str(tmp_path / "root"))
    with pytest.raises(FileTooLargeError):
        s.write_blob(new_file_id(), [b"x" * 10] * 10, max_bytes=50)
    assert os.listdir(s.root / "tmp") == [] and os.listdir(s.root / "blobs") == []
    s.close()


def test_state_survives_reopen(tmp_path):
    from llmkit.core.batches.storage import BatchResult, FileRecord, new_batch_id

    s = LocalStorage(str(tmp_path / "root"))
    rec = FileRecord(new_file_id(), 4, 1, "x.jsonl", "batch")
    s.write_blob(rec.id, [b"abcd"])
    s.put_file(rec)
    bid = new_batch_id()
    s.put_result(bid, BatchResult(0, "output", "{}"))
    s.close()
    (s.root / "tmp" / "w-leftover").write_bytes(b"crash debris")
    s2 = LocalStorage(str(tmp_path / "root"))
    assert s2.get_file(rec.id) == rec
    assert b"".join(s2.read_blob(rec.id)) == b"abcd"
    assert s2.result_indices(bid) == {0: "output"}
    assert os.listdir(s2.root / "tmp") == []
    s2.close()
