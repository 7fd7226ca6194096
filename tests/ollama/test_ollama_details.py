"""The details Ollama lists a model with, read from the embedded GGUF's metadata and from a tiny
safetensors model's config and headers."""

from __future__ import annotations

import torch

from llmkit.core.model.loader.source import embedded_gguf_path
from llmkit.core.server.ollama.details import model_details


def test_gguf_details():
    details, size = model_details(str(embedded_gguf_path()))
    assert details["format"] == "gguf" and details["family"] == "llama" and details["families"] == ["llama"]
    assert details["quantization_level"] == "Q4_1" and details["parameter_size"] == "134.5M"
    assert size == embedded_gguf_path().stat().st_size


def test_safetensors_details(tmp_path):
    import json

    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "torch_dtype": "bfloat16"}))
    save_file({"a": torch.zeros(1000, 1500), "b": torch.zeros(500)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"c": torch.zeros(2, 250)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    details, size = model_details(str(tmp_path))
    assert details["format"] == "safetensors" and details["family"] == "qwen2"
    assert details["quantization_level"] == "BF16" and details["parameter_size"] == "1.5M"  # 1,501,000 in two shards
    assert size == sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))


def test_unreadable_source_gives_empty_details(tmp_path):
    details, size = model_details(str(tmp_path / "gone.gguf"))
    assert (details["format"], size) == ("", 0)
    assert model_details(None)[1] == 0
