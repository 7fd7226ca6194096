"""Which models launch serves as embedding models: an encoder architecture in config.json, or
``--is-embedding``, which a generative model refuses."""

from __future__ import annotations

import json

import pytest

from llmkit.core.embedding.loader import encoder_architecture
from llmkit.core.launch import _embedding_model_dir


def test_an_encoder_is_recognised_from_its_config(tmp_path):
    assert encoder_architecture({"architectures": ["BertModel"]}) == "BertModel"
    assert encoder_architecture({"model_type": "bert"}) == "BertModel"  # a bare config's model_type
    assert encoder_architecture({"architectures": ["LlamaForCausalLM"]}) is None
    assert encoder_architecture({"architectures": ["NoSuchModel"]}) is None
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    assert _embedding_model_dir(str(tmp_path), forced=False) == tmp_path


def test_is_embedding_on_a_generative_model_is_refused(tiny_llama):
    assert _embedding_model_dir(str(tiny_llama), forced=False) is None
    with pytest.raises(ValueError, match="not an encoder architecture"):
        _embedding_model_dir(str(tiny_llama), forced=True)
    with pytest.raises(ValueError, match="--is-embedding needs an encoder"):
        _embedding_model_dir(None, forced=True)  # the embedded SmolLM2
