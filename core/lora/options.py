"""The LoRA flags' values, read without torch (the CLI checks them before the model loads, and
the server learns the start-up adapters' names from them)."""

from __future__ import annotations

import json
from typing import Sequence

# The checkpoint projections an adapter may target (the decoder's fused layers hold them).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_lora_paths(specs: Sequence[str]) -> list[tuple[str, str]]:
    """``name=path`` items (SGLang's and vLLM's form), vLLM's JSON ``{"name": ..., "path": ...}``,
    or a bare path (named after itself)."""
    out = []
    for spec in specs:
        spec = spec.strip()
        if spec.startswith("{"):
            try:
                obj = json.loads(spec)
                name, path = str(obj["name"]), str(obj["path"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"LoRA adapter '{spec}': expected JSON with name and path") from None
        else:
            name, sep, path = spec.partition("=")
            name, path = (name.strip(), path.strip()) if sep else (spec, spec)
        if not name or not path:
            raise ValueError(f"LoRA adapter '{spec}': expected name=path")
        out.append((name, path))
    return out


def target_set(targets: Sequence[str]) -> frozenset[str]:
    """``--lora-target-modules`` as a set of checkpoint module names (empty or ``all``: every one)."""
    if not targets or "all" in targets:
        return frozenset(TARGET_MODULES)
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"--lora-target-modules: {unknown} not among {', '.join(TARGET_MODULES)}, all")
    return frozenset(targets)
