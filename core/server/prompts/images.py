"""A prompt's images: found in the request, fetched and decoded (``multimodal.media``), turned
into the model's tokens by its processor. The engine gets the token ids and the images beside
them (``GenerateRequest.mm``)."""

from __future__ import annotations

from llmkit.core.server.errors import APIError


def chat_images(body) -> list[tuple[str, str, bool]]:
    """``(url, param, False)`` for each ``image_url`` part of a chat request, in prompt order."""
    out = []
    for i, m in enumerate(body.messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            if part.type != "image_url":
                continue
            param = f"messages[{i}].content[{j}].image_url"
            ref = (part.model_extra or {}).get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str) or not url:
                raise APIError(f"{param}: an image_url part needs image_url.url (a string)", param=param)
            out.append((url, param, False))
    return out


async def attach_images(state, prompt_ids: list[int], sources: list[tuple[str, str, bool]], param: str):
    """``(prompt ids with each image's tokens, MultimodalInputs)``; a 400 for anything wrong."""
    if state.mm is None:
        raise APIError("images are not supported by this text-only model", param=sources[0][1])
    from llmkit.core.multimodal.media import load_images

    items = await load_images(sources, state.media, state.mm)
    try:
        ids, mm = state.mm.expand(list(prompt_ids), items)
    except ValueError as exc:
        raise APIError(f"{param}: {exc}", param=param) from None
    if len(ids) >= state.max_context:
        raise APIError(
            f"The prompt with its images is {len(ids)} tokens: longer than the model's context length "
            f"({state.max_context} tokens).",
            param=param,
            code="context_length_exceeded",
        )
    return ids, mm
