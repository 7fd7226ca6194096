"""Batch lifecycle with a fake executor: no engine, no HTTP."""

from __future__ import annotations

import asyncio
import json

import pytest

from llmkit.core.batches import runner as br
from llmkit.core.batches.runner import BatchRunner
from llmkit.plugins.storage.local import LocalStorage

from batch_utils import fake_execute, jsonl, read_file, run_batch, upload  # noqa: F401


@pytest.fixture
def storage(tmp_path):
    s = LocalStorage(str(tmp_path / "store"))
    yield s
    s.close()


def test_completed_lifecycle(storage):
    rec, out, err = asyncio.run(run_batch(storage, fake_execute, n=5))
    assert rec.status == "completed" and err == [] and rec.error_file_id is None
    assert rec.request_counts == {"total": 5, "completed": 5, "failed": 0}
    assert rec.created_at <= rec.in_progress_at <= rec.finalizing_at <= rec.completed_at
    assert rec.failed_at is rec.cancelled_at is rec.expired_at is None
    assert rec.model == "m" and rec.usage["total_tokens"] == 25
    assert [o["custom_id"] for o in out] == [f"r-{i}" for i in range(5)]
    first = out[0]
    assert first["id"].startswith("batch_req_") and first["error"] is None
    assert first["response"]["status_code"] == 200
    assert first["response"]["body"]["choices"][0]["message"]["content"] == "hello 0"
    assert storage.get_file(rec.output_file_id).purpose == "batch_output"
    assert storage.result_indices(rec.id) == {}  # cleaned up
    api = rec.to_openai()
    assert api["object"] == "batch" and "pinned_input_id" not in api and api["errors"] is None


def test_per_line_failures_go_to_error_file(storage):
    data = jsonl(6, lambda i: {1: "fail", 4: "boom"}.get(i, f"ok {i}"))
    rec, out, err = asyncio.run(run_batch(storage, fake_execute, data=data))
    assert rec.status == "completed"
    assert rec.request_counts == {"total": 6, "completed": 4, "failed": 2}
    assert [o["custom_id"] for o in out] == ["r-0", "r-2", "r-3", "r-5"]
    assert [(e["custom_id"], e["error"]["code"]) for e in err] == [("r-1", "bad"), ("r-4", "server_error")]
    assert all(e["response"] is None for e in err)
    assert "exploded" not in json.dumps(err)  # no internals leak


def test_validation_failure_runs_nothing(storage):
    calls = []

    async def execute(endpoint, body):
        calls.append(body)
        return await fake_execute(endpoint, body)

    data = (
        jsonl(3)
        + b'{"custom_id": "r-0", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role":"user","content":"x"}]}}\n{bad json\n'
    )
    rec, out, err = asyncio.run(run_batch(storage, execute, data=data))
    assert rec.status == "failed" and rec.failed_at and calls == [] and out == err == []
    assert [(e["code"], e["line"]) for e in rec.errors] == [("duplicate_custom_id", 4), ("invalid_json_line", 5)]
    assert rec.to_openai()["errors"]["object"] == "list"
    assert rec.pinned_input_id is None and rec.in_progress_at is None


async def _slow_runner(storage, n, gate: asyncio.Event, started: list, max_in_flight=4):
    async def execute(endpoint, body):
        started.append(body["messages"][-1]["content"])
        if len(started) > 3:
            await gate.wait()
        return await fake_execute(endpoint, body)

    runner = BatchRunner(storage, execute, max_in_flight=max_in_flight, persist_interval=0)
    await runner.start()
    rec = await runner.create(upload(storage, jsonl(n)), "/v1/chat/completions", "24h")
    return runner, rec


def test_cancel_keeps_finished_lines_and_is_sticky(storage):
    async def main():
        gate, started = asyncio.Event(), []
        runner, rec = await _slow_runner(storage, 50, gate, started)
        while (await runner.get(rec.id)).request_counts["completed"] < 3:
            await asyncio.sleep(0.01)
        c = await runner.cancel(rec.id)
        assert c.status == "cancelling" and c.cancelling_at
        final = await runner.wait(rec.id)
        assert (await runner.cancel(rec.id)).status == "cancelled"  # idempotent, unchanged
        await runner.stop()
        return final, len(started)

    final, started = asyncio.run(main())
    assert final.status == "cancelled" and final.cancelled_at and final.completed_at is None
    assert final.request_counts == {"total": 50, "completed": 3, "failed": 0}
    assert started <= 3 + 4  # no new lines after the cancel; bounded in flight
    assert [o["custom_id"] for o in read_file(storage, final.output_file_id)] == ["r-0", "r-1", "r-2"]


def test_cancel_finished_batch_returns_it_unchanged(storage):
    async def main():
        runner = BatchRunner(storage, fake_execute)
        rec = await runner.create(upload(storage, jsonl(2)), "/v1/chat/completions", "24h")
        done = await runner.wait(rec.id)
        again = await runner.cancel(rec.id)
        return done, again

    done, again = asyncio.run(main())
    assert done.status == "completed" and again == done


def test_resume_after_stop_runs_each_line_once(storage):
    async def first_run():
        gate, started = asyncio.Event(), []
        runner, rec = await _slow_runner(storage, 20, gate, started)
        while (await runner.get(rec.id)).request_counts["completed"] < 3:
            await asyncio.sleep(0.01)
        await runner.stop()  # like a shutdown mid-batch; status stays in_progress
        return rec.id

    async def second_run(batch_id):
        seen = []

        async def execute(endpoint, body):
            seen.append(body["messages"][-1]["content"])
            return await fake_execute(endpoint, body)

        runner = BatchRunner(storage, execute)
        await runner.start()
        rec = await runner.wait(batch_id)
        await runner.stop()
        return rec, seen

    batch_id = asyncio.run(first_run())
    assert storage.get_batch(batch_id).status == "in_progress"
    rec, seen = asyncio.run(second_run(batch_id))
    assert rec.status == "completed" and len(seen) == 17
    ids = [o["custom_id"] for o in read_file(storage, rec.output_file_id)]
    assert ids == [f"r-{i}" for i in range(20)]


def test_bounded_in_flight_and_live_counts(storage):
    active, peak, snapshots = [0], [0], []

    async def execute(endpoint, body):
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        await asyncio.sleep(0.002)
        active[0] -= 1
        return await fake_execute(endpoint, body)

    rec, out, _ = asyncio.run(
        run_batch(
            storage,
            execute,
            n=40,
            max_in_flight=3,
            on_progress=lambda r: snapshots.append(r.request_counts["completed"]),
        )
    )
    assert peak[0] == 3 and len(out) == 40
    assert snapshots == sorted(snapshots) and snapshots[0] < 40


def test_deleting_input_mid_batch_is_harmless(storage):
    async def main():
        gate, started = asyncio.Event(), []
        runner, rec = await _slow_runner(storage, 10, gate, started)
        while (await runner.get(rec.id)).status != "in_progress":
            await asyncio.sleep(0.01)
        storage.delete_file(rec.input_file_id)
        storage.delete_blob(rec.input_file_id)
        gate.set()
        return await runner.wait(rec.id)

    rec = asyncio.run(main())
    assert rec.status == "completed" and rec.request_counts["completed"] == 10


def test_expiry_keeps_finished_lines(storage, monkeypatch):
    monkeypatch.setitem(br.COMPLETION_WINDOWS, "24h", 1)

    async def main():
        gate, started = asyncio.Event(), []
        runner, rec = await _slow_runner(storage, 10, gate, started)
        return await runner.wait(rec.id)

    rec = asyncio.run(main())
    assert rec.status == "expired" and rec.expired_at and rec.request_counts["completed"] == 3
    assert len(read_file(storage, rec.output_file_id)) == 3
