"""POST /v1/embeddings, as OpenAI's: ``input`` as a string, a list of strings, token ids or a list
of token-id lists; vectors as floats or base64 (little-endian float32, what the SDK decodes);
``dimensions`` for Matryoshka models; ``usage`` counting the input tokens.

Inputs are tokenized here (with the model's special tokens, as sentence-transformers does; token
ids are taken as given) and embedded by the server's embedder (``state.embedder``, an
:class:`~llmkit.core.embedding.engine.EmbeddingEngine`, duck-typed), which batches concurrent
requests together.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Response
from fastapi import Request as HTTPRequest

from llmkit.core.server.body import parse_model, read_json
from llmkit.core.server.errors import APIError
from llmkit.core.server.model_names import check_model
from llmkit.core.server.nullable import RequestModel
from llmkit.core.server.openai.embedder_calls import call_embedder
from llmkit.core.server.prompts.prompt import check_prompt_size, check_unicode, token_chars
from llmkit.core.server.streaming import watch_disconnect


class EmbeddingRequest(RequestModel):
    input: Any  # checked by _inputs, for errors that say which input is wrong and how
    model: str = "default"
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's: embed at most this many tokens of each input (-1: the model's limit) instead of
    # refusing a longer one; a text keeps its special tokens, token ids keep their last ones.
    truncate_prompt_tokens: int | None = None


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(type(t) is int for t in x)


def _inputs(raw) -> tuple[list[str] | None, list[list[int]] | None]:
    """``input`` as texts or as token-id lists (one of the two), refusing empty inputs and mixed types."""
    wrong = APIError(
        "'input' must be a string, a list of strings, a list of token ids, or a list of token-id lists",
        param="input",
    )
    if isinstance(raw, str):
        raw = [raw]
    elif not isinstance(raw, list):
        raise wrong
    elif not raw:
        raise APIError("'input' is empty: send at least one input", param="input")
    elif all(type(t) is int for t in raw):
        raw = [raw]
    if all(isinstance(t, str) for t in raw):
        empty = next((i for i, t in enumerate(raw) if not t), None)
        if empty is not None:
            raise APIError(f"input[{empty}] is an empty string", param="input")
        for t in raw:
            check_unicode(t, "input")
        return raw, None
    if all(_is_ids(t) for t in raw):
        empty = next((i for i, t in enumerate(raw) if not t), None)
        if empty is not None:
            raise APIError(f"input[{empty}] is an empty list of token ids", param="input")
        return None, raw
    raise wrong


def _check(state, body: EmbeddingRequest, texts, ids) -> None:
    embedder, opts = state.embedder, state.options
    n = len(texts if texts is not None else ids)
    if n > opts.max_embedding_inputs:
        raise APIError(
            f"{n} inputs in one request; at most {opts.max_embedding_inputs} (--max-embedding-inputs)", param="input"
        )
    if texts is not None and sum(map(len, texts)) > opts.max_prompt_size:
        raise APIError(f"the inputs are longer than {opts.max_prompt_size} characters (--max-prompt-size)")
    if texts is not None and body.truncate_prompt_tokens is None:
        for t in texts:  # one too long for the model is refused by its characters, untokenized
            check_prompt_size(state, token_chars(state.tokenizer, t), "input")
    if ids is not None:
        bad = next((t for row in ids for t in row if not 0 <= t < state.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is outside the vocabulary (0..{state.vocab_size - 1})", param="input")
    if body.dimensions is not None:
        allowed = embedder.dimensions
        if allowed is None:
            raise APIError(
                f"the model `{opts.served_model_name}` does not support 'dimensions' (it is not a Matryoshka "
                "model); leave it out for the full vector",
                param="dimensions",
            )
        if body.dimensions not in allowed:
            shown = f"1..{max(allowed)}" if len(allowed) == max(allowed) else ", ".join(map(str, allowed))
            raise APIError(f"'dimensions' must be one of {shown}, not {body.dimensions}", param="dimensions")


def _truncation(body: EmbeddingRequest, limit: int) -> int | None:
    k = body.truncate_prompt_tokens
    if k is None:
        return None
    if k == -1:
        return limit
    if not 1 <= k <= limit:
        raise APIError(
            f"'truncate_prompt_tokens' must be -1 (the model's limit) or 1..{limit}, not {k}",
            param="truncate_prompt_tokens",
        )
    return k


def _tokenize(tok, texts: list[str], keep: int | None) -> list[list[int]]:
    """Token ids with the model's special tokens, as sentence-transformers tokenizes. With
    ``keep``, each text's own tokens are cut (on the tokenizer's truncation side) so that they
    and the special tokens around them fit ``keep``; the cut is made here, since the tokenizer's
    own truncation is state the request threads would share."""
    if keep is None:
        return tok(texts, add_special_tokens=True)["input_ids"]
    enc = tok(texts, add_special_tokens=True, return_special_tokens_mask=True)
    left = getattr(tok, "truncation_side", "right") == "left"
    out = []
    for row, special in zip(enc["input_ids"], enc["special_tokens_mask"]):
        if len(row) <= keep:
            out.append(row)
            continue
        head = next((i for i, s in enumerate(special) if not s), len(row))  # leading special tokens
        tail = next((i for i, s in enumerate(reversed(special)) if not s), 0)  # trailing ones
        room = keep - head - tail
        if room < 1:
            raise APIError(f"'truncate_prompt_tokens' {keep} leaves no room beside the special tokens")
        text = row[head : len(row) - tail]
        out.append(row[:head] + (text[-room:] if left else text[:room]) + row[len(row) - tail :])
    return out


def _check_lengths(ids: list[list[int]], limit: int) -> None:
    long = next((i for i, row in enumerate(ids) if len(row) > limit), None)
    if long is not None:
        raise APIError(
            f"input[{long}] is {len(ids[long])} tokens; this model embeds at most {limit} tokens per input",
            param="input",
        )


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    data = struct.pack(f"<{len(vector)}f", *vector)  # little-endian float32, whatever this machine is
    return base64.b64encode(data).decode("ascii")


async def create_embedding(state, body: EmbeddingRequest, http: bool = False) -> dict:
    """The response body; ``http``: a client's request (not a batch line), held to the queue bound
    and charged to the caller's tokens per minute (see :mod:`.embedder_calls`)."""
    if state.embedder is None:
        raise APIError(
            f"the model `{state.options.served_model_name}` generates text; it does not serve embeddings: "
            "serve an embedding model (llmkit serve --model-path DIR, or --is-embedding) for /v1/embeddings",
            code="model_not_embedding",
        )
    if state.embedder.kind == "score":
        raise APIError(
            f"the model `{state.options.served_model_name}` is a reranker; it scores pairs and does not embed: "
            "use /v1/rerank or /v1/score, or serve an embedding model for /v1/embeddings",
            code="model_not_embedding",
        )
    check_model(state.options, body)
    texts, ids = _inputs(body.input)
    _check(state, body, texts, ids)
    keep = _truncation(body, state.embedder.max_input_tokens)
    if texts is not None:
        ids = await asyncio.to_thread(_tokenize, state.tokenizer, texts, keep)
    elif keep is not None:
        ids = [row[-keep:] for row in ids]
    _check_lengths(ids, state.embedder.max_input_tokens)
    vectors = await call_embedder(
        state, ids, lambda: state.embedder.embed(ids, body.dimensions), http=http, param="input"
    )
    tokens = sum(map(len, ids))
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": body.model if "model" in body.model_fields_set else state.options.served_model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def embeddings_router(state) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(raw: HTTPRequest):
        request = parse_model(EmbeddingRequest, await read_json(raw))

        async def respond() -> Response:
            body = await create_embedding(state, request, http=True)
            # orjson, not FastAPI's encoder: 32 vectors of 384 floats take it 0.8 ms against 33 ms,
            # on the event loop every request shares
            return Response(orjson.dumps(body), media_type="application/json")

        # a client gone before its answer: cancelled, so the embedder drops its inputs not embedded yet
        return await watch_disconnect(raw, respond())

    return router
