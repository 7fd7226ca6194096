"""SGLang's native ``POST /generate``: raw text or token ids in, text, ids and ``meta_info`` out.

One prompt (``text`` str / ``input_ids`` list of ints) gives one object; a batch (a list of
either) gives a list, prompt-major when ``sampling_params.n`` > 1. Streaming sends SGLang's
cumulative chunks (the text so far) per item, then ``data: [DONE]``. Sampling goes through the
same checks as the OpenAI endpoints, under SGLang's parameter names.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from pydantic import ConfigDict

from llmkit.core.engine.messages import GenerateRequest as EngineRequest
from llmkit.core.server.errors import APIError
from llmkit.core.server.generation.length_limit import check_max_tokens
from llmkit.core.server.generation.logprobs import check_prompt_logprobs
from llmkit.core.server.generation.sampling import build_sampling_params, seed_for_choice
from llmkit.core.server.model_names import resolve_adapter
from llmkit.core.server.nullable import RequestModel
from llmkit.core.server.prompts.prompt import tokenize_text
from llmkit.core.server.state import new_id, start_generation
from llmkit.core.server.streaming import sse, sse_done, sse_response, watch_disconnect


class GenerateSampling(RequestModel):
    # SGLang refuses unknown sampling parameters; so do we, naming them.
    model_config = ConfigDict(extra="forbid", strict=True)
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    # left out (or null): the server's defaults, as on every route (generation/sampling_defaults.py)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # SGLang's: the JSON text of a structural_tag response_format
    n: int = 1
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None

    # the attribute names build_sampling_params and attach_grammar read
    @property
    def min_tokens(self) -> int:
        return self.min_new_tokens

    @property
    def seed(self) -> int | None:
        return self.sampling_seed


class GenerateRequest(RequestModel):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    rid: str | None = None
    model: str | None = None  # a LoRA adapter's name (or the served model's)
    # SGLang's images: per prompt one or a list of (data:, http(s): or file: URLs, or base64); the
    # prompt writes the model's image placeholder once per image
    image_data: str | list[str | None | list[str]] | None = None


async def _prompts(state, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether the request was a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise APIError("exactly one of text or input_ids is required", param="text")
    if body.text is not None:
        batch = isinstance(body.text, list)
        texts = body.text if batch else [body.text]
        if not texts or any(not t for t in texts):
            raise APIError("text cannot be empty", param="text")
        return [await tokenize_text(state, t, param="text") for t in texts], batch
    ids = body.input_ids
    batch = bool(ids) and isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    if not prompts or any(not p for p in prompts):
        raise APIError("input_ids cannot be empty", param="input_ids")
    for p in prompts:
        bad = [t for t in p if not 0 <= t < state.vocab_size]
        if bad:
            raise APIError(f"input_ids {bad[:10]} are out of vocabulary (size {state.vocab_size})", param="input_ids")
    return prompts, batch


async def _images(state, body: GenerateRequest, prompts: list[list[int]], batch: bool) -> list:
    """Each prompt's MultimodalInputs (None without images); ``prompts`` get the images' tokens."""
    data = body.image_data
    if data is None:
        return [None] * len(prompts)
    if batch:
        if not isinstance(data, list) or len(data) != len(prompts):
            raise APIError("image_data must have one entry per prompt", param="image_data")
        per = [[] if d is None else [d] if isinstance(d, str) else d for d in data]
    else:
        per = [[data] if isinstance(data, str) else data]
    from llmkit.core.server.prompts.images import attach_images

    out = []
    for pi, images in enumerate(per):
        if not images:
            out.append(None)
            continue
        where = f"image_data[{pi}]" if batch else "image_data"
        if any(not isinstance(x, str) or not x for x in images):
            raise APIError(f"{where}: each image is a non-empty string", param=where)
        if body.return_logprob and body.logprob_start_len >= 0:
            raise APIError("input logprobs are not served for prompts with images", param="logprob_start_len")
        sources = [(x, f"{where}[{k}]" if len(images) > 1 else where, True) for k, x in enumerate(images)]
        if state.mm is not None and prompts[pi].count(state.mm.placeholder_id) != len(images):
            raise APIError(
                f"{where}: the prompt must write {state.mm.placeholder_text!r} once per image "
                f"({len(images)} images, {prompts[pi].count(state.mm.placeholder_id)} placeholders)",
                param=where,
            )
        prompts[pi], mm = await attach_images(state, prompts[pi], sources, where)
        out.append(mm)
    return out


class _Item:
    """One output's accumulated state."""

    def __init__(self, rid: str, prompt_len: int) -> None:
        self.rid, self.prompt_len = rid, prompt_len
        self.text, self.ids, self.lps, self.final = "", [], [], None
        self.prompt_lps = None

    def add(self, out) -> None:
        self.text += out.text
        self.ids += out.token_ids
        self.lps += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_lps = out.prompt_logprobs
        if out.finished:
            self.final = out


def _lp_triple(tok, token_id: int, lp: float | None, with_text: bool):
    return [lp, token_id, tok.decode([token_id]) if with_text else None]


def _meta(state, body: GenerateRequest, item: _Item, started: float, prompt_ids: list[int]) -> dict:
    fin = item.final
    meta: dict[str, Any] = {
        "id": item.rid,
        "prompt_tokens": item.prompt_len,
        "completion_tokens": len(item.ids),
        "cached_tokens": 0,
        "finish_reason": None,
        "e2e_latency": time.monotonic() - started,
    }
    if fin is not None:
        meta["cached_tokens"] = fin.cached_tokens
        if fin.finish_reason == "length":
            meta["finish_reason"] = {"type": "length", "length": len(item.ids)}
        else:
            meta["finish_reason"] = {"type": fin.finish_reason, "matched": fin.matched_stop}
    if body.return_logprob:
        tok, wt = state.tokenizer, body.return_text_in_logprobs
        meta["output_token_logprobs"] = [_lp_triple(tok, x.token_id, x.logprob, wt) for x in item.lps]
        meta["output_top_logprobs"] = [[_lp_triple(tok, t, lp, wt) for t, lp in x.top] for x in item.lps]
        if body.logprob_start_len >= 0 and item.prompt_lps is not None:
            start = min(body.logprob_start_len, len(prompt_ids))
            meta["input_token_logprobs"] = [
                _lp_triple(tok, prompt_ids[i], None if x is None else x.logprob, wt)
                for i, x in enumerate(item.prompt_lps[start:], start)
            ]
    return meta


def _sampling(d: dict) -> GenerateSampling:
    from llmkit.core.server.body import parse_model

    try:
        return parse_model(GenerateSampling, d)
    except APIError as exc:
        exc.param = f"sampling_params.{exc.param}" if exc.param else "sampling_params"
        exc.message = f"sampling_params.{exc.message}"
        raise


def generate_router(state) -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(raw: HTTPRequest):
        from llmkit.core.server.body import parse_model, read_json
        from llmkit.core.server.generation.structured import attach_grammar

        started = time.monotonic()
        body = parse_model(GenerateRequest, await read_json(raw))
        lora = await resolve_adapter(state, body, raw)  # by model, or SGLang's lora_path
        sp = body.sampling_params
        sps = [_sampling(d) for d in sp] if isinstance(sp, list) else [_sampling(sp or {})]
        for s in sps:  # field checks, before the prompts are tokenized
            check_max_tokens(s.max_new_tokens, "max_new_tokens")
        prompts, batch = await _prompts(state, body)
        mms = await _images(state, body, prompts, batch)
        if not isinstance(sp, list):
            sps = sps * len(prompts)
        if len(sps) != len(prompts):
            raise APIError("sampling_params must have one entry per prompt", param="sampling_params")
        if len(prompts) > state.options.max_prompt_list:
            raise APIError(f"at most {state.options.max_prompt_list} prompts per request", param="text")
        if body.top_logprobs_num and not body.return_logprob:
            raise APIError("top_logprobs_num requires return_logprob", param="top_logprobs_num")
        rid = body.rid or new_id("")
        reqs, items, prompt_of = [], [], []
        for pi, (ids, s) in enumerate(zip(prompts, sps)):
            params = build_sampling_params(
                s,
                prompt_len=len(ids),
                max_context=state.max_context,
                vocab_size=state.vocab_size,
                max_tokens=s.max_new_tokens,
                logprobs=body.return_logprob,
                top_logprobs=body.top_logprobs_num,
                defaults=state.sampling_defaults,
                max_tokens_param="max_new_tokens",
                prompt_param="text" if body.text is not None else "input_ids",
            )
            group = []
            for k in range(s.n):
                r = EngineRequest(
                    rid=f"{rid}-{pi}-{k}",
                    prompt_ids=ids,
                    params=seed_for_choice(params, k),
                    return_prompt_logprobs=body.return_logprob and body.logprob_start_len >= 0,
                    lora=lora,
                    mm=mms[pi],
                )
                group.append(r)
                items.append(_Item(r.rid, len(ids)))
                prompt_of.append(ids)
            await attach_grammar(state, s, group)
            reqs += group
        check_prompt_logprobs(state, reqs, "return_logprob")
        # Checked and taken with no await in between, so two concurrent requests cannot both pass.
        if rid in state.generate_rids:
            # The engine keys a request's outputs by its id: a second one under the same id would
            # take the first's stream and leave it (and its engine slot) waiting forever.
            raise APIError(f"a request with rid '{rid}' is already in flight; give each its own rid", param="rid")
        gen = start_generation(state, reqs, http=True)
        if body.rid is not None:
            state.generate_rids.add(rid)
            ended = asyncio.gather(*gen.tasks, return_exceptions=True)
            ended.add_done_callback(lambda _f: state.generate_rids.discard(rid))
        many = batch or len(reqs) > 1

        def result(i: int) -> dict:
            it = items[i]
            out = {"text": it.text, "output_ids": it.ids, "meta_info": _meta(state, body, it, started, prompt_of[i])}
            return {**out, "index": i} if many and body.stream else out

        if body.stream:

            async def events():
                try:
                    async for i, out in gen.outputs():
                        if out.error:
                            yield sse(APIError(out.error, status=500).body())
                            break
                        items[i].add(out)
                        if out.text or out.finished:
                            yield sse(result(i))
                except APIError as exc:  # shutdown or queue timeout: a final error event
                    yield sse(exc.body())
                finally:
                    gen.cancel()
                yield sse_done()

            return sse_response(gen, events())

        async def complete():
            async for i, out in gen.outputs():
                if out.error:
                    raise APIError(out.error, status=500)
                items[i].add(out)
            results = [result(i) for i in range(len(items))]
            return JSONResponse(results if many else results[0])

        return await watch_disconnect(raw, complete())

    return router
