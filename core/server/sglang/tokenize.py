"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` (with ``/v1/`` aliases) and ``GET /version``.

``/tokenize`` takes a ``prompt`` (special tokens added by default, as the completions path would
not) or chat ``messages`` rendered with the server's chat template exactly as the chat endpoint
renders them, so ``count`` is the prompt size a chat request would have.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from llmkit.core.server.errors import APIError
from llmkit.core.server.nullable import RequestModel
from llmkit.core.server.openai.protocol import ChatCompletionRequest
from llmkit.core.server.prompts.chat_template import TemplateRenderError, check_template_kwargs
from llmkit.core.server.prompts.prompt import check_prompt_size, message_dicts, render_chat, tokenize_text
from llmkit.core.server.prompts.render_pool import run_render


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


def _raw_chars(messages: list[dict]) -> int:
    """Characters of text in messages not yet validated (the rendered prompt is at least this long)."""
    n = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


def _render(state, body: TokenizeRequest) -> str:
    if body.add_generation_prompt and body.continue_final_message:
        raise APIError(
            "add_generation_prompt and continue_final_message cannot both be true", param="continue_final_message"
        )
    try:
        kwargs = check_template_kwargs(body.chat_template_kwargs)
    except ValueError as exc:
        raise APIError(str(exc), param="chat_template_kwargs") from None
    from llmkit.core.server.body import parse_model

    chat = parse_model(
        ChatCompletionRequest,
        {"messages": body.messages, "tools": body.tools, "continue_final_message": body.continue_final_message},
    )
    try:
        if body.add_generation_prompt or body.continue_final_message:
            return render_chat(state, chat, kwargs)  # the chat endpoint's own rendering
        if state.chat_template is None:
            return render_chat(state, chat, kwargs)  # raises the "no chat template" error
        tools = [t.model_dump(exclude_none=True) for t in chat.tools or []]
        return state.chat_template.render(
            message_dicts(chat, images=state.mm is not None),
            add_generation_prompt=False,
            tools=tools or None,
            extra=kwargs,
        )
    except TemplateRenderError as exc:
        raise APIError(str(exc), param="messages") from None


def tokenize_router(state) -> APIRouter:
    router = APIRouter()

    async def parse(raw: HTTPRequest, cls):
        from llmkit.core.server.body import parse_model, read_json

        return parse_model(cls, await read_json(raw))

    async def tokenize(raw: HTTPRequest):
        body = await parse(raw, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("exactly one of prompt or messages is required", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise APIError("Messages cannot be empty.", param="messages")
            check_prompt_size(state, _raw_chars(body.messages), "messages")  # before rendering: cheap
            text = await run_render(state, _render, state, body)
            special = bool(body.add_special_tokens)  # the template already has its special tokens
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        # The generation routes' bounds: characters before tokenizing (off the event loop), then
        # tokens, which also caps the answer (ids and token strings) at the context's size.
        ids = await tokenize_text(state, text, "prompt", add_special_tokens=special, generate=False)
        if body.messages is not None and state.mm is not None:  # each image counts as its tokens
            from llmkit.core.server.body import parse_model
            from llmkit.core.server.prompts.images import attach_images, chat_images

            images = chat_images(parse_model(ChatCompletionRequest, {"messages": body.messages}))
            if images:
                ids, _ = await attach_images(state, ids, images, "messages")
        if len(ids) > state.max_context:
            raise APIError(
                f"The input ({len(ids)} tokens) is longer than the model's context length ({state.max_context} tokens).",
                param="prompt" if body.messages is None else "messages",
                code="context_length_exceeded",
            )
        strs = state.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": state.max_context, "tokens": ids, "token_strs": strs}

    async def detokenize(raw: HTTPRequest):
        body = await parse(raw, DetokenizeRequest)
        if len(body.tokens) > state.max_context:  # no prompt or answer is longer: caps the answer too
            raise APIError(
                f"at most {state.max_context} tokens (the model's context length) per request",
                param="tokens",
                code="context_length_exceeded",
            )
        bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise APIError(f"token ids {bad[:10]} are out of vocabulary (size {state.vocab_size})", param="tokens")
        if len(body.tokens) < 2048:
            return {"prompt": state.tokenizer.decode(body.tokens)}
        return {"prompt": await asyncio.to_thread(state.tokenizer.decode, body.tokens)}

    for prefix in ("", "/v1"):
        router.add_api_route(prefix + "/tokenize", tokenize, methods=["POST"])
        router.add_api_route(prefix + "/detokenize", detokenize, methods=["POST"])

    @router.get("/version")
    async def version():
        try:
            return {"version": package_version("llmkit")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    return router
