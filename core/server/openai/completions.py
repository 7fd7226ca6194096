"""POST /v1/completions: no chat template; list and token-id prompts; echo; int logprobs."""

from __future__ import annotations

import time

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from llmkit.core.engine.messages import GenerateRequest
from llmkit.core.server.errors import APIError
from llmkit.core.server.generation.length_limit import check_max_tokens
from llmkit.core.server.generation.logprobs import CompletionLogprobs, check_prompt_logprobs
from llmkit.core.server.generation.sampling import build_sampling_params, seed_for_choice
from llmkit.core.server.model_names import resolve_adapter
from llmkit.core.server.openai.protocol import CompletionRequest
from llmkit.core.server.prompts.prompt import tokenize_text
from llmkit.core.server.state import ServerState, new_id, start_generation, usage, wants_stream_usage
from llmkit.core.server.streaming import (
    check_stream_options,
    continuous_usage,
    sse,
    sse_done,
    sse_response,
    watch_disconnect,
)


async def _prompts(state: ServerState, body: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """Each prompt as (text or None, token ids)."""
    p = body.prompt
    if isinstance(p, str):
        items = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise APIError("Prompt cannot be empty", param="prompt")
    if len(items) > state.options.max_prompt_list:
        raise APIError(f"at most {state.options.max_prompt_list} prompts per request", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise APIError("Prompt cannot be empty", param="prompt")
            out.append((item, await tokenize_text(state, item, param="prompt")))
        else:
            if not item:
                raise APIError("Prompt cannot be empty", param="prompt")
            bad = [t for t in item if not 0 <= t < state.vocab_size]
            if bad:
                raise APIError(
                    f"prompt token ids {bad[:10]} are out of vocabulary (size {state.vocab_size})", param="prompt"
                )
            out.append((None, list(item)))
    return out


async def create_completion(state: ServerState, body: CompletionRequest, raw: HTTPRequest | None, priority: int = 0):
    lora = await resolve_adapter(state, body, raw)
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(
            "best_of is not supported (no server-side ranking): leave it out, or set it equal to n", param="best_of"
        )
    if body.suffix:
        raise APIError("suffix is not supported", param="suffix")
    check_stream_options(body)
    check_max_tokens(body.max_tokens)  # a field check, before the prompts are tokenized
    prompts = await _prompts(state, body)
    n_lp = body.logprobs or 0
    cid = new_id("cmpl-")
    reqs, echoes = [], []
    for pi, (text, ids) in enumerate(prompts):
        params = build_sampling_params(
            body,
            prompt_len=len(ids),
            max_context=state.max_context,
            vocab_size=state.vocab_size,
            max_tokens=body.max_tokens,
            logprobs=body.logprobs is not None,
            top_logprobs=n_lp,
            defaults=state.sampling_defaults,
            prompt_param="prompt",
        )
        if text is None:
            # Echo shows a token prompt as given, special tokens included (as vLLM does), so the
            # text agrees with logprobs.tokens and text_offset, which list every prompt token.
            text = state.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for s in range(body.n):
            r = GenerateRequest(
                rid=f"{cid}-{pi}-{s}",
                prompt_ids=ids,
                params=seed_for_choice(params, s),
                return_prompt_logprobs=body.echo and body.logprobs is not None,
                priority=priority,
                lora=lora,
                cache_salt=body.cache_salt,
            )
            reqs.append(r)
            echoes.append(text if body.echo else "")
    check_prompt_logprobs(state, reqs, "echo")
    from llmkit.core.server.generation.structured import attach_grammar

    await attach_grammar(state, body, reqs)  # no chat template: no reasoning block to wait for
    gen = start_generation(state, reqs, http=raw is not None)  # starts now: queue slots are held until each ends
    created = int(time.time())
    if body.stream:
        return sse_response(
            gen, _stream(state, gen, body, reqs, echoes, cid, created, wants_stream_usage(state, body), len(prompts))
        )
    return await watch_disconnect(raw, _complete(state, gen, body, reqs, echoes, cid, created, len(prompts)))


def _new_lp(state, body, req, echo: str):
    if body.logprobs is None:
        return None
    return CompletionLogprobs(state.tokenizer, offset=len(echo))


def _add_prompt_lps(acc: CompletionLogprobs, req: GenerateRequest, prompt_lps) -> None:
    acc.offset = 0
    for pos, tid in enumerate(req.prompt_ids):
        lp = prompt_lps[pos] if prompt_lps and pos < len(prompt_lps) else None
        acc.add(tid, lp)


def _add_output_lps(acc: CompletionLogprobs, out) -> None:
    """The generated tokens' logprobs, without a matched stop token: it is not in the text, so
    its entry would point past the end of it."""
    pairs = list(zip(out.token_ids, out.logprobs))
    if (
        out.finished
        and pairs
        and out.finish_reason == "stop"
        and isinstance(out.matched_stop, int)
        and pairs[-1][0] == out.matched_stop
    ):
        pairs.pop()
    for tid, lp in pairs:
        acc.add(tid, lp)


def _usage(reqs, finals, n_prompts) -> dict:
    """Prompt tokens count once per prompt (not per choice); completions add up."""
    per_prompt = len(reqs) // n_prompts
    prompt_tokens = sum(finals[i].prompt_tokens for i in range(0, len(reqs), per_prompt))
    return usage(prompt_tokens, sum(f.completion_tokens for f in finals), max(f.cached_tokens for f in finals))


async def _complete(state, gen, body, reqs, echoes, cid, created, n_prompts):
    texts = list(echoes)
    finals = [None] * len(reqs)
    accs = [_new_lp(state, body, r, e) for r, e in zip(reqs, echoes)]
    async for i, out in gen.outputs():
        if out.error:
            raise APIError(out.error, status=500)
        acc = accs[i]
        if acc is not None and out.prompt_logprobs is not None and body.echo:
            _add_prompt_lps(acc, reqs[i], out.prompt_logprobs)
        texts[i] += out.text
        if acc is not None:
            _add_output_lps(acc, out)
        if out.finished:
            finals[i] = out
    choices = [
        {
            "index": i,
            "text": texts[i],
            "logprobs": accs[i].take() if accs[i] else None,
            "finish_reason": f.finish_reason,
            "matched_stop": None if f.finish_reason == "length" else f.matched_stop,
        }
        for i, f in enumerate(finals)
    ]
    return JSONResponse(
        {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": body.model,
            "choices": choices,
            "usage": _usage(reqs, finals, n_prompts),
        }
    )


async def _stream(state, gen, body, reqs, echoes, cid, created, include_usage, n_prompts):
    base = {"id": cid, "object": "text_completion", "created": created, "model": body.model}
    accs = [_new_lp(state, body, r, e) for r, e in zip(reqs, echoes)]
    pending_echo = list(echoes)
    finals = [None] * len(reqs)
    continuous = continuous_usage(body)
    per_prompt = len(reqs) // n_prompts
    prompt_seen: dict[int, int] = {}
    generated = [0] * len(reqs)
    # With logprobs, each index's latest chunk waits for the next output: a finish that brings
    # no token (the stop token is left out) then rides on it, as SGLang's finish does, instead
    # of a chunk whose logprobs list nothing.
    held: dict[int, dict] = {}
    try:
        async for i, out in gen.outputs():
            if out.error:
                for chunk in held.values():
                    yield sse(chunk)
                held.clear()
                yield sse({"error": APIError(out.error, status=500).body()["error"]})
                break
            acc = accs[i]
            if acc is not None and out.prompt_logprobs is not None and body.echo:
                _add_prompt_lps(acc, reqs[i], out.prompt_logprobs)
            if acc is not None:
                _add_output_lps(acc, out)
            text = pending_echo[i] + out.text
            pending_echo[i] = ""
            if out.finished:
                finals[i] = out
            lps = acc.take() if acc is not None and acc.data["tokens"] else None
            if not (text or out.finished or lps):
                continue
            extra = {}
            if continuous:  # usage so far; each prompt's tokens count once
                prompt_seen[i // per_prompt] = out.prompt_tokens
                generated[i] = out.completion_tokens
                extra["usage"] = usage(sum(prompt_seen.values()), sum(generated), out.cached_tokens)
            prev = held.pop(i, None)
            if acc is not None and prev is not None and out.finished and not text and lps is None:
                chunk = {**prev, **extra}
                chunk["choices"] = [{**prev["choices"][0], "finish_reason": out.finish_reason}]
            else:
                if prev is not None:
                    yield sse(prev)
                choice = {"index": i, "text": text, "logprobs": lps, "finish_reason": None}
                if out.finished:
                    choice["finish_reason"] = out.finish_reason
                chunk = {**base, "choices": [choice], **extra}
            if out.finished:
                chunk["choices"][0]["matched_stop"] = None if out.finish_reason == "length" else out.matched_stop
                yield sse(chunk)
            elif acc is not None:
                held[i] = chunk
            else:
                yield sse(chunk)
        if include_usage and all(finals):
            yield sse({**base, "choices": [], "usage": _usage(reqs, finals, n_prompts)})
    except APIError as exc:  # shutdown or queue timeout: what was generated goes out first
        for chunk in held.values():
            yield sse(chunk)
        yield sse(exc.body())
    finally:
        gen.cancel()
    yield sse_done()
