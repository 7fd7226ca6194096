"""The lease behaviour every storage backend that stores leases must have. Reuse it like
``storage_contract``; the class needs two fixtures: ``storage`` and ``replica`` (a callable
opening another handle on the same store, as a second server would)."""

from __future__ import annotations

import threading
import time

import pytest

from llmkit.core.batches.storage import NotFoundError, new_batch_id

TTL = 0.5  # short, so expiry is tested in real time


class LeaseContract:
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
        assert storage.acquire_lease(bid, "a", TTL)
        assert not other.acquire_lease(bid, "b", 30)
        time.sleep(TTL + 0.1)
        assert other.acquire_lease(bid, "b", 30)
        assert not storage.renew_lease(bid, "a", 30) and not storage.acquire_lease(bid, "a", 30)
        assert other.renew_lease(bid, "b", 30)

    def test_renewal_keeps_it(self, storage, replica):
        other, bid = replica(), new_batch_id()
        assert storage.acquire_lease(bid, "a", TTL)
        for _ in range(3):
            time.sleep(TTL / 2)
            assert storage.renew_lease(bid, "a", TTL)
            assert not other.acquire_lease(bid, "b", TTL)

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
