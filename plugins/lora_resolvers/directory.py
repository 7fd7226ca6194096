"""``--lora-resolver dir`` (the default with ``--lora-dir``): adapter ``name`` is ``<dir>/<name>``
(SGLang #15417's ask)."""

from __future__ import annotations

from pathlib import Path

from llmkit.core.lora.resolver import LoRAResolver, plain_name


class DirectoryResolver(LoRAResolver):
    def __init__(self, root: str) -> None:
        self.root = Path(root).expanduser().resolve()

    @classmethod
    def create(cls, *, lora_dir, storage):
        if lora_dir is None:
            raise ValueError("--lora-resolver dir needs --lora-dir")
        return cls(lora_dir)

    def fetch(self, name: str) -> Path | None:
        if not plain_name(name):
            return None
        path = (self.root / name).resolve()
        # never a path outside the directory (a link out of it included)
        if path.parent != self.root or not (path / "adapter_config.json").is_file():
            return None
        return path
