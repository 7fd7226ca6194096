"""Adapters loaded by name on first use from ``--lora-dir`` (SGLang #15417's ask), the least
recently used unloaded past ``--max-loaded-loras``. ``state.loras`` keeps the use order: the
first entry is the least recently used."""

from __future__ import annotations

import logging
from pathlib import Path

from llmkit.core.server.errors import APIError

log = logging.getLogger("llmkit")


def adapter_dir(root: str, name: str) -> Path | None:
    """``<root>/<name>`` when ``name`` is a plain directory name holding an adapter; None for
    anything else, and never a path outside ``root`` (no ``..``, separators or links out)."""
    if not name or name.startswith(".") or "/" in name or "\\" in name or "\0" in name:
        return None
    base = Path(root).expanduser().resolve()
    path = (base / name).resolve()
    if path.parent != base or not (path / "adapter_config.json").is_file():
        return None
    return path


async def load_from_dir(state, name: str) -> bool:
    """Load ``name`` from ``--lora-dir``; False when no such adapter is there. A refused adapter
    is a 400 naming why."""
    path = adapter_dir(state.options.lora_dir, name)
    if path is None:
        return False
    async with state.lora_lock:  # one load at a time: two requests naming a new adapter load it once
        if name in state.loras:
            return True
        limit = state.options.max_loaded_loras
        # only adapters this directory gave may go (--lora-paths ones could not come back)
        evictable = [n for n, p in state.loras.items() if Path(p).parent == path.parent]
        while limit is not None and evictable and len(state.loras) >= limit:
            victim = evictable.pop(0)  # the least recently used
            state.loras.pop(victim)
            try:
                await state.client.unload_lora_adapter(victim)
            except KeyError:
                pass
            log.info("LoRA adapter '%s' unloaded (least recently used, --max-loaded-loras %d)", victim, limit)
        try:
            await state.client.load_lora_adapter(name, str(path))
        except ValueError as exc:
            raise APIError(str(exc), param="model") from None
        state.loras[name] = str(path)
    return True
