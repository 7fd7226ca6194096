"""LoRA resolvers: ``dir`` (``--lora-dir``) and ``storage`` (the storage backend's ``loras/``)."""

from __future__ import annotations

from llmkit.core.hookspecs import hookimpl


@hookimpl
def llmkit_register_lora_resolvers(register):
    register("dir", "llmkit.plugins.lora_resolvers.directory:DirectoryResolver")
    register("storage", "llmkit.plugins.lora_resolvers.storage:StorageResolver")
