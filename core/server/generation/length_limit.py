"""The length limit, decided in one place: how many tokens a request may generate, given its
prompt, the ``max_tokens`` it asked for and the model's context.

Every generating route (chat completions, completions, Responses and Anthropic Messages through
chat, SGLang's ``/generate``) asks :func:`max_new_tokens`; the checks and their messages are
OpenAI's and SGLang's (clients and tests match on them):

* ``max_tokens`` below 1 is refused as a request field, before the prompt is rendered or
  tokenized (OpenAI refuses it at validation);
* a prompt of the whole context or more is refused: no token would fit after it;
* an explicit ``max_tokens`` that does not fit beside the prompt is refused (``prompt +
  max_tokens > context``), not silently shortened, as vLLM and SGLang do; a route's own default
  (completions' 16, ``/generate``'s 128) counts as asked for, as there;
* ``max_tokens`` left out (or null) means "up to the context": ``context - prompt``.

A prompt that images grow is checked with :func:`check_prompt_fits` as soon as its size is known
(``prompts/images.py``), in the same words. ``/tokenize`` only counts, and keeps its own bound.
"""

from __future__ import annotations

from llmkit.core.server.errors import APIError


def check_max_tokens(max_tokens: int | None, param: str = "max_tokens") -> None:
    """The request field alone: None (not sent) or a positive count."""
    if max_tokens is not None and max_tokens <= 0:
        raise APIError(f"{param} must be positive", param=param)


def check_prompt_fits(prompt_len: int, max_context: int, param: str, what: str = "The input") -> None:
    """A prompt leaves room for at least one token (``what``: how the message names it)."""
    if prompt_len >= max_context:
        raise APIError(
            f"{what} ({prompt_len} tokens) is longer than the model's context length ({max_context} tokens).",
            param=param,
            code="context_length_exceeded",
        )


def max_new_tokens(
    prompt_len: int,
    max_tokens: int | None,
    max_context: int,
    *,
    param: str = "max_tokens",
    prompt_param: str = "messages",
) -> int:
    """The most tokens the request may generate (the engine's ``max_new_tokens``); raises a 400
    naming ``param`` (the field the client sent) or ``prompt_param`` (its prompt)."""
    check_max_tokens(max_tokens, param)
    check_prompt_fits(prompt_len, max_context, prompt_param)
    if max_tokens is None:
        return max_context - prompt_len
    if prompt_len + max_tokens > max_context:
        raise APIError(
            f"Requested token count exceeds the model's maximum context length of {max_context} "
            f"tokens. You requested a total of {prompt_len + max_tokens} tokens: {prompt_len} tokens "
            f"from the input messages and {max_tokens} tokens for the completion. Please reduce the "
            "number of tokens in the input messages or the completion to fit within the limit.",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens
