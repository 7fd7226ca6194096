"""Our BERT forward against transformers' ``BertModel``, and pooling against sentence-transformers'
configuration files."""

from __future__ import annotations

import json

import pytest
import torch

from llmkit.core.embedding.pooling import Pooling, override_pooling, read_pooling
from llmkit.plugins.models import bert
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


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_cross_encoder_logits_match_transformers(tmp_path, family):
    """BertForSequenceClassification (token types read) and XLM-RoBERTa's (positions after
    padding_idx, its head one module): the one-label logit of each input, batched or alone."""
    import transformers

    kw = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    if family == "bert":
        config, task = transformers.BertConfig(**kw, max_position_embeddings=64, num_labels=1), "Bert"
    else:
        config = transformers.XLMRobertaConfig(**kw, max_position_embeddings=66, num_labels=1, pad_token_id=1)
        config.type_vocab_size, task = 1, "XLMRoberta"
    torch.manual_seed(0)
    ref = getattr(transformers, f"{task}ForSequenceClassification")(config).eval()
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    ref.save_pretrained(tmp_path)
    cls = getattr(bert, f"{task}ForSequenceClassification")
    ours = cls.from_pretrained(
        tmp_path, json.loads((tmp_path / "config.json").read_text()), torch.device("cpu"), torch.float32
    )
    assert ours.max_position == 64 and ours.activation == "sigmoid"
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 17, 2, 64)]
    types = [[0] * (n // 2) + [1] * (n - n // 2) for n in map(len, inputs)] if family == "bert" else None
    got = ours.score(inputs, types)
    for i, ids in enumerate(inputs):
        kwargs = {"token_type_ids": torch.tensor([types[i]])} if types else {}
        with torch.no_grad():
            want = ref(torch.tensor([ids]), **kwargs).logits[0, 0].item()
        assert got[i] == pytest.approx(want, abs=1e-5)
        assert ours.score([ids], [types[i]] if types else None)[0] == pytest.approx(got[i], abs=1e-5)


def test_xlm_roberta_hidden_states_match_transformers(tmp_path):
    import transformers

    config = transformers.XLMRobertaConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=40, pad_token_id=1, type_vocab_size=1,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.XLMRobertaModel(config).eval()
    ref.save_pretrained(tmp_path)
    ours = bert.XLMRobertaModel.from_pretrained(
        tmp_path, json.loads((tmp_path / "config.json").read_text()), torch.device("cpu"), torch.float32
    )
    inputs = [[0, 5, 6, 7, 2], [0, *range(10, 46), 2]]  # the second fills all 38 positions
    assert ours.max_position == 38
    for ids, got in zip(inputs, ours.encode(inputs)):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_cross_encoder_has_one_label_and_a_known_activation():
    base = dict(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    base.update(max_position_embeddings=8)
    with pytest.raises(ValueError, match="has 2"):
        bert.BertForSequenceClassification({**base, "id2label": {"0": "a", "1": "b"}})
    one = {**base, "id2label": {"0": "a"}}
    assert bert.BertForSequenceClassification(one).activation == "sigmoid"
    identity = {"activation_fn": "torch.nn.modules.linear.Identity"}
    assert bert.BertForSequenceClassification({**one, "sentence_transformers": identity}).activation == "identity"
    with pytest.raises(ValueError, match="Tanh"):
        bert.BertForSequenceClassification({**one, "sbert_ce_default_activation_function": "torch.nn.Tanh"})


def test_pooler_config_overrides_the_files():
    files = Pooling("cls", normalize=True)
    assert override_pooling(files, None) == files
    assert override_pooling(files, '{"pooling_type": "MEAN"}') == Pooling("mean", normalize=True)
    assert override_pooling(files, '{"pooling_type": "last", "normalize": false}') == Pooling("last", normalize=False)
    for bad, match in (
        ("mean", "not JSON"),
        ('{"pooling_type": "MAX"}', "not one of"),
        ('{"normalize": "yes"}', "true or false"),
        ('{"pooling": "MEAN"}', "takes"),
    ):
        with pytest.raises(ValueError, match=match):
            override_pooling(files, bad)
