"""Hostile uploads and concurrent use of the Files/Batches API (catalogue rows 34, 35, 40-42)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from llmkit.core.batches.files_routes import sanitize_filename
from llmkit.plugins.storage.local import LocalStorage

from batch_utils import fake_execute, jsonl, make_app

HOSTILE_NAMES = [
    "../../x",
    "/abs/path.jsonl",
    "C:\\..\\x",
    "a\x00b",
    "é" * 300,
    "..",
    "",
    ".",
    "../" * 50 + "etc/passwd",
    "line\nbreak\r.jsonl",
]


def walk(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_sanitize_filename(name):
    clean = sanitize_filename(name)
    assert clean and "/" not in clean and "\\" not in clean and clean not in (".", "..")
    assert not any(ord(c) < 32 for c in clean) and len(clean.encode()) <= 255


def test_hostile_upload_names_stay_inside_the_root(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    storage = LocalStorage(str(work / "store"))
    with TestClient(make_app(storage, fake_execute)) as http:
        for name in HOSTILE_NAMES:
            r = http.post("/v1/files", files={"file": (name, b'{"a": 1}\n')}, data={"purpose": "batch"})
            assert r.status_code == 200, r.text
            assert r.json()["filename"] == sanitize_filename(r.json()["filename"])
            assert "/" not in r.json()["filename"]
    storage.close()
    # Everything written lives under the storage root, in the places the backend puts things.
    assert set(os.listdir(tmp_path)) == {"work"} and os.listdir(work) == ["store"]
    files = walk(work / "store")
    blobs = {f for f in files if f.startswith("blobs/")}
    assert len(blobs) == len(HOSTILE_NAMES)
    assert files - blobs <= {"llmkit.sqlite3", "llmkit.sqlite3-wal", "llmkit.sqlite3-shm"}


def test_concurrent_creates_cancels_and_reads(tmp_path):
    storage = LocalStorage(str(tmp_path / "store"))
    with TestClient(make_app(storage, fake_execute, max_in_flight=4)) as http:
        fid = http.post("/v1/files", files={"file": ("in.jsonl", jsonl(30))}, data={"purpose": "batch"}).json()["id"]
        body = {"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        with ThreadPoolExecutor(8) as pool:
            created = list(pool.map(lambda _: http.post("/v1/batches", json=body), range(20)))
            assert all(r.status_code == 200 for r in created)
            ids = [r.json()["id"] for r in created]
            cancels = list(pool.map(lambda i: http.post(f"/v1/batches/{i}/cancel"), ids * 2))
            reads = list(pool.map(lambda i: http.get(f"/v1/batches/{i}"), ids))
        assert all(r.status_code == 200 for r in cancels + reads)
        for batch_id in ids:
            while (b := http.get(f"/v1/batches/{batch_id}").json())["status"] not in (
                "completed",
                "cancelled",
                "failed",
            ):
                pass
            assert b["status"] in ("completed", "cancelled")
            if b["output_file_id"]:
                lines = http.get(f"/v1/files/{b['output_file_id']}/content").content.splitlines()
                assert len(lines) == b["request_counts"]["completed"] and len(set(lines)) == len(lines)
    storage.close()
