"""Adapters loaded by name on first use through the server's LoRA resolver (``--lora-resolver``,
``--lora-dir``), the least recently used resolved one unloaded past ``--max-loaded-loras``.
``state.loras`` keeps the use order: the first entry is the least recently used."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from llmkit.core.server.errors import APIError

log = logging.getLogger("llmkit")


def open_resolver(options, storage):
    """The server's resolver (``--lora-resolver``; ``dir`` when only ``--lora-dir`` is given), or
    None when adapters come only from start-up and the load route."""
    name = options.lora_resolver or ("dir" if options.lora_dir is not None else None)
    if name is None:
        return None
    from llmkit.core.plugins import registry

    return registry().lora_resolver(name).create(lora_dir=options.lora_dir, storage=storage)


async def load_resolved(state, name: str) -> bool:
    """Load ``name`` through the resolver; False when it has no such adapter. A refused adapter
    is a 400 naming why."""
    resolver = state.lora_resolver
    async with state.lora_lock:  # one load at a time: two requests naming a new adapter load it once
        if name in state.loras:
            return True
        path = await asyncio.to_thread(resolver.fetch, name)
        if path is None:
            return False
        limit = state.options.max_loaded_loras
        # only adapters the resolver gave may go (--lora-paths ones could not come back)
        evictable = [n for n in state.loras if n in state.resolved_loras]
        while limit is not None and evictable and len(state.loras) >= limit:
            victim = evictable.pop(0)  # the least recently used
            await _unload(state, victim)
            log.info("LoRA adapter '%s' unloaded (least recently used, --max-loaded-loras %d)", victim, limit)
        try:
            await state.client.load_lora_adapter(name, str(path))
        except ValueError as exc:
            resolver.release(name, Path(path))
            raise APIError(str(exc), param="model") from None
        state.loras[name] = str(path)
        state.resolved_loras.add(name)
    return True


async def _unload(state, name: str) -> None:
    path = state.loras.pop(name)
    state.resolved_loras.discard(name)
    try:
        await state.client.unload_lora_adapter(name)
    except KeyError:
        pass
    state.lora_resolver.release(name, Path(path))
