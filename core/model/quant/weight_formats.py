"""The ``--quantization`` table: a method's name to the weight format that implements it, one
module per method (imported only when chosen, as the int4 one pulls in its kernels).

A dense checkpoint is converted after loading (``quantize.py``); formats a checkpoint already
comes in (GGUF blocks, GPTQ/AWQ int4, FP8, MXFP4) are read by the loaders, not named here.
"""

from __future__ import annotations

import importlib

from llmkit.core.model.linear import DENSE, WeightFormat

FORMATS = {  # name -> "module:Class"; the class builds itself from --quantization-group-size
    "int8": "llmkit.core.model.quant.int8:Int8Format",
    "int4": "llmkit.core.model.quant.int4_format:Int4Format",
}
QUANTIZATIONS = tuple(FORMATS)


def weight_format(name: str | None, group_size: int | None = None) -> WeightFormat:
    """The format ``--quantization NAME`` converts dense weights to (``group_size``: its groups,
    for the methods that have them)."""
    if name in (None, "", "none"):
        return DENSE
    if name not in FORMATS:
        raise ValueError(f"quantization '{name}' is not supported; supported: none, {', '.join(QUANTIZATIONS)}")
    module, cls = FORMATS[name].split(":")
    return getattr(importlib.import_module(module), cls).for_quantization(group_size)
