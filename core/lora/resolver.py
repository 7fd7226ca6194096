"""The LoRA resolver seam (``--lora-resolver NAME``, a plugin kind like storage): where an adapter
comes from when a request names one the server has not loaded. The server loads what it finds,
and unloads the least recently used resolved adapter past ``--max-loaded-loras``.

Plugins: ``dir`` (``<--lora-dir>/<name>``) and ``storage`` (``loras/<name>/`` in the storage
backend, so an S3 bucket serves adapters to every replica).
"""

from __future__ import annotations

import abc
from pathlib import Path


def plain_name(name: str) -> bool:
    """A name that can be one path segment: no separators, no ``..``, no hidden names."""
    return bool(name) and not name.startswith(".") and not any(c in name for c in "/\\\0") and len(name) <= 255


class LoRAResolver(abc.ABC):
    @classmethod
    @abc.abstractmethod
    def create(cls, *, lora_dir: str | None, storage) -> "LoRAResolver":
        """The resolver for this server (``storage``: its storage backend, None when it has none);
        a ValueError when the server lacks what it needs."""

    @abc.abstractmethod
    def fetch(self, name: str) -> Path | None:
        """A local directory holding adapter ``name``'s ``adapter_config.json`` and
        ``adapter_model.safetensors``, or None when there is none by that name. Blocking: the
        server calls it on a worker thread. ``name`` is whatever a client sent: never let it
        reach outside where this resolver looks."""

    def release(self, name: str, path: Path) -> None:
        """``name``, fetched to ``path``, was unloaded (a cache may drop its copy)."""
