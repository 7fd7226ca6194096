"""A KV storage tier backend in a dozen lines: entries as flat files in one folder."""

from pathlib import Path

from llmkit.core import KVStorage


class FlatKVStorage(KVStorage):
    def __init__(self, *, path=None, **extra):
        self.root = Path(path or "toy-kv")
        self.root.mkdir(parents=True, exist_ok=True)

    def get(self, key):
        p = self.root / key
        return p.read_bytes() if p.exists() else None

    def put(self, key, data):
        (self.root / key).write_bytes(data)

    def exists(self, key):
        return (self.root / key).exists()
