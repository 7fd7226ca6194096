"""``--lora-resolver storage``: adapter ``name`` is ``loras/<name>/adapter_config.json`` and
``loras/<name>/adapter_model.safetensors`` in the server's storage backend (under the ``s3``
backend's prefix in its bucket; under ``--file-storage-path`` with ``local``), so replicas sharing
a bucket find the same adapters. Each is copied to a local directory to load, and that copy is
removed when the adapter is unloaded.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from llmkit.core.batches.storage import NotFoundError
from llmkit.core.lora.resolver import LoRAResolver, plain_name

FILES = ("adapter_config.json", "adapter_model.safetensors")


class StorageResolver(LoRAResolver):
    def __init__(self, storage) -> None:
        self.storage = storage
        self.cache = Path(tempfile.mkdtemp(prefix="llmkit-loras-"))
        atexit.register(shutil.rmtree, self.cache, True)  # the copies of loaded adapters

    @classmethod
    def create(cls, *, lora_dir, storage):
        if storage is None or not storage.stores_assets:
            raise ValueError("--lora-resolver storage needs a storage backend that stores assets (local, s3)")
        return cls(storage)

    def fetch(self, name: str) -> Path | None:
        if not plain_name(name):
            return None
        dest = Path(tempfile.mkdtemp(prefix=f"{name[:40]}-", dir=self.cache))
        for file in FILES:
            try:
                chunks = self.storage.read_asset(f"loras/{name}/{file}")
                with open(dest / file, "wb") as f:
                    for chunk in chunks:
                        f.write(chunk)
            except NotFoundError:  # (raised before the file is opened)
                if file == FILES[0]:  # no adapter by that name
                    shutil.rmtree(dest, ignore_errors=True)
                    return None
                # its weights missing: the loader says so (a 400 naming the file, not a 404)
        return dest

    def release(self, name: str, path: Path) -> None:
        if path.parent == self.cache:
            shutil.rmtree(path, ignore_errors=True)
