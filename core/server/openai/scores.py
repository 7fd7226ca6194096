"""POST /v1/rerank (Jina's and Cohere's shape, as vLLM serves it; also at /rerank and /v2/rerank)
and POST /v1/score (vLLM's ``text_1``/``text_2``; also at /score).

A reranker (a cross-encoder such as ``BertForSequenceClassification``, or a causal LM served with
``--is-reranker``) reads each (query, document) pair as one input and scores it: its logit through
its activation (sigmoid for one label, vLLM's and sentence-transformers' default;
``use_activation: false`` returns the raw logit). A bi-encoder scores at /v1/score with the cosine
of the two texts' vectors, as vLLM does; it does not rerank (400).

Rerank results come sorted by score, highest first, cut to ``top_n`` (0 or absent: all); each
carries its ``document`` (``{"text"}``, as vLLM always returns it) unless ``return_documents`` is
false (Cohere's default, which leaves it out).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import torch
from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from llmkit.core.server.body import parse_model, read_json
from llmkit.core.server.errors import APIError
from llmkit.core.server.model_names import check_model
from llmkit.core.server.nullable import RequestModel
from llmkit.core.server.openai.embedder_calls import call_embedder
from llmkit.core.server.prompts.prompt import check_prompt_size, check_unicode, token_chars
from llmkit.core.server.streaming import watch_disconnect


class RerankRequest(RequestModel):
    query: Any  # checked by _text / _texts, for errors that say what is wrong
    documents: Any
    model: str = "default"
    top_n: int = 0
    return_documents: bool = True
    use_activation: bool = True


class ScoreRequest(RequestModel):
    text_1: Any
    text_2: Any
    model: str = "default"
    use_activation: bool = True


def _text(value, param: str) -> str:
    if not isinstance(value, str):
        raise APIError(f"'{param}' must be a string", param=param)
    if not value:
        raise APIError(f"'{param}' is an empty string", param=param)
    check_unicode(value, param)
    return value


def _texts(value, param: str, *, objects: bool = False) -> list[str]:
    """A non-empty list of non-empty strings (with ``objects``, also ``{"text": ...}`` items)."""
    if isinstance(value, str) and not objects:
        value = [value]
    if not isinstance(value, list):
        raise APIError(f"'{param}' must be a list of strings", param=param)
    if not value:
        raise APIError(f"'{param}' is empty: send at least one", param=param)
    out = []
    for i, item in enumerate(value):
        if objects and isinstance(item, dict) and set(item) == {"text"}:
            item = item["text"]
        if not isinstance(item, str):
            shape = " or an object with 'text'" if objects else ""
            raise APIError(f"{param}[{i}] must be a string{shape}", param=param)
        if not item:
            raise APIError(f"{param}[{i}] is an empty string", param=param)
        check_unicode(item, param)
        out.append(item)
    return out


def _served_name(state, body) -> str:
    return body.model if "model" in body.model_fields_set else state.options.served_model_name


def _check_count(state, n: int, what: str, param: str) -> None:
    cap = state.options.max_embedding_inputs
    if n > cap:
        raise APIError(f"{n} {what} in one request; at most {cap} (--max-embedding-inputs)", param=param)


def _check_lengths(ids: list[list[int]], limit: int, what: str) -> None:
    long = next((i for i, row in enumerate(ids) if len(row) > limit), None)
    if long is not None:
        raise APIError(f"{what} {long} is {len(ids[long])} tokens; this model reads at most {limit} tokens")


def _check_chars(state, queries: list[str], docs: list[str], params: tuple[str, str]) -> None:
    """Refuse, by its characters and untokenized, a text (a bi-encoder embeds each alone) or a
    pair (a reranker reads both as one input) that the model's input limit cannot hold."""
    chars = {t: token_chars(state.tokenizer, t) for t in dict.fromkeys(queries + docs)}
    for q, d in zip(queries, docs):
        if state.embedder.kind == "embed":
            check_prompt_size(state, chars[q], params[0])
            check_prompt_size(state, chars[d], params[1])
        else:
            check_prompt_size(state, chars[q] + chars[d], params[0] if chars[q] > chars[d] else params[1])


async def _pair_scores(
    state, queries: list[str], docs: list[str], activate: bool, params: tuple[str, str], http: bool
) -> tuple[list[float], int]:
    """The scores of the pairs ``zip(queries, docs)`` and the tokens read (``params``: the
    fields the queries and the documents came in, named by a refusal)."""
    engine, tok = state.embedder, state.tokenizer
    if sum(map(len, queries)) + sum(map(len, docs)) > state.options.max_prompt_size:
        raise APIError(f"the texts are longer than {state.options.max_prompt_size} characters (--max-prompt-size)")
    _check_chars(state, queries, docs, params)
    if engine.kind == "embed":  # a bi-encoder: the cosine of the two vectors
        unique = list(dict.fromkeys(queries + docs))
        ids = await asyncio.to_thread(lambda: tok(unique, add_special_tokens=True)["input_ids"])
        _check_lengths(ids, engine.max_input_tokens, "text")
        got = await call_embedder(state, ids, lambda: engine.embed(ids), http=http, param=params[1])
        vectors = dict(zip(unique, torch.tensor(got)))
        a, b = torch.stack([vectors[q] for q in queries]), torch.stack([vectors[d] for d in docs])
        return torch.nn.functional.cosine_similarity(a, b, dim=1).tolist(), sum(map(len, ids))
    template = engine.pair_template
    if template is None:  # a cross-encoder: the tokenizer's text pair, with token types
        enc = await asyncio.to_thread(lambda: tok(queries, docs, add_special_tokens=True))
        ids, types = enc["input_ids"], enc.get("token_type_ids")
    else:  # a causal reranker: its prompt, special tokens written in it
        head, rest = template.split("{query}", 1)
        middle, tail = rest.split("{document}", 1)  # split once: a text may itself hold "{document}"
        prompts = [head + q + middle + d + tail for q, d in zip(queries, docs)]
        ids = await asyncio.to_thread(lambda: tok(prompts, add_special_tokens=False)["input_ids"])
        types = None
    _check_lengths(ids, engine.max_input_tokens, "pair")
    scores = await call_embedder(state, ids, lambda: engine.score(ids, types, activate), http=http, param=params[1])
    return scores, sum(map(len, ids))


def _check_served(state, route: str, rerank: bool) -> None:
    engine, name = state.embedder, state.options.served_model_name
    if engine is None:
        raise APIError(
            f"the model `{name}` generates text; it does not serve {route}: serve a reranker (a cross-encoder, "
            "or a causal LM with --is-reranker)",
            code="model_not_reranker",
        )
    if rerank and engine.kind == "embed":
        raise APIError(
            f"the model `{name}` is an embedding model; it does not rerank: use /v1/score (cosine of its vectors) "
            "or /v1/embeddings, or serve a reranker for /v1/rerank",
            code="model_not_reranker",
        )


async def rerank(state, body: RerankRequest, http: bool = False) -> dict:
    _check_served(state, "/v1/rerank", rerank=True)
    check_model(state.options, body)
    query = _text(body.query, "query")
    docs = _texts(body.documents, "documents", objects=True)
    if body.top_n < 0:
        raise APIError("'top_n' must be 0 (all) or more", param="top_n")
    _check_count(state, len(docs), "documents", "documents")
    scores, tokens = await _pair_scores(
        state, [query] * len(docs), docs, body.use_activation, ("query", "documents"), http
    )
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[: body.top_n or None]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": docs[i]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": _served_name(state, body),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }


async def score(state, body: ScoreRequest, http: bool = False) -> dict:
    _check_served(state, "/v1/score", rerank=False)
    check_model(state.options, body)
    first, second = _texts(body.text_1, "text_1"), _texts(body.text_2, "text_2")
    if len(first) == 1:
        first = first * len(second)  # one against each
    elif len(first) != len(second):
        raise APIError(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: pair them 1 to N or N to N", param="text_2"
        )
    _check_count(state, len(second), "pairs", "text_2")
    scores, tokens = await _pair_scores(state, first, second, body.use_activation, ("text_1", "text_2"), http)
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": _served_name(state, body),
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }


async def _json(body) -> Response:
    return JSONResponse(await body)


def scores_router(state) -> APIRouter:
    router = APIRouter()

    # a client gone before its answer: cancelled, so the embedder drops its inputs not scored yet
    async def rerank_route(raw: HTTPRequest):
        request = parse_model(RerankRequest, await read_json(raw))
        return await watch_disconnect(raw, _json(rerank(state, request, http=True)))

    async def score_route(raw: HTTPRequest):
        request = parse_model(ScoreRequest, await read_json(raw))
        return await watch_disconnect(raw, _json(score(state, request, http=True)))

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        router.add_api_route(path, rerank_route, methods=["POST"])
    for path in ("/v1/score", "/score"):
        router.add_api_route(path, score_route, methods=["POST"])
    return router
