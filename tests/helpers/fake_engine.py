"""A ``FakeEngineClient``: the engine boundary with deterministic tokens and no model.

Handler, protocol and bad-input tests run the real app in-process on it (milliseconds per
request); the tests that exist to check the real model keep using a real server. Output token
``i`` of a request is a fixed function of its prompt and ``i`` (ordinary word tokens of the
embedded model's tokenizer), and the real incremental detokenizer applies stop strings, so
streaming, ``n``, stop and length behave as they do on the engine.
"""

from __future__ import annotations

import asyncio
from functools import lru_cache
from typing import AsyncIterator

from llmkit.core.engine.client import QueueSlots
from llmkit.core.engine.detokenizer import IncrementalDetokenizer
from llmkit.core.engine.messages import GenerateRequest, RequestOutput, TokenLogprob
from llmkit.core.grammar.contract import GrammarError, GrammarSpec
from llmkit.core.grammar.limits import GrammarLimits, check_spec

WORDS = [" the", " cat", " sat", " on", " a", " mat", ".", " It", " was", " warm"]


@lru_cache(maxsize=1)
def embedded_tokenizer():
    from transformers import AutoTokenizer

    from llmkit.core.model.loader.source import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))


class FakeEngineClient(QueueSlots):
    def __init__(self, tokenizer, *, max_context: int = 8192, max_queued: int = 1024) -> None:
        super().__init__(max_queued)
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.vocab_size = len(tokenizer)
        self.dead = None
        self.word_ids = [tokenizer.encode(w, add_special_tokens=False)[0] for w in WORDS]
        self.submitted: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.stalled_s = 0.0  # progress_age: a test sets it to play a hung engine

    async def check_grammar(self, spec: GrammarSpec) -> None:
        try:  # the cheap limits only: the fake does not constrain its output
            check_spec(spec.kind, spec.value, GrammarLimits())
        except ValueError as exc:
            raise GrammarError(spec.param, str(exc)) from None

    def token(self, req: GenerateRequest, i: int) -> int:
        return self.word_ids[(sum(req.prompt_ids) + i) % len(self.word_ids)]

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.submitted.append(req)
        p = req.params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, p.skip_special_tokens, p.stop, p.no_stop_trim)
        ids: list[int] = []
        finished = False
        try:
            while not finished:
                await asyncio.sleep(0)
                tok = self.token(req, len(ids))
                ids.append(tok)
                hit = detok.add_token(tok)
                reason = matched = None
                if hit is not None and len(ids) >= p.min_new_tokens:
                    reason, matched = "stop", hit.text
                elif len(ids) >= p.max_new_tokens or len(req.prompt_ids) + len(ids) >= self.max_context:
                    reason = "length"
                finished = reason is not None
                if finished:
                    detok.flush()
                lps = [TokenLogprob(tok, -0.5, [(tok, -0.5)][: p.top_logprobs])] if p.logprobs else []
                yield RequestOutput(
                    rid=req.rid,
                    text=detok.take_delta(finished),
                    token_ids=[tok],
                    logprobs=lps,
                    finished=finished,
                    finish_reason=reason,
                    matched_stop=matched,
                    prompt_tokens=len(req.prompt_ids),
                    completion_tokens=len(ids),
                    prompt_logprobs=[None] * len(req.prompt_ids)
                    if req.return_prompt_logprobs and len(ids) == 1
                    else None,
                )
        finally:
            if not finished:
                self.aborted.append(req.rid)

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def alive(self) -> bool:
        return True

    def degraded(self) -> str | None:
        return None

    def progress_age(self) -> float:
        return self.stalled_s

    def stats(self) -> dict:
        return {"num_running_reqs": 0, "num_waiting_reqs": 0, "kv_pages_in_use": 0}

    async def flush_cache(self) -> bool:
        self.flushes = getattr(self, "flushes", 0) + 1
        return True

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Takes any adapter (the real engine reads and checks it); records what it was given."""
        self.lora_loads = [*getattr(self, "lora_loads", []), (name, path)]

    async def unload_lora_adapter(self, name: str) -> None:
        pass

    def shutdown(self) -> None:
        pass


def fake_app(storage=None, **config):
    """The real OpenAI app over a :class:`FakeEngineClient` (use with ``fastapi.testclient``);
    ``storage`` keeps stored Responses (None: in memory)."""
    from llmkit.core.server.app import create_app
    from llmkit.core.server.config import ServerConfig
    from llmkit.core.server.prompts.chat_template import ChatTemplate
    from llmkit.core.server.state import ServerState

    config.setdefault("served_model_aliases", ("m",))  # the tests' short name for the model
    tok = embedded_tokenizer()
    client = FakeEngineClient(tok)
    template = ChatTemplate(tok.chat_template, tok.bos_token or "", tok.eos_token or "")
    state = ServerState(
        client=client,
        tokenizer=tok,
        chat_template=template,
        options=ServerConfig(served_model_name="fake-model", **config),
        max_context=client.max_context,
        vocab_size=client.vocab_size,
    )
    return create_app(state, storage=storage)


class FakeEmbedder:
    """The :class:`~llmkit.core.embedding.engine.EmbeddingEngine` boundary with no model: every
    input's vector is the same unit vector, every pair's score 0.5. ``kind`` is ``embed`` (a
    bi-encoder) or ``score`` (a cross-encoder); ``inputs`` records what it was handed."""

    def __init__(self, kind: str = "embed", max_input_tokens: int = 256) -> None:
        self.kind = kind
        self.max_input_tokens = max_input_tokens
        self.dimensions = None
        self.pair_template = None
        self.draining = False
        self.max_queued = 1024
        self.inputs: list[list[int]] = []

    def _done(self, value):
        from concurrent.futures import Future

        future: Future = Future()
        future.set_result(value)
        return future

    def embed(self, inputs, dimensions=None):
        self.inputs += inputs
        return self._done([[1.0] + [0.0] * 7 for _ in inputs])

    def score(self, inputs, type_ids=None, activate=True):
        self.inputs += inputs
        return self._done([0.5] * len(inputs))

    def alive(self) -> bool:
        return True

    def degraded(self) -> str | None:
        return None

    def progress_age(self) -> float:
        return 0.0

    def stats(self) -> dict:
        return {}

    async def flush_cache(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


@lru_cache(maxsize=1)
def encoder_tokenizer():
    """The packaged embedding model's tokenizer (all-MiniLM-L6-v2's WordPiece)."""
    from transformers import AutoTokenizer

    from llmkit.core.model.loader.embedded_encoder import embedded_encoder_dir

    return AutoTokenizer.from_pretrained(str(embedded_encoder_dir()))


def fake_embedding_app(kind: str = "embed", max_input_tokens: int = 256, **config):
    """The real app of an embedding (``kind="embed"``) or reranking (``"score"``) server over a
    :class:`FakeEmbedder`, with the packaged embedding model's tokenizer, as launch builds it."""
    from llmkit.core.server.app import create_app
    from llmkit.core.server.config import ServerConfig
    from llmkit.core.server.state import ServerState

    config.setdefault("served_model_aliases", ("m",))
    tok = encoder_tokenizer()
    embedder = FakeEmbedder(kind, max_input_tokens)
    state = ServerState(
        client=embedder,
        tokenizer=tok,
        chat_template=None,
        options=ServerConfig(served_model_name="fake-encoder", is_embedding=True, warm_routes=False, **config),
        max_context=max_input_tokens,
        vocab_size=len(tok),
        embedder=embedder,
    )
    return create_app(state)
