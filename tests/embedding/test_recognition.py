"""Which models launch serves as embedding or reranking models: an encoder or cross-encoder
architecture in config.json, or a causal LM with ``--is-embedding`` or ``--is-reranker``."""

from __future__ import annotations

import json

import pytest

from llmkit.core.embedding.loader import encoder_architecture
from llmkit.core.embedding.recognition import embedding_model_dir


def test_an_encoder_is_recognised_from_its_config(tmp_path):
    assert encoder_architecture({"architectures": ["BertModel"]}) == "BertModel"
    assert encoder_architecture({"model_type": "bert"}) == "BertModel"  # a bare config's model_type
    assert encoder_architecture({"model_type": "xlm-roberta"}) == "XLMRobertaModel"
    cross = {"architectures": ["BertForSequenceClassification"]}
    assert encoder_architecture(cross) == "BertForSequenceClassification"
    assert encoder_architecture({"architectures": ["LlamaForCausalLM"]}) is None
    assert encoder_architecture({"architectures": ["NoSuchModel"]}) is None
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    assert embedding_model_dir(str(tmp_path), forced=False) == tmp_path
    with pytest.raises(ValueError, match="'BertModel' embeds"):
        embedding_model_dir(str(tmp_path), forced=False, reranker=True)
    (tmp_path / "config.json").write_text(json.dumps(cross))
    assert embedding_model_dir(str(tmp_path), forced=False) == tmp_path
    assert embedding_model_dir(str(tmp_path), forced=False, reranker=True) == tmp_path


def test_a_causal_lm_embeds_or_reranks_only_when_asked(tiny_llama, tmp_path):
    assert embedding_model_dir(str(tiny_llama), forced=False) is None  # it generates
    assert embedding_model_dir(str(tiny_llama), forced=True) == tiny_llama
    assert embedding_model_dir(str(tiny_llama), forced=False, reranker=True) == tiny_llama
    with pytest.raises(ValueError, match="one of the two"):
        embedding_model_dir(str(tiny_llama), forced=True, reranker=True)
    with pytest.raises(ValueError, match="--is-embedding needs a model directory"):
        embedding_model_dir(None, forced=True)  # the embedded SmolLM2
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(ValueError, match="neither an encoder nor a causal LM"):
        embedding_model_dir(str(tmp_path), forced=False, reranker=True)


def test_generation_flags_on_an_embedding_model_are_refused():
    """``--tp-size``, ``--lora-paths``, ``--speculative-algorithm`` ... would be ignored by an
    embedding model (one thread, no decoding): ``llmkit serve`` refuses them, naming each, before
    it loads anything."""
    import subprocess
    import sys

    from server_utils import free_port

    port = str(free_port())
    cmd = [sys.executable, "-m", "llmkit.cli.main", "serve", "--model-path", "all-MiniLM-L6-v2", "--port", port]
    flags = ["--tp-size", "2", "--lora-paths", "a=/nowhere", "--reasoning-parser", "qwen3"]
    proc = subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "error: all-MiniLM-L6-v2: an embedding or reranking model runs in the server's own process and "
        "does not decode; --tp-size, --lora-paths, --reasoning-parser apply to generation models only"
    ), proc.stderr
    proc = subprocess.run([*cmd, "--quantization", "int8"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "; --quantization applies to generation models only" in proc.stderr
