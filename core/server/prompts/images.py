"""A prompt's images: found in the request, fetched and decoded (``multimodal.media``), turned
into the model's tokens by its processor. The engine gets the token ids and the images beside
them (``GenerateRequest.mm``)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from llmkit.core.multimodal.fetch import image_bytes
from llmkit.core.multimodal.media import (
    TRIM_PIXELS,
    MediaError,
    MediaPolicy,
    decode_image,
    inline_bytes,
    is_inline,
    release_memory,
)
from llmkit.core.server.errors import APIError
from llmkit.core.server.generation.length_limit import check_prompt_fits

# decoding off the event loop; fetching never runs here (it waits on the event loop)
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="llmkit-media")


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
    items = await load_images(sources, state.media, state.mm, param)
    try:
        ids, mm = state.mm.expand(list(prompt_ids), items)
    except ValueError as exc:
        raise APIError(f"{param}: {exc}", param=param) from None
    check_prompt_fits(len(ids), state.max_context, param, what="The prompt with its images")
    return ids, mm


async def load_images(sources: list[tuple[str, str, bool]], policy: MediaPolicy, processor, param: str) -> list:
    """``(source, param, bare_base64)`` per image, in prompt order: each fetched, decoded and
    preprocessed in the media threads. Raises ``APIError`` naming the part that failed."""
    if len(sources) > policy.max_images:
        raise APIError(
            f"{len(sources)} images: a request may carry at most {policy.max_images} (--max-images-per-request)",
            param=param,
        )

    async def one(source: str, bare: bool):
        # fetches wait on the event loop, never in a media thread: those only decode, so images
        # in the request itself never queue behind other requests' slow URLs
        data = None if is_inline(source, bare) else await image_bytes(source, policy, bare)

        def decode():
            raw = inline_bytes(source, policy, bare) if data is None else data
            image = decode_image(raw, policy, processor.target_size)
            item = processor.preprocess(image)
            if image.width * image.height >= TRIM_PIXELS // 4:  # the processor's float copies of it
                release_memory()
            return item

        return await asyncio.get_running_loop().run_in_executor(_POOL, decode)

    results = await asyncio.gather(*(one(src, bare) for src, _, bare in sources), return_exceptions=True)
    for (_, param, _), res in zip(sources, results):
        if isinstance(res, MediaError):
            raise APIError(f"{param}: {res}", param=param)
        if isinstance(res, BaseException):
            raise APIError(f"{param}: the image could not be processed ({type(res).__name__})", param=param)
    return list(results)
