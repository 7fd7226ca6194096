"""One lookup from a checkpoint's kind to the loader that fills a model from it (as vLLM's
``get_model_loader``): the engine names the kind once it has resolved the source, and a new
source is one row here, not another branch in the builder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class WeightSource:
    """Where a model's weights are: its directory (config, tokenizer, safetensors), the GGUF
    file when there is one, the HF config, and whether shards are read lazily (each
    tensor-parallel rank reads only its slices)."""

    model_dir: Path
    gguf_path: Path | None
    hf_config: dict
    lazy: bool = False


def _safetensors(model: nn.Module, src: WeightSource) -> None:
    from llmkit.core.model.loader.source import iter_safetensors

    model.load_weights(iter_safetensors(src.model_dir, lazy=src.lazy))


def _int4_checkpoint(model: nn.Module, src: WeightSource) -> None:
    from llmkit.core.model.loader.int4_checkpoints import int4_checkpoint_weights
    from llmkit.core.model.loader.source import iter_safetensors

    model.load_weights(int4_checkpoint_weights(iter_safetensors(src.model_dir), src.hf_config))


def _compressed_tensors(model: nn.Module, src: WeightSource) -> None:
    from llmkit.core.model.loader.compressed_tensors import compressed_tensors_weights
    from llmkit.core.model.loader.source import iter_safetensors

    model.load_weights(compressed_tensors_weights(iter_safetensors(src.model_dir), src.hf_config))


def _gguf_native(model: nn.Module, src: WeightSource) -> None:
    from llmkit.core.model.loader.source import iter_gguf_native

    model.load_weights(iter_gguf_native(src.gguf_path, src.hf_config))


def _dummy(model: nn.Module, src: WeightSource) -> None:
    from llmkit.core.model.loader.dummy_weights import fill_dummy_weights

    fill_dummy_weights(model)


LOADERS: dict[str, Callable[[nn.Module, WeightSource], None]] = {
    "safetensors": _safetensors,  # a dense (or self-described FP8/MXFP4) HF checkpoint
    "int4_checkpoint": _int4_checkpoint,  # GPTQ / AWQ int4, repacked as it loads
    "compressed_tensors": _compressed_tensors,  # llm-compressor's formats: int4 kept, int8/FP8 dequantized
    "gguf_native": _gguf_native,  # a GGUF kept at its own precision, as llama.cpp serves it
    "dummy": _dummy,  # --load-format dummy: random weights of the real shapes
}


def get_loader(kind: str) -> Callable[[nn.Module, WeightSource], None]:
    if kind not in LOADERS:
        raise ValueError(f"no weight loader '{kind}'; known: {', '.join(LOADERS)}")
    return LOADERS[kind]
