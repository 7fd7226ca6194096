"""Causal LMs served without generating: a tiny random Qwen3 as a last-token embedder
(``--is-embedding``, Qwen3-Embedding style) and as a yes/no reranker (``--is-reranker``,
Qwen3-Reranker style), against transformers on the same checkpoints."""

from __future__ import annotations

import openai
import pytest
import torch
import torch.nn.functional as F

QUERY = "What is the capital of France? {document}"  # placeholders in texts stay text
DOCS = ["Paris is the capital of France.", "The cat sat on the mat.", "Rain at night.", "Berlin {query} is in Germany."]
# Qwen3-Reranker's model card builds its inputs so: these tokens around the formatted pair
PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def _tiny_qwen3(path, cls_name: str):
    """A random tiny Qwen3 (the embedded model's tokenizer), weights widened so outputs differ."""
    import transformers

    from model_utils import copy_embedded_tokenizer, tiny_config

    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(tiny_config("qwen3", vocab_size=49152)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    copy_embedded_tokenizer(path)
    return model


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    from tests.conftest import _server

    path = tmp_path_factory.mktemp("tiny-qwen3-embedding")
    ref = _tiny_qwen3(path, "Qwen3Model")  # saved without an LM head, as Qwen3-Embedding is
    for server in _server(["--model-path", str(path), "--is-embedding"]):
        yield server, ref, path


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    from tests.conftest import _server

    path = tmp_path_factory.mktemp("tiny-qwen3-reranker")
    ref = _tiny_qwen3(path, "Qwen3ForCausalLM")
    for server in _server(["--model-path", str(path), "--is-reranker"]):
        yield server, ref, path


def _reference_vectors(ref, path, texts: list[str]) -> torch.Tensor:
    """transformers' last hidden state at each text's last token, normalised (Qwen3-Embedding's pooling)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    rows = []
    for ids in tok(texts, add_special_tokens=True)["input_ids"]:
        with torch.no_grad():
            rows.append(ref(torch.tensor([ids])).last_hidden_state[0, -1])
    return F.normalize(torch.stack(rows), dim=1)


def test_last_token_embeddings_match_transformers(embedder):
    server, ref, path = embedder
    texts = [QUERY, *DOCS, "word " * 40]
    resp = server.client.embeddings.create(model="m", input=texts)
    got = torch.tensor([d.embedding for d in resp.data])
    want = _reference_vectors(ref, path, texts)
    assert got.shape == want.shape == (len(texts), 64)
    assert F.cosine_similarity(got, want, dim=1).min().item() >= 0.9999
    assert torch.allclose(got.norm(dim=1), torch.ones(len(texts)), atol=1e-5)


def test_a_bi_encoder_scores_by_cosine_and_does_not_rerank(embedder):
    server, ref, path = embedder
    body = server.http().post("/v1/score", json={"model": "m", "text_1": QUERY, "text_2": DOCS}).json()
    vectors = _reference_vectors(ref, path, [QUERY, *DOCS])
    want = (vectors[1:] @ vectors[0]).tolist()
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-4)
    resp = server.http().post("/v1/rerank", json={"model": "m", "query": QUERY, "documents": DOCS})
    assert resp.status_code == 400 and "does not rerank" in resp.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="serves embeddings"):
        server.client.completions.create(model="m", prompt="hi")


def test_yes_no_reranker_matches_transformers(reranker):
    server, ref, path = reranker
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    prefix, suffix = tok.encode(PREFIX, add_special_tokens=False), tok.encode(SUFFIX, add_special_tokens=False)
    want = []
    for doc in DOCS:  # the model card's scoring: softmax over the "no" and "yes" logits, P("yes")
        body = tok.encode(f"<Instruct>: {INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {doc}", add_special_tokens=False)
        with torch.no_grad():
            logits = ref(torch.tensor([prefix + body + suffix])).logits[0, -1]
        want.append(torch.softmax(logits[[no, yes]], dim=0)[1].item())
    assert max(want) - min(want) > 0.05  # the order below is a real check

    http = server.http()
    res = http.post("/v1/rerank", json={"model": "m", "query": QUERY, "documents": DOCS, "top_n": 3}).json()
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert [r["index"] for r in res["results"]] == order[:3]
    for r in res["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-4)
    scores = http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(want, abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="reranks"):
        server.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def test_instruction_and_pooling_flags_reach_the_engine(embedder, reranker):
    import json

    from llmkit.core.embedding.loader import start_embedding_engine
    from llmkit.core.embedding.pooling import Pooling

    _, _, rerank_dir = reranker
    config = json.loads((rerank_dir / "config.json").read_text())
    engine = start_embedding_engine(rerank_dir, config, reranker=True, instruction="Find recipes")
    try:
        assert "<Instruct>: Find recipes\n<Query>: {query}\n<Document>: {document}<|im_end|>" in engine.pair_template
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="does not pool"):
        start_embedding_engine(rerank_dir, config, reranker=True, pooler_config='{"pooling_type": "MEAN"}')
    _, _, embed_dir = embedder
    config = json.loads((embed_dir / "config.json").read_text())
    engine = start_embedding_engine(embed_dir, config, pooler_config='{"pooling_type": "MEAN", "normalize": false}')
    try:
        assert engine.pooling == Pooling("mean", normalize=False)
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="--is-reranker"):
        start_embedding_engine(embed_dir, config, instruction="Find recipes")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_other_decoder_families_embed_as_transformers(tmp_path, family):
    """The Llama path (fused Q/K rotation, the C decoder stack offered) and Qwen2's (QKV bias),
    in-process: every token's final hidden state, inputs batched together."""
    import json

    import transformers

    from llmkit.core.embedding.decoder import DecoderEncoder

    from model_utils import tiny_config

    torch.manual_seed(0)
    cls = {"llama": transformers.LlamaModel, "qwen2": transformers.Qwen2Model}[family]
    ref = cls(tiny_config(family)).eval()
    with torch.no_grad():  # widen the weights and Qwen2's Q/K/V biases (zero at init)
        for name, p in ref.named_parameters():
            if p.dim() > 1 or name.endswith("proj.bias"):
                p.normal_(0, 0.2)
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    ours = DecoderEncoder.from_pretrained(tmp_path, config, torch.device("cpu"), torch.float32)
    inputs = [[5, 6, 7, 8, 9], list(range(10, 60)), [3]]
    for ids, got in zip(inputs, ours.encode(inputs)):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
