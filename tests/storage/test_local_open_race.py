"""Replicas that share a local storage directory may start at the same moment: switching the new
database to WAL takes an exclusive lock, and SQLite answers "database is locked" at once (no busy
wait) to the loser of that race. Opening retries for a bounded time instead of failing the server's
start (seen as a lease test's replica exiting with OperationalError)."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3

import pytest

from llmkit.plugins.storage import local
from llmkit.plugins.storage.local import LocalStorage


class _LockedAtFirst:
    """A connection whose first ``n`` WAL switches fail as the loser of the race sees it."""

    def __init__(self, conn, n):
        self._conn, self.n = conn, n

    def execute(self, sql, *args):
        if sql.startswith("PRAGMA journal_mode") and self.n:
            self.n -= 1
            raise sqlite3.OperationalError("database is locked")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._conn, name)


def test_a_locked_wal_switch_is_retried(tmp_path, monkeypatch):
    real = sqlite3.connect
    monkeypatch.setattr(local.sqlite3, "connect", lambda *a, **k: _LockedAtFirst(real(*a, **k), 3))
    store = LocalStorage(str(tmp_path))
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_lasting_lock_still_fails_in_bounded_time(tmp_path, monkeypatch):
    real = sqlite3.connect
    monkeypatch.setattr(local.sqlite3, "connect", lambda *a, **k: _LockedAtFirst(real(*a, **k), 10**9))
    monkeypatch.setattr(local, "WAL_WAIT_S", 0.2)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        LocalStorage(str(tmp_path))


def _open(path, barrier, results):
    barrier.wait()
    try:
        LocalStorage(path)
        results.put(None)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        results.put(repr(exc))


def test_three_processes_opening_one_new_directory_at_once(tmp_path):
    ctx = mp.get_context("fork")
    for i in range(12):
        barrier, results = ctx.Barrier(3), ctx.Queue()
        procs = [ctx.Process(target=_open, args=(str(tmp_path / str(i)), barrier, results)) for _ in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [results.get(timeout=10) for _ in procs] == [None, None, None]
