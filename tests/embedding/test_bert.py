"""Our BERT forward against transformers' ``BertModel``, and pooling against sentence-transformers'
configuration files."""

from __future__ import annotations

import json

import pytest
import torch

from llmkit.core.embedding.pooling import Pooling, read_pooling
from llmkit.plugins.models.bert import BertModel


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("tiny-bert")
    config = transformers.BertConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.BertModel(config).eval()
    ref.save_pretrained(path)  # safetensors, with the pooler head ours ignores
    return path, ref


def test_hidden_states_match_transformers(tiny_bert):
    path, ref = tiny_bert
    config = json.loads((path / "config.json").read_text())
    ours = BertModel.from_pretrained(path, config, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (5, 17, 1, 64)]
    together = ours.encode(inputs)  # padded into one batch
    for ids, got in zip(inputs, together):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.encode([ids])[0], got, atol=1e-5, rtol=1e-4)  # batch-mates do not matter


def test_pooling_follows_sentence_transformers_modules(tmp_path):
    assert read_pooling(tmp_path) == Pooling("mean", normalize=False)  # a plain checkpoint
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    modules = [{"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert read_pooling(tmp_path) == Pooling("cls", normalize=False)
    modules.append({"type": "sentence_transformers.models.Normalize", "path": "2_Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert read_pooling(tmp_path) == Pooling("cls", normalize=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="not supported"):
        read_pooling(tmp_path)
    states = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    assert Pooling("mean")(states).tolist() == [2.0, 2.0]
    assert Pooling("last")(states).tolist() == [1.0, 0.0]
    torch.testing.assert_close(Pooling("cls", normalize=True)(states), torch.tensor([0.6, 0.8]))
