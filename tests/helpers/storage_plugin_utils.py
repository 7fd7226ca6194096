"""A third-party storage backend, installed through an ``llmkit`` entry point into a temp dir.

It uses only ``llmkit.core.batches.storage`` (the documented interface), keeps everything in memory and
registers as ``memstore``. ``install_memstore(tmp)`` returns the directory to put on PYTHONPATH.
"""

from __future__ import annotations

from pathlib import Path

PLUGIN_SOURCE = """
import json
import threading
from llmkit.core.hookspecs import hookimpl
from llmkit.core.batches.storage import (BatchRecord, FileRecord, NotFoundError, StorageBackend, capped,
                                 check_batch_id, check_file_id, check_record_key)


class MemStorage(StorageBackend):
    def __init__(self, label="mem"):
        self.label = label
        self.blobs, self.files, self.batches, self.results, self.records = {}, {}, {}, {}, {}
        self.lock = threading.Lock()

    def write_blob(self, file_id, chunks, *, max_bytes=None):
        check_file_id(file_id)
        data = b"".join(capped(chunks, max_bytes))
        with self.lock:
            self.blobs[file_id] = data
        return len(data)

    def read_blob(self, file_id):
        check_file_id(file_id)
        with self.lock:
            if file_id not in self.blobs:
                raise NotFoundError("file not found")
            data = self.blobs[file_id]
        return iter([data])

    def delete_blob(self, file_id):
        with self.lock:
            return self.blobs.pop(check_file_id(file_id), None) is not None

    def put_file(self, record):
        with self.lock:
            self.files[check_file_id(record.id)] = record.to_dict()

    def get_file(self, file_id):
        with self.lock:
            data = self.files.get(check_file_id(file_id))
        if data is None:
            raise NotFoundError("file not found")
        return FileRecord.from_dict(data)

    def list_files(self, *, purpose=None):
        with self.lock:
            recs = [FileRecord.from_dict(d) for d in self.files.values()]
        recs = [r for r in recs if purpose is None or r.purpose == purpose]
        return sorted(recs, key=lambda r: r.sort_key(), reverse=True)

    def delete_file(self, file_id):
        with self.lock:
            return self.files.pop(check_file_id(file_id), None) is not None

    def put_batch(self, record):
        with self.lock:
            self.batches[check_batch_id(record.id)] = record.to_dict()

    def get_batch(self, batch_id):
        with self.lock:
            data = self.batches.get(check_batch_id(batch_id))
        if data is None:
            raise NotFoundError("batch not found")
        return BatchRecord.from_dict(data)

    def list_batches(self, *, statuses=None):
        with self.lock:
            recs = [BatchRecord.from_dict(d) for d in self.batches.values()]
        recs = [r for r in recs if statuses is None or r.status in set(statuses)]
        return sorted(recs, key=lambda r: r.sort_key(), reverse=True)

    def put_result(self, batch_id, result):
        with self.lock:
            res = self.results.setdefault(check_batch_id(batch_id), {})
            if result.index in res:
                return False
            res[result.index] = result
            return True

    def result_indices(self, batch_id):
        with self.lock:
            return {i: r.kind for i, r in self.results.get(check_batch_id(batch_id), {}).items()}

    def iter_results(self, batch_id, kind=None):
        with self.lock:
            res = sorted(self.results.get(check_batch_id(batch_id), {}).values(), key=lambda r: r.index)
        return iter([r for r in res if kind is None or r.kind == kind])

    def delete_results(self, batch_id):
        with self.lock:
            self.results.pop(check_batch_id(batch_id), None)

    def put_record(self, kind, key, data):
        k = check_record_key(kind, key)
        with self.lock:
            self.records[k] = json.dumps(data)

    def get_record(self, kind, key):
        k = check_record_key(kind, key)
        with self.lock:
            data = self.records.get(k)
        if data is None:
            raise NotFoundError("record not found")
        return json.loads(data)

    def delete_record(self, kind, key):
        k = check_record_key(kind, key)
        with self.lock:
            return self.records.pop(k, None) is not None


@hookimpl
def llmkit_register_storage_backends(register):
    register("memstore", "llmkit_memstore:MemStorage")
"""


def install_memstore(tmp: Path) -> Path:
    """Write the plugin module and its dist-info (with the entry point) under ``tmp/site``."""
    site = tmp / "site"
    dist = site / "llmkit_memstore-0.1.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (site / "llmkit_memstore.py").write_text(PLUGIN_SOURCE)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: llmkit-memstore\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[llmkit]\nmemstore = llmkit_memstore\n")
    return site
