"""From request to token ids: chat-template rendering and tokenization (off the event loop)."""

from __future__ import annotations

import asyncio
import json
from functools import lru_cache

from llmkit.core.server.errors import APIError

# A prompt longer than the context times this many characters cannot fit, whatever its tokens
# (real text averages 3-5 characters per token), so it is refused before the tokenizer runs: a
# 6 MB prompt without spaces would otherwise cost seconds of CPU to earn its 400.
MAX_CHARS_PER_TOKEN = 32


@lru_cache(maxsize=8)
def _chars_per_token(tokenizer) -> int:
    """The longest token's length, capped: a bound on characters per token for this vocabulary."""
    try:
        longest = max(len(t) for t in tokenizer.get_vocab())
    except (AttributeError, TypeError, ValueError):
        longest = MAX_CHARS_PER_TOKEN
    return max(1, min(longest, MAX_CHARS_PER_TOKEN))


@lru_cache(maxsize=8)
def _drops_whitespace(tokenizer) -> bool:
    """Whether the tokenizer drops runs of whitespace (BERT's WordPiece; SentencePiece that
    collapses them) instead of giving them tokens: a long run then tokenizes as one space does."""
    try:
        one, run = (tokenizer(f"a{gap}a", add_special_tokens=False)["input_ids"] for gap in (" ", " " * 256))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: count every character
        return False
    return list(one) == list(run)


def token_chars(tokenizer, text: str) -> int:
    """The characters of ``text`` its tokens cover, as :func:`check_prompt_size` counts them: all
    of them, less ASCII whitespace where the tokenizer drops it (else a text aligned with spaces
    would count as longer than its tokens can be)."""
    n = len(text)
    if n and _drops_whitespace(tokenizer):
        n -= sum(text.count(c) for c in " \t\n\r\f\v")
    return n


def check_unicode(text: str, param: str) -> None:
    """A lone surrogate (JSON's ``"\\ud800"``) is no character UTF-8 can hold, and a tokenizer
    raises a TypeError on it: a 400 naming the field, before anything reads the text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError("the text contains invalid Unicode (a lone surrogate)", param=param) from None


def check_prompt_size(state, chars: int, param: str) -> None:
    """The cheap bound, checked on a character count before any rendering or tokenizing. The
    counting routes (/tokenize, count_tokens) take it too: past it the tokenizer's seconds of CPU
    would only earn a number larger than the context."""
    if chars > state.options.max_prompt_size:
        raise APIError(
            f"the prompt is longer than {state.options.max_prompt_size} characters (--max-prompt-size)",
            param=param,
            code="context_length_exceeded",
        )
    if chars > state.max_context * _chars_per_token(state.tokenizer):
        raise APIError(
            f"The input ({chars} characters, so more than {state.max_context} tokens) is longer than "
            f"the model's context length ({state.max_context} tokens).",
            param=param,
            code="context_length_exceeded",
        )


def message_chars(body) -> int:
    """Characters of text in the messages (the rendered prompt is at least this long)."""
    n = 0
    for m in body.messages:
        if isinstance(m.content, str):
            n += len(m.content)
        elif isinstance(m.content, list):
            n += sum(len(p.text or "") for p in m.content)
    return n


def message_dicts(body, images: bool = False) -> list[dict]:
    """Messages as the chat template expects them (tool-call arguments as dicts). ``images``: the
    model takes images, so a message with image parts keeps its content as a list of parts, each
    image a ``{"type": "image"}`` part where the template writes the model's placeholder."""
    out = []
    for i, m in enumerate(body.messages):
        d: dict = {"role": m.role}
        content = m.content
        if isinstance(content, list):
            texts, parts = [], []
            for j, part in enumerate(content):
                if images and part.type == "image_url":
                    parts.append({"type": "image"})
                    continue
                if part.type != "text" or part.text is None:
                    kind = "images" if part.type == "image_url" else f"content part type '{part.type}'"
                    raise APIError(
                        f"messages[{i}].content[{j}]: {kind} not supported by this text-only model",
                        param=f"messages[{i}].content[{j}]",
                    )
                texts.append(part.text)
                parts.append({"type": "text", "text": part.text})
            content = parts if len(parts) > len(texts) else "".join(texts)
        d["content"] = content if content is not None else ""
        if m.role == "tool" and not m.tool_call_id:
            raise APIError("tool messages need a tool_call_id", param=f"messages[{i}].tool_call_id")
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args else {}
                    except json.JSONDecodeError:
                        pass
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        out.append(d)
    return out


def render_chat(state, body, kwargs: dict) -> str:
    if state.chat_template is None:
        raise APIError(
            "this model has no chat template; start the server with --chat-template FILE or use /v1/completions",
            param="messages",
        )
    messages = message_dicts(body, images=state.mm is not None)
    tools = None
    if body.tools and body.tool_choice != "none":
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        if isinstance(body.tool_choice, dict):  # a named choice shows only that tool
            name = body.tool_choice.get("function", {}).get("name")
            tools = [t for t in tools if t["function"]["name"] == name]
    if tools:
        from llmkit.core.server.prompts.tool_prompt import inject_tools, template_supports_tools

        if not template_supports_tools(state.chat_template):
            forced = body.tool_choice == "required" or isinstance(body.tool_choice, dict)
            parser = "json_array" if forced else state.options.tool_call_parser
            if parser:
                messages = inject_tools(messages, tools, parser)
    cont = body.continue_final_message and messages and messages[-1]["role"] == "assistant"
    text = state.chat_template.render(messages, add_generation_prompt=not cont, tools=tools, extra=kwargs)
    if cont:
        # Continue the final assistant message: cut the rendering right after its content.
        final = messages[-1]["content"]
        pos = text.rfind(final) if final else -1
        if pos == -1:
            raise APIError(
                "continue_final_message: the final message's content was not found in the rendered template",
                param="messages",
            )
        text = text[: pos + len(final)]
    return text


async def tokenize_text(
    state, text: str, param: str, *, add_special_tokens: bool = False, generate: bool = True
) -> list[int]:
    """``text``'s token ids. ``generate``: the text is a prompt to generate from, so it must give
    at least one token (a text of only characters the tokenizer drops gives none, and the model
    cannot start from nothing); /tokenize and count_tokens pass False."""
    check_prompt_size(state, len(text), param)
    check_unicode(text, param)
    if len(text) < 2048:
        ids = state.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    else:
        ids = await asyncio.to_thread(lambda: state.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    if generate and not ids:
        raise APIError(f"the {param} tokenizes to zero tokens: there is nothing to generate from", param=param)
    return ids
