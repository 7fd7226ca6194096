"""The behaviour every storage backend (``llmkit_register_storage_backends``) must have, as test
classes to subclass in a pytest suite. :class:`StorageContract` needs a ``storage`` fixture (a fresh,
empty backend)::

    import pytest
    from llmkit.testing.storage import StorageContract

    class TestMyStorage(StorageContract):
        @pytest.fixture
        def storage(self, tmp_path):
            return MyStorage(...)

A backend that stores leases (``stores_leases``) subclasses :class:`LeaseContract` too, which also
needs ``replica``: a callable opening another handle on the same store, as a second server would.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from llmkit.core.batches.storage import (
    BatchRecord,
    BatchResult,
    FileRecord,
    FileTooLargeError,
    NotFoundError,
    new_batch_id,
    new_file_id,
)

BAD_IDS = [
    "",
    "file-",
    "file-../../etc/passwd",
    "../x",
    "file-" + "A" * 32,
    "file-" + "0" * 31,
    "file-" + "0" * 32 + "\x00",
    "/abs/file-" + "0" * 32,
    "file-" + "0" * 32 + "/..",
    7,
    None,
]


def _batch(i: int = 0, status: str = "validating") -> BatchRecord:
    return BatchRecord(
        id=new_batch_id(),
        endpoint="/v1/chat/completions",
        input_file_id=new_file_id(),
        completion_window="24h",
        created_at=1000 + i,
        expires_at=90000,
        status=status,
    )


class StorageContract:
    def test_blob_roundtrip_streams(self, storage):
        fid = new_file_id()
        chunks = [b"a" * 100_000, b"b" * 3, b"", b"c\n"]
        assert storage.write_blob(fid, iter(chunks)) == 100_005
        assert b"".join(storage.read_blob(fid)) == b"".join(chunks)
        assert storage.write_blob(fid, [b"new"]) == 3  # replace
        assert b"".join(storage.read_blob(fid)) == b"new"
        assert storage.delete_blob(fid) is True
        assert storage.delete_blob(fid) is False
        with pytest.raises(NotFoundError):
            b"".join(storage.read_blob(fid))

    def test_blob_size_cap_leaves_nothing(self, storage):
        fid = new_file_id()
        with pytest.raises(FileTooLargeError):
            storage.write_blob(fid, (b"x" * 1000 for _ in range(20)), max_bytes=5000)
        with pytest.raises(NotFoundError):
            b"".join(storage.read_blob(fid))

    def test_failing_source_leaves_old_blob(self, storage):
        fid = new_file_id()
        storage.write_blob(fid, [b"old"])

        def broken():
            yield b"partial"
            raise RuntimeError("source failed")

        with pytest.raises(RuntimeError):
            storage.write_blob(fid, broken())
        assert b"".join(storage.read_blob(fid)) == b"old"

    @pytest.mark.parametrize("bad", BAD_IDS)
    def test_malformed_ids_are_not_found(self, storage, bad):
        for call in (
            lambda: storage.get_file(bad),
            lambda: storage.read_blob(bad),
            lambda: storage.delete_blob(bad),
            lambda: storage.write_blob(bad, [b"x"]),
            lambda: storage.get_batch(bad),
            lambda: storage.delete_file(bad),
            lambda: storage.result_indices(bad),
        ):
            with pytest.raises(NotFoundError):
                call()

    def test_file_records(self, storage):
        a = FileRecord(new_file_id(), 10, 100, "a.jsonl", "batch")
        b = FileRecord(new_file_id(), 20, 200, "b.jsonl", "batch_output")
        storage.put_file(a)
        storage.put_file(b)
        assert storage.get_file(a.id) == a
        assert [r.id for r in storage.list_files()] == [b.id, a.id]
        assert [r.id for r in storage.list_files(purpose="batch")] == [a.id]
        assert storage.delete_file(a.id) is True
        assert storage.delete_file(a.id) is False
        with pytest.raises(NotFoundError):
            storage.get_file(a.id)
        with pytest.raises(NotFoundError):
            storage.get_file(new_file_id())

    def test_batch_records(self, storage):
        old, new = _batch(0), _batch(1, status="completed")
        old.metadata = {"k": "v"}
        old.errors = [{"code": "x", "message": "m", "param": None, "line": 3}]
        storage.put_batch(old)
        storage.put_batch(new)
        assert storage.get_batch(old.id) == old
        assert [r.id for r in storage.list_batches()] == [new.id, old.id]
        assert [r.id for r in storage.list_batches(statuses={"validating", "in_progress"})] == [old.id]
        assert storage.list_batches(statuses=[]) == []
        old.status = "in_progress"
        old.request_counts["completed"] = 5
        storage.put_batch(old)
        assert storage.get_batch(old.id).request_counts["completed"] == 5
        json.dumps(storage.get_batch(old.id).to_openai())  # JSON-clean

    def test_owners_round_trip_and_stay_private(self, storage):
        f = FileRecord(new_file_id(), 10, 100, "a.jsonl", "batch", owner="alice")
        b = _batch()
        b.owner = "key-0123456789abcdef"
        storage.put_file(f)
        storage.put_batch(b)
        assert storage.get_file(f.id).owner == "alice" and storage.list_files()[0].owner == "alice"
        assert storage.get_batch(b.id).owner == b.owner and storage.list_batches()[0].owner == b.owner
        assert "owner" not in f.to_openai() and "owner" not in b.to_openai()

    def test_results_first_write_wins_and_order(self, storage):
        bid = new_batch_id()
        for i in (5, 0, 12, 3):
            kind = "error" if i == 3 else "output"
            assert storage.put_result(bid, BatchResult(i, kind, f'{{"i": {i}}}')) is True
        assert storage.put_result(bid, BatchResult(5, "error", "dup")) is False
        assert storage.result_indices(bid) == {0: "output", 3: "error", 5: "output", 12: "output"}
        assert [r.index for r in storage.iter_results(bid)] == [0, 3, 5, 12]
        assert [r.line for r in storage.iter_results(bid, "output")] == ['{"i": 0}', '{"i": 5}', '{"i": 12}']
        assert [r.index for r in storage.iter_results(bid, "error")] == [3]
        storage.delete_results(bid)
        assert storage.result_indices(bid) == {}
        assert list(storage.iter_results(bid)) == []

    def test_concurrent_writes_are_consistent(self, storage):
        bid = new_batch_id()
        rec = _batch()
        errors: list[Exception] = []

        def work(n: int) -> None:
            try:
                for i in range(10):
                    storage.put_result(bid, BatchResult(n * 10 + i, "output", "{}"))
                    rec.request_counts["completed"] = i
                    storage.put_batch(rec)
                    storage.get_batch(rec.id)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert len(storage.result_indices(bid)) == 40

    def test_keyed_records(self, storage):
        key = "resp_" + "ab" * 16
        data = {"id": key, "output": [{"text": "héllo"}], "n": 3}
        storage.put_record("response", key, data)
        assert storage.get_record("response", key) == data
        storage.put_record("response", key, {**data, "n": 4})  # replace
        assert storage.get_record("response", key)["n"] == 4
        with pytest.raises(NotFoundError):
            storage.get_record("other", key)  # kinds are separate namespaces
        assert storage.delete_record("response", key) is True
        assert storage.delete_record("response", key) is False
        with pytest.raises(NotFoundError):
            storage.get_record("response", key)

    @pytest.mark.parametrize(
        "kind,key",
        [
            ("response", "../x"),
            ("response", ""),
            ("response", "a/b"),
            ("Response", "k"),
            ("../r", "k"),
            ("response", "k" * 129),
            ("response", None),
            (7, "k"),
        ],
    )
    def test_malformed_record_keys_are_not_found(self, storage, kind, key):
        with pytest.raises(NotFoundError):
            storage.put_record(kind, key, {})
        with pytest.raises(NotFoundError):
            storage.get_record(kind, key)
        with pytest.raises(NotFoundError):
            storage.delete_record(kind, key)


LEASE_TTL = 0.5  # short, so expiry is tested in real time


class LeaseContract:
    """Leases: one holder at a time across handles on the same store, taken over once expired."""

    def test_stores_leases(self, storage):
        assert storage.stores_leases

    def test_one_holder_until_released(self, storage, replica):
        other, bid = replica(), new_batch_id()
        assert storage.acquire_lease(bid, "a", 30)
        assert not other.acquire_lease(bid, "b", 30) and not storage.acquire_lease(bid, "a", 30)
        assert storage.renew_lease(bid, "a", 30) and not other.renew_lease(bid, "b", 30)
        other.release_lease(bid, "b")  # not b's: changes nothing
        assert not other.acquire_lease(bid, "b", 30)
        storage.release_lease(bid, "a")
        assert other.acquire_lease(bid, "b", 30)
        assert not storage.renew_lease(bid, "a", 30)  # a late renewal by the old holder fails

    def test_expired_lease_is_taken_over(self, storage, replica):
        other, bid = replica(), new_batch_id()
        assert storage.acquire_lease(bid, "a", LEASE_TTL)
        assert not other.acquire_lease(bid, "b", 30)
        time.sleep(LEASE_TTL + 0.1)
        assert other.acquire_lease(bid, "b", 30)
        assert not storage.renew_lease(bid, "a", 30) and not storage.acquire_lease(bid, "a", 30)
        assert other.renew_lease(bid, "b", 30)

    def test_renewal_keeps_it(self, storage, replica):
        other, bid = replica(), new_batch_id()
        assert storage.acquire_lease(bid, "a", LEASE_TTL)
        for _ in range(3):
            time.sleep(LEASE_TTL / 2)
            assert storage.renew_lease(bid, "a", LEASE_TTL)
            assert not other.acquire_lease(bid, "b", LEASE_TTL)

    def test_no_renewal_without_a_lease(self, storage):
        assert not storage.renew_lease(new_batch_id(), "a", 30)
        storage.release_lease(new_batch_id(), "a")  # nothing to release: no error

    @pytest.mark.parametrize("expired_first", [False, True])
    def test_concurrent_claimers_one_wins(self, storage, replica, expired_first):
        n = 6
        handles = [replica() for _ in range(n)]
        for _ in range(5):
            bid = new_batch_id()
            if expired_first:  # the race is a takeover of a dead holder's lease
                assert storage.acquire_lease(bid, "dead", 0.01)
                time.sleep(0.05)
            barrier, wins = threading.Barrier(n), []

            def claim(i: int) -> None:
                barrier.wait(timeout=30)
                if handles[i].acquire_lease(bid, f"h{i}", 30):
                    wins.append(i)

            threads = [threading.Thread(target=claim, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert len(wins) == 1, wins
            winner = wins[0]
            assert handles[winner].renew_lease(bid, f"h{winner}", 30)
            assert not any(handles[i].renew_lease(bid, f"h{i}", 30) for i in range(n) if i != winner)

    @pytest.mark.parametrize("bad", ["", "batch_x", "../batch_" + "0" * 32, None])
    def test_malformed_ids(self, storage, bad):
        for call in (storage.acquire_lease, storage.renew_lease):
            with pytest.raises(NotFoundError):
                call(bad, "a", 30)
        with pytest.raises(NotFoundError):
            storage.release_lease(bad, "a")
