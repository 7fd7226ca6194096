"""Two batch runners sharing one store, as two replicas do (in one process, fake executors): each
batch runs on the replica holding its lease, is taken over when that replica dies, and a cancel
through the other replica reaches it. Real servers: test_batch_lease_e2e.py."""

from __future__ import annotations

import asyncio
import collections
import time
import uuid

import pytest

from llmkit.core.batches.runner import BatchRunner
from llmkit.core.batches.storage import BatchRecord, new_batch_id, new_file_id
from llmkit.plugins.storage.local import LocalStorage

from batch_utils import fake_execute, jsonl, read_file, upload

TTL = 0.6  # renewed every 0.2 s; a dead holder's batch is taken over within about 2 x TTL


@pytest.fixture(scope="module")
def s3_endpoint():
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    from s3_utils import make_bucket, moto_endpoint

    with moto_endpoint() as url:
        make_bucket(url, "llmkit-lease")
        yield url


@pytest.fixture(params=["local", "s3"])
def stores(request, tmp_path):
    """Two handles on one store, as two servers have."""
    if request.param == "local":
        a, b = LocalStorage(str(tmp_path / "s")), LocalStorage(str(tmp_path / "s"))
    else:
        from llmkit.plugins.storage.s3 import S3Storage

        url, prefix = request.getfixturevalue("s3_endpoint"), f"{uuid.uuid4().hex}/"
        a, b = (S3Storage("llmkit-lease", prefix=prefix, endpoint_url=url) for _ in range(2))
    yield a, b
    a.close()
    b.close()


def counting(runs: collections.Counter, name: str, delay: float = 0.02):
    async def execute(endpoint, body):
        runs[(name, body["messages"][-1]["content"])] += 1
        await asyncio.sleep(delay)
        return await fake_execute(endpoint, body)

    return execute


async def finished(runner: BatchRunner, batch_id: str, timeout: float = 20.0, poll: float = 0.05) -> BatchRecord:
    deadline = time.monotonic() + timeout
    while (rec := await runner.get(batch_id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, rec
        await asyncio.sleep(poll)
    return rec


def lines_run(runs: collections.Counter) -> collections.Counter:
    per_line: collections.Counter = collections.Counter()
    for (_, line), n in runs.items():
        per_line[line] += n
    return per_line


def test_racing_replicas_run_an_unclaimed_batch_once(stores):
    """A batch left by a server without leases (or whose lease expired): both replicas start at
    once and try to claim it; one runs every line."""
    sa, sb = stores
    fid = upload(sa, jsonl(12))
    rec = BatchRecord(new_batch_id(), "/v1/chat/completions", fid, "24h", 1, 10**10, pinned_input_id=new_file_id())
    sa.put_batch(rec)
    runs: collections.Counter = collections.Counter()

    async def main():
        a = BatchRunner(sa, counting(runs, "a"), lease_ttl=TTL)
        b = BatchRunner(sb, counting(runs, "b"), lease_ttl=TTL)
        await asyncio.gather(a.start(), b.start())
        done = await finished(b, rec.id)
        await asyncio.gather(a.stop(), b.stop())
        return done

    done = asyncio.run(asyncio.wait_for(main(), 60))
    assert done.status == "completed" and done.request_counts == {"total": 12, "completed": 12, "failed": 0}
    assert len({name for name, _ in runs}) == 1  # one replica ran it
    assert set(lines_run(runs).values()) == {1} and len(runs) == 12
    assert [o["custom_id"] for o in read_file(sa, done.output_file_id)] == [f"r-{i}" for i in range(12)]


def test_a_dead_holders_batch_is_taken_over(stores):
    sa, sb = stores
    runs: collections.Counter = collections.Counter()

    async def main():
        a = BatchRunner(sa, counting(runs, "a", delay=0.05), lease_ttl=TTL, max_in_flight=2)
        b = BatchRunner(sb, counting(runs, "b"), lease_ttl=TTL)
        await asyncio.gather(a.start(), b.start())
        rec = await a.create(upload(sa, jsonl(30)), "/v1/chat/completions", "24h")
        while (await a.get(rec.id)).request_counts["completed"] < 5:
            await asyncio.sleep(0.02)
        # "kill -9": a's tasks stop where they are, its lease is neither renewed nor released
        a.leases.release = _never_released
        await a.stop()
        stored_by_a = set(sa.result_indices(rec.id))
        done = await finished(b, rec.id)
        await b.stop()
        return done, stored_by_a

    done, stored_by_a = asyncio.run(asyncio.wait_for(main(), 60))
    assert done.status == "completed" and done.request_counts == {"total": 30, "completed": 30, "failed": 0}
    ran_by_b = {int(line.split()[1]) for name, line in runs if name == "b"}
    assert ran_by_b and not (ran_by_b & stored_by_a)  # an answered line is never run again
    out = [o["custom_id"] for o in read_file(sa, done.output_file_id)]
    assert out == [f"r-{i}" for i in range(30)]  # each exactly once


async def _never_released(batch_id: str) -> None:
    return None


def test_cancel_through_the_other_replica_reaches_the_holder(stores):
    sa, sb = stores
    runs: collections.Counter = collections.Counter()

    async def main():
        a = BatchRunner(sa, counting(runs, "a", delay=0.1), lease_ttl=TTL, max_in_flight=1)
        b = BatchRunner(sb, counting(runs, "b"), lease_ttl=TTL)
        await asyncio.gather(a.start(), b.start())
        rec = await a.create(upload(sa, jsonl(40)), "/v1/chat/completions", "24h")
        while (await b.get(rec.id)).status != "in_progress":
            await asyncio.sleep(0.02)
        cancelling = await b.cancel(rec.id)
        seen = [(await b.get(rec.id)).status, [r.status for r in await b.list()]]
        done = await finished(b, rec.id)
        await asyncio.gather(a.stop(), b.stop())
        return cancelling, seen, done

    cancelling, seen, done = asyncio.run(asyncio.wait_for(main(), 60))
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    stopping = ("cancelling", "cancelled")  # never in_progress, before the holder applies it too
    assert seen[0] in stopping and len(seen[1]) == 1 and seen[1][0] in stopping
    assert done.status == "cancelled" and done.request_counts["completed"] < 40
    assert {name for name, _ in runs} == {"a"}  # b never ran a line
    assert sa.result_indices(done.id) == {}
    with pytest.raises(Exception):
        sa.get_record("batch_cancel", done.id)  # the request is gone with the batch


def test_the_holder_stops_once_its_lease_is_taken(stores):
    """A holder that stalled past its lease finds it taken at its next renewal: it stops running
    the batch and writes nothing more; the new holder finishes it."""
    sa, sb = stores
    runs: collections.Counter = collections.Counter()

    async def main():
        # a's lines are slow enough (4 s in all) that it is still running the batch when b takes it
        # over, however slow the storage is on a loaded machine
        a = BatchRunner(sa, counting(runs, "a", delay=0.2), lease_ttl=TTL, max_in_flight=1)
        b = BatchRunner(sb, counting(runs, "b"), lease_ttl=TTL)
        rec = await a.create(upload(sa, jsonl(20)), "/v1/chat/completions", "24h")
        while (await a.get(rec.id)).request_counts["completed"] < 2:
            await asyncio.sleep(0.02)
        a._maintainer.cancel()  # a stalls: no renewals...
        await asyncio.gather(a._maintainer, return_exceptions=True)
        sb.release_lease(rec.id, a.leases.holder)  # ...and its lease runs out
        await b.start()  # takes it over
        assert rec.id in b._active
        a._ensure_maintainer()  # a wakes up: its next renewal (within a third of TTL) fails
        deadline = time.monotonic() + 10 * TTL  # bounded, with room for a loaded machine
        while rec.id in a._active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert rec.id not in a._active
        done = await finished(b, rec.id)
        await asyncio.gather(a.stop(), b.stop())
        return done

    done = asyncio.run(asyncio.wait_for(main(), 60))
    assert done.status == "completed" and done.request_counts == {"total": 20, "completed": 20, "failed": 0}
    assert [o["custom_id"] for o in read_file(sa, done.output_file_id)] == [f"r-{i}" for i in range(20)]


def test_a_cancelled_batch_leaves_nothing_behind_when_stopped_at_once(stores):
    """A line's result still being stored when the batch is cancelled (the store outlives the
    line's cancellation) lands before the batch ends: it is in the output file and counted. And a
    runner stopped as soon as the batch reads "cancelled" (the server shutting down) still deletes
    its results: CI once found a cancelled batch's line 0 left in the storage."""
    sa, _ = stores
    put_result, storing, loops = sa.put_result, asyncio.Event(), []

    def slow_put_result(batch_id, result):
        loops[0].call_soon_threadsafe(storing.set)
        time.sleep(0.5)
        return put_result(batch_id, result)

    sa.put_result = slow_put_result

    async def main():
        loops.append(asyncio.get_running_loop())
        a = BatchRunner(sa, counting(collections.Counter(), "a"), lease_ttl=TTL, max_in_flight=1)
        await a.start()
        rec = await a.create(upload(sa, jsonl(5)), "/v1/chat/completions", "24h")
        await storing.wait()  # line 0's result is being written
        await a.cancel(rec.id)
        done = await finished(a, rec.id, poll=0.001)
        await a.stop()
        return done

    done = asyncio.run(asyncio.wait_for(main(), 60))
    assert done.status == "cancelled"
    assert sa.result_indices(done.id) == {}
    out = read_file(sa, done.output_file_id)
    assert [o["custom_id"] for o in out] == ["r-0"] and done.request_counts["completed"] == 1
