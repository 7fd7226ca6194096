"""The ``details`` Ollama lists a model with (``/api/tags``, ``/api/show``, ``/api/ps``): format,
family, parameter size, quantization and size on disk, read from the served file's headers once
(a GGUF's metadata, or config.json and the safetensors headers), never from its weights."""

from __future__ import annotations

import functools
import json
from pathlib import Path

EMPTY = {
    "parent_model": "",
    "format": "",
    "family": "",
    "families": None,
    "parameter_size": "",
    "quantization_level": "",
}


def _size_label(n: int) -> str:
    """Ollama's way: 134515008 -> "134.5M", 8030261248 -> "8.0B"."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _gguf(path: Path) -> tuple[dict, int]:
    import gguf

    from llmkit.core.model.loader.gguf_file import gguf_header

    values, tensors = gguf_header(path, ("general.architecture", "general.file_type"))
    arch, file_type = values["general.architecture"] or "", values["general.file_type"]
    try:
        quant = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else ""
    except ValueError:
        quant = ""
    params = 0
    for _, dims, _, _ in tensors:
        n = 1
        for d in dims:
            n *= d
        params += n
    details = {"format": "gguf", "family": arch, "families": [arch] if arch else None}
    details.update(parameter_size=_size_label(params), quantization_level=quant)
    return details, path.stat().st_size


def _safetensors(path: Path) -> tuple[dict, int]:
    from safetensors import safe_open

    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    family = config.get("model_type") or ""
    params, size = 0, 0
    for f in sorted(path.glob("*.safetensors")):
        size += f.stat().st_size
        with safe_open(str(f), framework="numpy") as fh:  # the header only
            for name in fh.keys():
                n = 1
                for d in fh.get_slice(name).get_shape():
                    n *= d
                params += n
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
    quant = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(dtype, dtype.upper())
    details = {"format": "safetensors", "family": family, "families": [family] if family else None}
    details.update(parameter_size=_size_label(params) if params else "", quantization_level=quant)
    return details, size


@functools.cache
def model_details(source: str | None) -> tuple[dict, int]:
    """``(details, size in bytes)`` of the model at ``source``; empty ones when it cannot be read."""
    if not source:
        return dict(EMPTY), 0
    path = Path(source)
    try:
        found, size = _gguf(path) if path.suffix == ".gguf" else _safetensors(path)
    except Exception:  # details are informative only: an unreadable header must not fail a listing
        return dict(EMPTY), 0
    return {**EMPTY, **found}, size
