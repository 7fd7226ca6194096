"""``POST /separate_reasoning`` and ``POST /parse_function_call``: llmkit's parsers over HTTP.

SGLang offers these so that clients generating elsewhere can reuse the server's parsers. The text
is parsed as a complete, finished output (the same machines as streaming, fed in one piece).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from pydantic import BaseModel, Field

from llmkit.core.parsing.tool_parser import create_tool_parser
from llmkit.core.plugins import PluginError
from llmkit.core.server.body import parse_model, read_json
from llmkit.core.server.errors import error_response
from llmkit.core.server.generation.reasoning import named_reasoning
from llmkit.core.server.nullable import NullMeansDefault


class SeparateReasoningRequest(NullMeansDefault):
    text: str
    reasoning_parser: str
    # Optional context, as the server would pass it: the rendered prompt and template kwargs.
    prompt: str = ""
    chat_template_kwargs: dict[str, Any] | None = None


class SeparateReasoningResponse(BaseModel):
    reasoning_text: str
    text: str


class ParseFunctionCallRequest(NullMeansDefault):
    text: str
    tool_call_parser: str
    tools: list[dict[str, Any]] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    tool_index: int
    name: str
    parameters: str  # the arguments as JSON text


class ParseFunctionCallResponse(BaseModel):
    normal_text: str
    calls: list[FunctionCallItem]


def parser_router() -> APIRouter:
    """The router serving both endpoints; the server includes it in its app. Bodies go through
    the server's one reader (size cap, OpenAI-shaped 400s), not FastAPI's model parsing."""
    router = APIRouter()

    @router.post("/separate_reasoning", response_model=SeparateReasoningResponse)
    async def separate_reasoning(raw: HTTPRequest):
        req = parse_model(SeparateReasoningRequest, await read_json(raw))
        try:  # resolved as a chat request's parser is (generation/reasoning.py), named by the request
            parser = named_reasoning(
                req.reasoning_parser, prompt_text=req.prompt, template_kwargs=req.chat_template_kwargs
            ).new_parser()
        except PluginError as exc:
            return error_response(str(exc), 400, param="reasoning_parser")
        reasoning, text = await asyncio.to_thread(parser.parse, req.text)  # long texts: off the loop
        return SeparateReasoningResponse(reasoning_text=reasoning, text=text)

    @router.post("/parse_function_call", response_model=ParseFunctionCallResponse)
    async def parse_function_call(raw: HTTPRequest):
        req = parse_model(ParseFunctionCallRequest, await read_json(raw))
        try:
            parser = create_tool_parser(req.tool_call_parser, tools=req.tools)
        except PluginError as exc:
            return error_response(str(exc), 400, param="tool_call_parser")
        text, calls = await asyncio.to_thread(parser.parse, req.text)
        items = [
            FunctionCallItem(tool_index=_tool_index(req.tools, c.name), name=c.name, parameters=c.arguments)
            for c in calls
        ]
        return ParseFunctionCallResponse(normal_text=text, calls=items)

    return router


def _tool_index(tools: list[dict[str, Any]], name: str) -> int:
    """Position of the called function in ``tools`` (-1 when the request gave none), as SGLang."""
    for i, tool in enumerate(tools):
        if (tool.get("function") or tool).get("name") == name:
            return i
    return -1
