"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request is translated into a chat completion (``translate``) and served by the chat run; only
the shapes differ, and every error leaves in Anthropic's shape.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from llmkit.core.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from llmkit.core.server.anthropic.translate import to_chat
from llmkit.core.server.errors import APIError, anthropic_error, in_shape


def anthropic_router(state) -> APIRouter:
    router = APIRouter()

    async def parse(raw: HTTPRequest, cls):
        from llmkit.core.server.body import parse_model, read_json

        body = parse_model(cls, await read_json(raw))
        cap = state.options.max_system_blocks
        if isinstance(body.system, list) and len(body.system) > cap:
            raise APIError(f"system: at most {cap} blocks (--max-system-blocks)", param="system")
        return body

    def guarded(handler):
        """Every error leaves in Anthropic's shape."""
        return in_shape(handler, anthropic_error)

    async def messages(raw: HTTPRequest) -> Response:
        from llmkit.core.server.anthropic.stream import message_object, stream_message
        from llmkit.core.server.openai.chat_events import complete_chat, start_chat_stream
        from llmkit.core.server.state import new_id

        body = await parse(raw, MessagesRequest)
        chat = to_chat(body)
        mid = new_id("msg_")
        if body.stream:
            from fastapi.responses import StreamingResponse

            events = await start_chat_stream(state, chat)
            return StreamingResponse(stream_message(events, body, mid), media_type="text/event-stream")
        result = await complete_chat(state, chat, raw)
        if isinstance(result, Response):
            return result
        return JSONResponse(message_object(result, body, mid))

    async def count_tokens(raw: HTTPRequest) -> Response:
        from llmkit.core.server.prompts.chat_template import TemplateRenderError, check_template_kwargs
        from llmkit.core.server.prompts.prompt import check_prompt_size, message_chars, render_chat, tokenize_text
        from llmkit.core.server.prompts.render_pool import run_render

        chat = to_chat(await parse(raw, CountTokensRequest))
        check_prompt_size(state, message_chars(chat), "messages")  # the generation bound, before rendering
        try:
            text = await run_render(state, render_chat, state, chat, check_template_kwargs(chat.chat_template_kwargs))
        except TemplateRenderError as exc:
            raise APIError(str(exc), param="messages") from None
        ids = await tokenize_text(state, text, param="messages", generate=False)
        from llmkit.core.server.prompts.images import attach_images, chat_images

        images = chat_images(chat)
        if images:  # each image counts as its tokens
            ids, _ = await attach_images(state, ids, images, "messages")
        return JSONResponse({"input_tokens": len(ids)})

    router.add_api_route("/v1/messages", guarded(messages), methods=["POST"])
    router.add_api_route("/v1/messages/count_tokens", guarded(count_tokens), methods=["POST"])
    return router
