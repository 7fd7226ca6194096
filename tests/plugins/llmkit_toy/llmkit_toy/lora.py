"""A LoRA resolver that finds adapter ``shelf-<x>`` at ``$TOY_LORA_SHELF/<x>`` (and nothing else)."""

import os
from pathlib import Path

from llmkit.core import LoRAResolver


class ShelfResolver(LoRAResolver):
    @classmethod
    def create(cls, *, lora_dir, storage):
        return cls()

    def fetch(self, name):
        shelf = Path(os.environ["TOY_LORA_SHELF"])
        if not name.startswith("shelf-") or "/" in name or ".." in name:
            return None
        path = shelf / name.removeprefix("shelf-")
        return path if (path / "adapter_config.json").is_file() else None
