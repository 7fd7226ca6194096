"""The ``file`` KV storage backend: one file an entry under ``--hicache-storage-path``.

Layout: ``<path>/<first two hex digits of the key>/<key>``. A write goes to a temporary file in
the same folder and is renamed over the name (atomic on POSIX), so a reader sees a whole entry
or none; servers on one machine (or on a shared file system) can share the folder. There is no
fsync: a torn entry after a crash fails its checksum and is a miss. Nothing is ever deleted here:
the folder is a cache an operator may empty (or prune by age) at any time.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from llmkit.core.kvcache.kv_storage import KVStorage


class FileKVStorage(KVStorage):
    def __init__(self, *, path: str | None = None, **extra) -> None:
        if extra:
            raise ValueError(f"the file KV storage takes no settings (got {', '.join(sorted(extra))})")
        self.root = Path(path or "llmkit_kv_cache").expanduser()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError("a KV storage key is 64 lowercase hex digits")
        return self.root / key[:2] / key

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:  # (a full disk: no partial file left behind)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def exists(self, key: str) -> bool:
        return self._path(key).exists()
