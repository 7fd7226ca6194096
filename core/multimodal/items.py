"""What a request carries about its images, from the server to the engine (picklable)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

# Pseudo-ids start here, far above any vocabulary: an image's tokens are ``PSEUDO_BASE`` plus a
# 30-bit slice of its hash, so they never collide with a real token and differ between images.
PSEUDO_BASE = 1 << 40
_PSEUDO_SPAN = 1 << 30


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pseudo_id(digest: str) -> int:
    return PSEUDO_BASE + int(digest[:15], 16) % _PSEUDO_SPAN


def is_pseudo(token_id: int) -> bool:
    return token_id >= PSEUDO_BASE


def image_token_of(config: dict) -> int:
    """The image placeholder token a vision-language model's config names (Qwen-VL's
    ``image_token_id``, Gemma 3's and LLaVA's ``image_token_index``; 0 for a text model): what a
    draft model or head reads in place of an image's pseudo-ids, which have no embedding row."""
    return int(config.get("image_token_id", config.get("image_token_index", 0)) or 0)


def as_placeholders(ids: list[int], placeholder: int) -> list[int]:
    """``ids`` with each pseudo-id replaced by ``placeholder``."""
    return [placeholder if t >= PSEUDO_BASE else t for t in ids]


@dataclass
class ImageItem:
    """One image, preprocessed for its model (by the model's processor, off the event loop)."""

    digest: str  # content hash of the decoded pixels and their preprocessing: the cache key
    pixel_values: torch.Tensor  # in the layout the model's ``encode_images`` reads
    num_tokens: int  # prompt tokens it fills = rows ``encode_images`` returns for it
    meta: dict = field(default_factory=dict)  # model-specific (Qwen2.5-VL: "grid_thw")


@dataclass
class MultimodalInputs:
    """The images of one prompt and where their rows sit in it."""

    items: list[ImageItem]
    spans: list[tuple[int, int]]  # (offset, length) of each image's tokens in the prompt ids
    # M-RoPE models: per prompt token its (t, h, w) positions as three lists, and the shift of every
    # later (generated) token's position: position p rotates by p + rope_delta on all three axes.
    rope_positions: list[list[int]] | None = None
    rope_delta: int = 0
    # Image tokens attend to each other both ways (Gemma 3): a prefill chunk never splits an image.
    bidirectional: bool = False

    def image_at(self, pos: int) -> int | None:
        """The index of the image whose span holds prompt position ``pos`` (None: text)."""
        for i, (off, n) in enumerate(self.spans):
            if off <= pos < off + n:
                return i
        return None
