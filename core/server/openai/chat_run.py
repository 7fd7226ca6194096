"""A chat completion as a run: validated, rendered, its requests started, and its outputs read
through the parsers into OpenAI's chat objects (dicts, not yet JSON).

``openai/chat.py`` sends them as JSON or SSE; ``chat_events`` reads the same objects for the APIs
served by chat (Anthropic Messages, Responses), so every API gets the same validation and text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import Request as HTTPRequest

from llmkit.core.engine.messages import GenerateRequest
from llmkit.core.server.errors import APIError
from llmkit.core.server.generation.choice_text import ChoiceProcessor
from llmkit.core.server.generation.length_limit import check_max_tokens
from llmkit.core.server.generation.logprobs import chat_logprobs
from llmkit.core.server.generation.reasoning import RequestReasoning, named_reasoning, request_reasoning
from llmkit.core.server.generation.sampling import build_sampling_params, seed_for_choice
from llmkit.core.server.model_names import resolve_adapter
from llmkit.core.server.openai.protocol import ChatCompletionRequest
from llmkit.core.server.prompts.chat_template import TemplateRenderError, check_template_kwargs
from llmkit.core.server.prompts.images import attach_images, chat_images
from llmkit.core.server.prompts.prompt import check_prompt_size, message_chars, render_chat, tokenize_text
from llmkit.core.server.prompts.render_pool import run_render
from llmkit.core.server.state import ServerState, new_id, start_generation, usage
from llmkit.core.server.streaming import check_stream_options, continuous_usage


def _validate_tools(body: ChatCompletionRequest) -> None:
    tc = body.tool_choice
    names = [t.function.name for t in body.tools or []]
    if len(set(names)) != len(names):
        raise APIError("tool names must be unique", param="tools")
    if tc == "required" and not names:
        raise APIError("Tools cannot be empty if tool choice is set to required.", param="tool_choice")
    if isinstance(tc, dict):
        name = (tc.get("function") or {}).get("name")
        if not names:
            raise APIError("Tools cannot be empty if tool choice is set to a specific tool.", param="tool_choice")
        if name not in names:
            raise APIError(f"Tool '{name}' not found in tools list.", param="tool_choice")


async def start_chat(
    state: ServerState,
    body: ChatCompletionRequest,
    raw: HTTPRequest | None,
    priority: int = 0,
    http: bool | None = None,
):
    """Check and start ``body``; its generation runs from now on (queue slots are held until each
    choice ends). ``http``: whether this serves an HTTP client (drained on shutdown, queue
    timeout); by default, whether there is a ``raw`` request (batch lines have none)."""
    lora = await resolve_adapter(state, body, raw)
    if "chat_template" in (body.model_extra or {}):  # templates are the operator's, never a request's
        raise APIError(
            "chat_template in a request is not supported; the server's template is set with --chat-template",
            param="chat_template",
        )
    if not body.messages:
        raise APIError("Messages cannot be empty.", param="messages")
    check_stream_options(body)
    _validate_tools(body)
    # the field the client sent (Responses' max_output_tokens and Anthropic's max_tokens arrive as max_tokens)
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    check_max_tokens(max_tokens, max_param)  # a field check, before the prompt is rendered
    try:
        kwargs = check_template_kwargs(body.chat_template_kwargs)
    except ValueError as exc:
        raise APIError(str(exc), param="chat_template_kwargs") from None
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    check_prompt_size(state, message_chars(body), "messages")  # before rendering: cheap
    try:
        prompt_text = await run_render(state, render_chat, state, body, kwargs)
    except TemplateRenderError as exc:
        raise APIError(str(exc), param="messages") from None
    prompt_ids = await tokenize_text(state, prompt_text, param="messages")
    mm, images = None, chat_images(body)
    if images:
        prompt_ids, mm = await attach_images(state, prompt_ids, images, "messages")
    top_lp = body.top_logprobs or 0
    if top_lp and not body.logprobs:
        raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
    params = build_sampling_params(
        body,
        prompt_len=len(prompt_ids),
        max_context=state.max_context,
        vocab_size=state.vocab_size,
        max_tokens=max_tokens,
        logprobs=body.logprobs,
        top_logprobs=top_lp,
        defaults=state.sampling_defaults,
        max_tokens_param=max_param,
    )
    # The reasoning parser, decided once for the request: special tokens, the grammar's wait for
    # the answer and each choice's text all read this one.
    reasoning = request_reasoning(state, body, prompt_text, kwargs)
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if body.tool_choice != "none" else None
    if params.skip_special_tokens and _needs_special_tokens(state, reasoning, tools):
        from dataclasses import replace

        params = replace(params, skip_special_tokens=False)  # parser markers are special tokens

    cid = new_id("chatcmpl-")
    reqs = [
        GenerateRequest(
            rid=f"{cid}-{i}",
            prompt_ids=prompt_ids,
            params=seed_for_choice(params, i),
            priority=priority,
            lora=lora,
            mm=mm,
            cache_salt=getattr(body, "cache_salt", None),
        )
        for i in range(body.n)
    ]
    from llmkit.core.server.generation.reasoning_budget import reasoning_budget
    from llmkit.core.server.generation.structured import attach_grammar

    grammar_reasoning = reasoning
    if reasoning is None and state.options.reasoning_parser and reasoning_budget(body) is not None:
        # separate_reasoning: false still has a reasoning section, and its budget still holds
        grammar_reasoning = named_reasoning(
            state.options.reasoning_parser, prompt_text=prompt_text, template_kwargs=dict(kwargs)
        )
    constraint = await attach_grammar(state, body, reqs, grammar_reasoning)
    if constraint is not None and reasoning is not None:
        # the parsers start where the constrained answer does
        reasoning = reasoning.after_prompt_suffix(constraint.prompt_suffix)
    # "required" or a named tool_choice decodes a JSON array of calls under a grammar (unless the
    # request brought its own constraint), so those calls are read with the json_array parser.
    forced = constraint is not None and constraint.param == "tool_choice"
    tool_parser = "json_array" if forced else state.options.tool_call_parser
    procs = [ChoiceProcessor(reasoning=reasoning, tool_parser=tool_parser, tools=tools) for _ in reqs]
    gen = start_generation(state, reqs, http=raw is not None if http is None else http)
    return ChatRun(state, body, reqs, procs, gen, cid, int(time.time()))


def _needs_special_tokens(state, reasoning: RequestReasoning | None, tools) -> bool:
    if tools and state.options.tool_call_parser:
        return True
    return reasoning is not None and reasoning.keep_special_tokens


def _finish_reason(proc: ChoiceProcessor, reason: str | None) -> str | None:
    return "tool_calls" if proc.made_tool_calls and reason == "stop" else reason


def _chat_usage(state, finals, procs) -> dict:
    """One prompt shared by every choice; completions add up. Reasoning tokens are the separated
    reasoning re-tokenized (exact up to merges at the tag edges)."""
    reasoning = sum(
        len(state.tokenizer(p.reasoning_text, add_special_tokens=False)["input_ids"]) for p in procs if p.reasoning_text
    )
    return usage(
        finals[0].prompt_tokens,
        sum(f.completion_tokens for f in finals),
        max(f.cached_tokens for f in finals),
        reasoning,
    )


@dataclass
class ChatRun:
    state: ServerState
    body: ChatCompletionRequest
    reqs: list[GenerateRequest]
    procs: list[ChoiceProcessor]
    gen: object  # the started generation (state.start_generation)
    cid: str
    created: int

    async def complete(self) -> dict:
        """The ``chat.completion`` object, once every choice has finished."""
        return await _complete(self.state, self.gen, self.body, self.reqs, self.procs, self.cid, self.created)

    def chunks(self, include_usage: bool):
        """The ``chat.completion.chunk`` objects as they come (an ``{"error": ...}`` object ends a
        failed stream); closing the iterator cancels the generation."""
        args = self.state, self.gen, self.body, self.reqs, self.procs, self.cid, self.created
        return _chunks(*args, include_usage)


async def _complete(state, gen, body, reqs, procs, cid, created) -> dict:
    texts = [""] * len(reqs)
    finals = [None] * len(reqs)
    lps: list[list] = [[] for _ in reqs]
    async for i, out in gen.outputs():
        if out.error:
            raise APIError(out.error, status=500)
        texts[i] += out.text
        lps[i].extend(_content_logprobs(out))
        if out.finished:
            finals[i] = out
    choices = []
    for i, (proc, fin) in enumerate(zip(procs, finals)):
        proc.feed(texts[i])
        proc.finish(fin.finish_reason)
        calls = proc.final_tool_calls()
        reason = _finish_reason(proc, fin.finish_reason)
        msg = {
            "role": "assistant",
            "content": (proc.content_text or None) if calls else proc.content_text,
            "reasoning_content": proc.reasoning_text or None,
            "tool_calls": calls or None,
        }
        choices.append(
            {
                "index": i,
                "message": msg,
                "logprobs": {"content": chat_logprobs(state.tokenizer, lps[i])} if body.logprobs else None,
                "finish_reason": reason,
                "matched_stop": None if reason in ("length", "tool_calls") else fin.matched_stop,
            }
        )
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": body.model,
        "choices": choices,
        "usage": _chat_usage(state, finals, procs),
    }


async def _chunks(state, gen, body, reqs, procs, cid, created, include_usage):
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": body.model}

    continuous = continuous_usage(body)
    completion_tokens = [0] * len(reqs)

    def usage_now(i, out):
        """Running usage for ``stream_options.continuous_usage_stats`` (None when not asked)."""
        if not continuous:
            return None
        completion_tokens[i] = out.completion_tokens
        return usage(out.prompt_tokens, sum(completion_tokens), out.cached_tokens)

    def chunk(i, delta, finish=None, matched=None, logprobs=None, usage=None):
        # SGLang clients read delta.reasoning_content on every chunk: the key is always there.
        delta.setdefault("reasoning_content", None)
        c = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            c["matched_stop"] = matched
        extra = {"usage": usage} if usage is not None else {}
        return {**base, "choices": [c], **extra}

    try:
        for i in range(len(reqs)):  # continuous usage starts with the prompt's size, as vLLM's
            first = usage(len(reqs[i].prompt_ids), 0, 0) if continuous else None
            yield chunk(i, {"role": "assistant", "content": ""}, usage=first)
        finals = {}
        # Logprobs of tokens that produced no delta yet (a held stop-string prefix, a partial
        # character, a parser marker) ride on the next chunk that has one: no empty deltas.
        pending_lps: list[list] = [[] for _ in reqs]
        async for i, out in gen.outputs():
            if out.error:
                yield {"error": APIError(out.error, status=500).body()["error"]}
                break
            proc = procs[i]
            d = proc.feed(out.text) if out.text else None
            if body.logprobs:
                pending_lps[i].extend(_content_logprobs(out))
            if out.finished:
                tail = proc.finish(out.finish_reason)
                d = _join(d, tail)
            delta = _delta_dict(d)
            if delta:
                lp = None
                if body.logprobs:
                    lp = {"content": chat_logprobs(state.tokenizer, pending_lps[i])}
                    pending_lps[i] = []
                yield chunk(i, delta, logprobs=lp, usage=usage_now(i, out))
            if out.finished:
                finals[i] = out
                reason = _finish_reason(proc, out.finish_reason)
                matched = None if reason in ("length", "tool_calls") else out.matched_stop
                lp = {"content": chat_logprobs(state.tokenizer, pending_lps[i])} if pending_lps[i] else None
                yield chunk(i, {}, finish=reason, matched=matched, logprobs=lp, usage=usage_now(i, out))
        if include_usage and finals:
            yield {**base, "choices": [], "usage": _chat_usage(state, list(finals.values()), procs)}
    except APIError as exc:
        yield exc.body()
    finally:
        gen.cancel()


def _content_logprobs(out) -> list:
    """The output's logprobs without the stop token's: a matched stop token id is not part of
    the message (OpenAI does not return its logprob either)."""
    lps = out.logprobs
    if (
        out.finished
        and lps
        and out.finish_reason == "stop"
        and isinstance(out.matched_stop, int)
        and out.token_ids
        and out.token_ids[-1] == out.matched_stop
        and lps[-1].token_id == out.matched_stop
    ):
        return lps[:-1]
    return list(lps)


def _join(a, b):
    if a is None:
        return b
    a.reasoning += b.reasoning
    a.content += b.content
    a.tool_calls += b.tool_calls
    return a


def _delta_dict(d) -> dict:
    out: dict = {}
    if d is None:
        return out
    if d.reasoning:
        out["reasoning_content"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        out["tool_calls"] = d.tool_calls
    return out
